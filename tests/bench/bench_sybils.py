#!/usr/bin/env python
"""Sybil benchmark (issue 26): k free identities of each strategy against three honest
founders of an open pool whose right to check is earned, for k = 1, 3 and 12, real
processes on loopback (`tests.sybil_attacks.run_attack`: a scheduler and `prime-node
join` workers on the tiny model), next to the run without attackers and, per strategy,
the control where every admitted node checks at once (the pool before issue 26).

Per run: honest workers penalised (reputation losses) and banned, rollouts of a cheat
released (what the trainer would train on), attackers banned and the verdicts they gave,
and accepted rollouts per minute against the run without attackers (measured side by
side in this process; the pool's throughput stands in for the trainer's steps per minute:
a step waits for its batch of accepted rollouts).

How to read it: absolute rates belong to this shared 2-core machine (k = 12 runs fifteen
worker processes on it), the ratios to the baseline carry over better.

Outputs: a rich table, PREFIX.json and PREFIX.png (accepted per minute, relative to the
baseline, per strategy and k).

    python tests/bench/bench_sybils.py --out tests/bench/results/sybils_cpu
    python tests/bench/bench_sybils.py --ks 3 --requests 120 --out /tmp/sybils  # quick
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

from tests.sybil_attacks import STRATEGIES, run_attack  # noqa: E402

COLUMNS = (
    "honest_penalised",
    "honest_banned",
    "cheat_released",
    "attackers_banned",
    "attacker_verdicts",
    "accepted",
    "accepted_per_min",
)


def plot(runs: list[dict], baseline: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    earned = [r for r in runs if r["rights"] == "earned" and r["strategy"] != "none"]
    ks = sorted({r["k"] for r in earned})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(ks)
    for i, k in enumerate(ks):
        ys = [
            next(
                (
                    r["accepted_per_min"] / baseline
                    for r in earned
                    if r["strategy"] == s and r["k"] == k
                ),
                0,
            )
            for s in STRATEGIES
        ]
        ax.bar([j + i * width for j in range(len(STRATEGIES))], ys, width, label=f"k = {k}")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks([j + width * (len(ks) - 1) / 2 for j in range(len(STRATEGIES))], STRATEGIES)
    ax.set_ylabel("accepted / min, relative to no attackers")
    ax.set_title("Open pool, rights earned: throughput under each Sybil strategy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3, 12])
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--control-k", type=int, default=3, help="k of the at-once controls (0: none)")
    ap.add_argument("--out", type=Path, default=REPO / "tests/bench/results/sybils_cpu")
    args = ap.parse_args()
    plan = [("none", 0, True)]
    plan += [(s, k, True) for s in STRATEGIES for k in args.ks]
    if args.control_k:
        plan += [(s, args.control_k, False) for s in STRATEGIES]
    console = Console()
    runs: list[dict] = []
    t0 = time.time()
    with Progress(console=console) as progress:
        task = progress.add_task("runs", total=len(plan))
        for strategy, k, earned in plan:
            progress.update(
                task, description=f"{strategy} k={k} {'earned' if earned else 'at-once'}"
            )
            with tempfile.TemporaryDirectory(prefix="sybils-") as tmp:
                runs.append(run_attack(Path(tmp), strategy, k, args.requests, earned))
            progress.advance(task)
    baseline = runs[0]["accepted_per_min"]
    table = Table(title=f"Sybils: {args.requests} requests, 3 honest founders (tiny model, CPU)")
    for c in ("strategy", "k", "rights", *COLUMNS, "vs none"):
        table.add_column(c, justify="right")
    for r in runs:
        r["throughput_vs_none"] = round(r["accepted_per_min"] / baseline, 3)
        table.add_row(
            r["strategy"],
            str(r["k"]),
            r["rights"],
            *(str(r[c]) for c in COLUMNS),
            f"{r['throughput_vs_none']:.2f}",
        )
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {
        "args": {**vars(args), "out": str(args.out)},
        "seconds": round(time.time() - t0),
        "runs": runs,
    }
    args.out.with_suffix(".json").write_text(json.dumps(out, indent=1))
    plot(runs, baseline, args.out.with_suffix(".png"))
    console.print(f"wrote {args.out.with_suffix('.json')} and .png")


if __name__ == "__main__":
    main()
