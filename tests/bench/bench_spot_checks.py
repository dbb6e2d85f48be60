"""Per-node spot checks against verifying every rollout: what verification costs workers.

The same `prime-trainer rl` run (configs/rl/reverse-text-tiny.toml, `--steps` steps) on
two fresh pools of real processes side by side (a scheduler and three workers on
loopback, the tiny fp32 exact mix): one verifying every rollout, one with per-node rates
(`VerificationPolicy.spot_checks`: every rollout of a node checked until `--full-until`
of its rollouts were accepted, then halving every `--halving`, down to `--floor`; a
skipped rollout held until its node passes its next check). Per pool: the share of worker
busy time spent verifying (each worker's `/health` `busy_s`), rollouts released verified
and unverified, the rl command's wall time and steps per minute, and the stated bound:
unchecked cheat rollouts before a node's first checked one (1 - 1e-3 of the time) at
the floor. Absolute times are for this 2-core box; read the ratios.

    .venv/bin/python tests/bench/bench_spot_checks.py --steps 30 --out tests/bench/results/spot_checks_cpu
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from protocol.messages import SpotCheckPolicy, VerificationPolicy  # noqa: E402
from tests.pools import make_pool, tiny_verification  # noqa: E402
from tests.rl_runs import FAST_HEARTBEATS, run_rl, summarize, worker_health  # noqa: E402

UNVERIFIED = "unverified (spot check)"


def measure(workdir: Path, verification: VerificationPolicy, steps: int) -> dict:
    pool = make_pool(workdir, model="tiny", verification=verification)
    try:
        pool.start_scheduler(*FAST_HEARTBEATS)
        pool.join_many(["w0", "w1", "w2"])
        run = workdir / "run"
        wall = run_rl(pool, Path("tiny"), run, "--max-steps", str(steps), timeout=1800)
        health = [h for h in worker_health(pool).values() if h]
    finally:
        pool.close()
    gen = sum(h["busy_s"]["generate"] for h in health)
    ver = sum(h["busy_s"]["verify"] for h in health)
    db = sqlite3.connect(workdir / "scheduler.db")
    rows = db.execute("SELECT detail, count(*) FROM results GROUP BY detail").fetchall()
    db.close()
    unverified = sum(n for d, n in rows if d == UNVERIFIED)
    released = sum(n for _, n in rows)
    return {
        "steps": summarize(run)["steps"],
        "rl_wall_s": wall,
        "steps_per_min": steps / wall * 60,
        "worker_generate_s": gen,
        "worker_verify_s": ver,
        "worker_verify_share": ver / (gen + ver),
        "released": released,
        "released_unverified": unverified,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--full-until", type=int, default=32)
    ap.add_argument("--halving", type=int, default=16)
    ap.add_argument("--floor", type=float, default=0.1)
    ap.add_argument("--hold-s", type=float, default=10.0)
    ap.add_argument("--out", type=Path, default=Path("tests/bench/results/spot_checks_cpu"))
    args = ap.parse_args()
    spot = SpotCheckPolicy(
        full_until=args.full_until, halving=args.halving, floor=args.floor, hold_s=args.hold_s
    )
    base = tiny_verification()
    policies = {
        "every rollout": base,
        "per node": base.model_copy(update={"spot_checks": spot}),
    }
    console = Console()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, policy in policies.items():
            console.print(f"[bold]{name}[/]: {args.steps} steps through a fresh pool")
            results[name] = measure(Path(tmp) / name.replace(" ", "_"), policy, args.steps)
            console.print(results[name])
    every, per_node = results["every rollout"], results["per node"]
    table = Table(title=f"spot checks on this CPU box ({args.steps} rl steps, tiny fp32)")
    table.add_column("figure")
    for name in results:
        table.add_column(name, justify="right")
    table.add_column("per node / every", justify="right")
    for key in ("worker_verify_share", "steps_per_min", "released", "released_unverified"):
        a, b = every[key], per_node[key]
        ratio = f"{b / a:.2f}" if a else "-"
        table.add_row(key.replace("_", " "), f"{a:.3g}", f"{b:.3g}", ratio)
    console.print(table)
    bound = spot.bound(1e-3)
    console.print(
        f"bound at the floor {spot.floor:g}: at most {bound} unchecked cheat rollouts before "
        f"a node's first checked one, 999 times in 1,000 (a node cheating on every rollout: "
        "none released, they are held)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "policy": spot.model_dump(),
        "bound_1e-3": bound,
        "runs": results,
    }
    args.out.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    console.print(f"wrote {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
