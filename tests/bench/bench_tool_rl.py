#!/usr/bin/env python
"""Agentic RL through the pool (issue 29), against the single-turn run of the same size,
side by side in one invocation on this machine.

Both runs: the tiny model after its SFT warm-up (tool-call transcripts for the tool run,
`configs/rl/sft-tool-arithmetic-tiny.toml`; reverse-text for the single-turn one), a fresh
pool of `--workers` real `prime-node join` workers on loopback, then `prime-trainer rl`
for `--steps` steps with the same batch, group size and trainer (learning rate: 2e-4 for
the tool run, as its test; reverse-text's 5e-4); the tool run on tool-arithmetic (add two
numbers with the `add` tool, run on the trusted side), the single-turn run on
reverse-text.

Per step: mean reward, and for the tool run turns per episode, tool calls per episode and
the share of call blocks that did not parse. Per run: the trainer's wall clock per step
(between consecutive steps' metrics, the first two excluded) and the ratio tool over
single-turn. Writes `<out>.json` and `<out>.png` (reward per step of both, calls per
episode), prints a table.

    .venv/bin/python tests/bench/bench_tool_rl.py --steps 24 --out tests/bench/results/tool_rl_cpu
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

from tests.rl_runs import (  # noqa: E402
    TOOL_RL_ARGS,
    RunFailed,
    check_finished,
    rl_args,
    serving_pool,
    sft_warmup,
    trainer_cli,
)
from trainer.monitor import read_metrics  # noqa: E402


def sft(run: Path, config: str) -> Path:
    out = trainer_cli(
        "sft", "@", config, "--run-dir", str(run), "--monitor.progress", "false", timeout=1800
    )
    if out.returncode:
        raise RunFailed(out.stderr[-3000:])
    return run / "final"


def run_one(name: str, model: Path, work: Path, args: argparse.Namespace, extra) -> dict:
    size = ("--max-steps", str(args.steps), "--batch-size", str(args.batch_size))
    size += ("--group-size", str(args.group_size))
    if not extra:  # the single-turn run packs as the tool run (TOOL_RL_ARGS) does
        size += ("--trainer.micro-batch-tokens", "1024")
    with serving_pool(work / name, model, workers=args.workers) as pool:
        run = work / name / "run"
        check_finished(trainer_cli(*rl_args(pool, model, run, *size, *extra), timeout=3600), run)
    made = read_metrics(run, "orchestrator")
    trained = read_metrics(run, "trainer")
    walls = [b["time"] - a["time"] for a, b in zip(trained, trained[1:], strict=False)][1:]
    per_step = [
        {
            "step": r["step"],
            "reward": r["reward_mean"],
            "turns_per_episode": r.get("turns_per_episode"),
            "tool_calls_per_episode": r.get("tool_calls_per_episode"),
            "tool_calls_invalid_share": r.get("tool_calls_invalid_share"),
        }
        for r in made
    ]
    rewards = [r["reward"] for r in per_step]
    fifth = max(1, len(rewards) // 5)
    return {
        "run": name,
        "steps": len(per_step),
        "reward_first_fifth": statistics.fmean(rewards[:fifth]),
        "reward_last_fifth": statistics.fmean(rewards[-fifth:]),
        "wall_s_per_step": statistics.median(walls) if walls else None,
        "turns_per_episode": statistics.fmean(r["turns_per_episode"] or 0 for r in per_step),
        "tool_calls_per_episode": statistics.fmean(
            r["tool_calls_per_episode"] or 0 for r in per_step
        ),
        "tool_calls_invalid_share": statistics.fmean(
            r["tool_calls_invalid_share"] or 0 for r in per_step
        ),
        "per_step": per_step,
    }


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_c) = plt.subplots(1, 2, figsize=(11, 3.8))
    for r in rows:
        x = [s["step"] for s in r["per_step"]]
        ax_r.plot(x, [s["reward"] for s in r["per_step"]], marker=".", lw=1, label=r["run"])
    ax_r.set(title="mean reward per step", xlabel="step", ylabel="reward")
    ax_r.legend()
    tool = rows[0]["per_step"]
    x = [s["step"] for s in tool]
    ax_c.plot(x, [s["tool_calls_per_episode"] for s in tool], marker=".", label="calls / episode")
    ax_c.plot(x, [s["turns_per_episode"] for s in tool], marker=".", label="turns / episode")
    ax_c.plot(x, [s["tool_calls_invalid_share"] for s in tool], marker=".", label="unparsed share")
    ax_c.set(title="tool run: turns and calls", xlabel="step")
    ax_c.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("tests/bench/results/tool_rl_cpu"))
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-tool-rl-"))
    tool_model = sft(work / "sft-tools", "configs/rl/sft-tool-arithmetic-tiny.toml")
    text_model, _ = sft_warmup(work / "sft-text")
    rows = [
        run_one("tool-arithmetic", tool_model, work, args, TOOL_RL_ARGS),
        run_one("reverse-text", text_model, work, args, ()),
    ]
    tool, single = rows
    report = {
        "args": vars(args) | {"out": str(args.out)},
        "rows": rows,
        "wall_ratio_tool_over_single_turn": tool["wall_s_per_step"] / single["wall_s_per_step"],
    }
    t = Table(title="tool RL against single-turn RL of the same size (tiny model, CPU pool)")
    cols = ("run", "reward first/last fifth", "s/step", "turns/ep", "calls/ep", "unparsed")
    for c in cols:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(
            r["run"],
            f"{r['reward_first_fifth']:.3f} / {r['reward_last_fifth']:.3f}",
            f"{r['wall_s_per_step']:.2f}",
            f"{r['turns_per_episode']:.2f}",
            f"{r['tool_calls_per_episode']:.2f}",
            f"{r['tool_calls_invalid_share']:.1%}",
        )
    console = Console()
    console.print(t)
    console.print(
        f"time per step, tool / single-turn: {report['wall_ratio_tool_over_single_turn']:.2f}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    plot(rows, args.out.with_suffix(".png"))
    console.print(f"wrote {args.out}.json and .png")


if __name__ == "__main__":
    main()
