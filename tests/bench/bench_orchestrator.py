#!/usr/bin/env python
"""The orchestrator a researcher expects (issue 30), on the CPU main job: the same
`prime-trainer rl` run of configs/rl/reverse-text-tiny.toml three ways, side by side in one
invocation: plain; with online evaluation through the pool (`[orchestrator.eval]`: every
`--eval-interval` versions, `--eval-examples` held-out prompts at priority 1); with
difficulty filtering (`[orchestrator.buffer]`); and, plain and filtered, on reverse-text
with about half its prompts already solved (tests/envs/mixed_difficulty_env.py).

Each run: the tiny model after its SFT warm-up (one, shared), a fresh pool of `--workers`
real workers on loopback, `--steps` steps. Per run: trainer wall clock per step (between
consecutive steps' metrics, the first two excluded), reward of the first and last fifth,
rollouts the pool generated and the share the trainer got, and the eval scores. Writes
`<out>.json` and `<out>.png` (reward per step of the three runs with the eval curve over
them; cumulative trained share), prints a table. Absolute seconds are this box's only:
read the ratios.

    .venv/bin/python tests/bench/bench_orchestrator.py --steps 50 --out tests/bench/results/orchestrator_cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tests.rl_runs import rl_through_pool, sft_warmup  # noqa: E402
from trainer.monitor import read_metrics  # noqa: E402

EVAL_ENV = "reverse-text"
# Reverse-text with about half its prompts already solved (the tiny model masters none
# within such a run): where difficulty filtering has something to set aside.
MIXED = (
    "--orchestrator.env.id", "tests.envs.mixed_difficulty_env:load_environment",
    "--orchestrator.env.args", '{"num_examples": 48}',
)  # fmt: skip


def variants(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    env = json.dumps([{"id": EVAL_ENV, "args": {"num_examples": 48, "num_eval_examples": 32}}])
    return {
        "plain": (),
        "online eval": (
            "--orchestrator.eval.envs", env,
            "--orchestrator.eval.interval", str(args.eval_interval),
            "--orchestrator.eval.num-examples", str(args.eval_examples),
            "--orchestrator.eval.sampling.max-tokens", "12",
        ),
        "difficulty buffer": ("--orchestrator.buffer.enabled", "true"),
        "solved half, plain": MIXED,
        "solved half, buffer": (*MIXED, "--orchestrator.buffer.enabled", "true"),
    }  # fmt: skip


def run_one(name: str, model: Path, work: Path, args, extra: tuple[str, ...]) -> dict:
    run, took = rl_through_pool(
        work / name.replace(" ", "-"), model, "--max-steps", str(args.steps), *extra,
        workers=args.workers,
    )  # fmt: skip
    made, trained = read_metrics(run, "orchestrator"), read_metrics(run, "trainer")
    walls = [b["time"] - a["time"] for a, b in zip(trained, trained[1:], strict=False)][1:]
    rewards = [r["reward_mean"] for r in made]
    fifth = max(1, len(rewards) // 5)
    generated = sum(r["rollouts_generated"] for r in made)
    evals = [
        {"version": r["step"], "reward": r[f"eval/{EVAL_ENV}/reward_mean"], "s": r["eval_s"]}
        for r in read_metrics(run, "eval")
    ]
    return {
        "run": name,
        "steps": len(trained),
        "rl_wall_s": took,
        "wall_s_per_step": statistics.median(walls) if walls else None,
        "reward_first_fifth": statistics.fmean(rewards[:fifth]),
        "reward_last_fifth": statistics.fmean(rewards[-fifth:]),
        "rollouts_generated": generated,
        "rollouts_trained": sum(r["samples"] for r in made),
        "trained_share": sum(r["samples"] for r in made) / generated,
        "uniform_groups_dropped": sum(r.get("dropped_uniform_group", 0) for r in made),
        "evals": evals,
        "per_step": [
            {
                "step": r["step"],
                "reward": r["reward_mean"],
                "generated": r["rollouts_generated"],
                "trained": r["samples"],
                "revisited": r.get("sampled_revisit", 0),
                "prompts_set_aside": sum(
                    r.get(f"prompts_{k}", 0) for k in ("easy", "hard", "flat")
                ),
            }
            for r in made
        ],
    }


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_s) = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, r in enumerate(rows):
        x = [s["step"] for s in r["per_step"]]
        ax_r.plot(x, [s["reward"] for s in r["per_step"]], lw=1, color=f"C{i}", label=r["run"])
        if r["evals"]:
            ax_r.plot(
                [e["version"] for e in r["evals"]],
                [e["reward"] for e in r["evals"]],
                marker="o",
                color=f"C{i}",
                ls="--",
                label=f"{r['run']}: eval (held-out prompts)",
            )
        gen = trained = 0
        share = []
        for s in r["per_step"]:
            gen, trained = gen + s["generated"], trained + s["trained"]
            share.append(trained / gen)
        ax_s.plot(x, share, color=f"C{i}", label=r["run"])
    ax_r.set(title="mean reward per step", xlabel="step (eval: version)", ylabel="reward")
    ax_r.legend(fontsize=8)
    ax_s.set(title="trained / generated rollouts, cumulative", xlabel="step", ylim=(0.3, 1.02))
    ax_s.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--eval-interval", type=int, default=5)
    ap.add_argument("--eval-examples", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("tests/bench/results/orchestrator_cpu"))
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-orchestrator-"))
    model, _ = sft_warmup(work / "sft")
    rows = [run_one(name, model, work, args, extra) for name, extra in variants(args).items()]
    plain, with_eval, buffered, mixed, mixed_buffered = rows
    report = {
        "args": vars(args) | {"out": str(args.out)},
        "rows": rows,
        "wall_ratio_eval_over_plain": with_eval["wall_s_per_step"] / plain["wall_s_per_step"],
        "trained_share_buffer_over_plain": buffered["trained_share"] / plain["trained_share"],
        "trained_share_buffer_over_plain_solved_half": mixed_buffered["trained_share"]
        / mixed["trained_share"],
    }
    t = Table(title=f"orchestrator variants, {args.steps} steps each (tiny model, CPU pool)")
    cols = ("run", "s/step", "reward first/last fifth", "generated", "trained", "share", "evals")
    for c in cols:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(
            r["run"],
            f"{r['wall_s_per_step']:.2f}",
            f"{r['reward_first_fifth']:.3f} / {r['reward_last_fifth']:.3f}",
            str(r["rollouts_generated"]),
            str(r["rollouts_trained"]),
            f"{r['trained_share']:.1%}",
            " ".join(f"v{e['version']}:{e['reward']:.2f}" for e in r["evals"]) or "-",
        )
    console = Console()
    console.print(t)
    console.print(
        f"time per step, eval / plain: {report['wall_ratio_eval_over_plain']:.2f}; "
        f"trained share, buffer / plain: {report['trained_share_buffer_over_plain']:.2f} "
        f"(solved half: {report['trained_share_buffer_over_plain_solved_half']:.2f})"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    plot(rows, args.out.with_suffix(".png"))
    console.print(f"wrote {args.out}.json and .png")


if __name__ == "__main__":
    main()
