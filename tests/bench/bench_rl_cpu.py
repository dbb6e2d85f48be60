"""RL pipeline on this CPU box: how long the trainer waits on the orchestrator.

One SFT warm-up of the tiny model on reverse-text, then the same `prime-trainer rl` run
(configs/rl/reverse-text-tiny.toml) through a real pool (scheduler + three workers on
loopback, every rollout verified) at async_level 0, 1 and 2, side by side. Per run:
trainer step time, trainer idle time per step (its wait for the next batch: the
orchestrator's overhead as the trainer sees it), idle fraction, orchestrator time per
batch, reward of the first and last fifth of the steps. Absolute seconds are for this
2-core box only; read the ratios between async levels.

    .venv/bin/python tests/bench/bench_rl_cpu.py --steps 15 --out tests/bench/results/rl_cpu
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tests.rl_runs import rl_through_pool, sft_warmup, summarize  # noqa: E402
from trainer.monitor import read_metrics  # noqa: E402

COLUMNS = [
    ("trainer_step_s", "step s"),
    ("trainer_idle_s", "idle s/step"),
    ("trainer_idle_fraction", "idle frac"),
    ("orchestrator_generate_s", "orch s/batch"),
    ("reward_first_fifth", "reward 1st 5th"),
    ("reward_last_fifth", "reward last 5th"),
]


def plot(runs: dict[int, Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_i, ax_r) = plt.subplots(1, 2, figsize=(10, 3.6))
    for level, run in runs.items():
        t = read_metrics(run, "trainer")
        o = read_metrics(run, "orchestrator")
        ax_i.plot(
            [r["step"] for r in t], [r["idle_s"] for r in t], marker=".", label=f"async {level}"
        )
        ax_r.plot(
            [r["step"] for r in o],
            [r["reward_mean"] for r in o],
            marker=".",
            label=f"async {level}",
        )
    ax_i.set(title="trainer idle per step (waiting for a batch)", xlabel="step", ylabel="s")
    ax_r.set(title="mean reward per step", xlabel="step", ylabel="reward")
    ax_i.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--levels", default="0,1,2", help="async levels to compare")
    ap.add_argument("--out", type=Path, default=Path("tests/bench/results/rl_cpu"))
    args = ap.parse_args()
    console = Console()
    work = Path(tempfile.mkdtemp(prefix="bench-rl-"))
    with console.status("SFT warm-up"):
        model, sft_s = sft_warmup(work / "sft")
    results, runs = {}, {}
    for level in (int(x) for x in args.levels.split(",")):
        with console.status(f"RL at async_level {level}"):
            run, took = rl_through_pool(
                work / f"async{level}", model, "--max-steps", str(args.steps),
                "--async-level", str(level), async_level=level,
            )  # fmt: skip
        runs[level] = run
        results[level] = {**summarize(run), "rl_s": took}
    table = Table(title=f"RL on reverse-text, tiny model, 3 CPU workers, {args.steps} steps")
    table.add_column("async_level")
    for _, title in COLUMNS:
        table.add_column(title, justify="right")
    for level, r in results.items():
        table.add_row(str(level), *(f"{r[k]:.3f}" for k, _ in COLUMNS))
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps({"sft_s": sft_s, "steps": args.steps, "runs": results}, indent=2)
    )
    plot(runs, args.out)
    console.print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
