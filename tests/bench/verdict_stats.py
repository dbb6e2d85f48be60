"""How close a run's honest verifications came to the pool's thresholds.

Reads every verdict a run's scheduler stored (`<run_dir>/swarm/scheduler.db` of a local
swarm: each row keeps the verifier-signed verdict with its checks' metrics), re-opens the
signed verdicts, and reports per metric the median, the 99.9th percentile, the worst value
and how many verdicts exceeded the pool's threshold (the mean logprob error against
`VerificationPolicy.logprob_mean_limit` of its length), with the time and reasons of every
rejection. In an all-honest pool every rejection is a false one: this is where the
false-rejection rate of a real run, and the data to calibrate again, come from.

    python tests/bench/verdict_stats.py --run-dir /opt/run \\
        --verification configs/verification/smollm2-torch-cuda-bf16.toml --out res/verdicts
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import sys
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from protocol.envelope import open_envelope  # noqa: E402
from protocol.messages import Verdict, VerificationPolicy  # noqa: E402

METRICS = {  # metric -> (check, policy threshold field)
    "max_abs_diff": ("logprobs", "max_logprob_abs_diff"),
    "mean_abs_diff": ("logprobs", None),  # judged by logprob_mean_limit(tokens)
    "max_score_gap": ("sampling", "sampling_tolerance"),
    "exp_mismatches": ("proof", "max_exp_mismatches"),
    "mant_err_mean": ("proof", "max_mant_err_mean"),
    "mant_err_median": ("proof", "max_mant_err_median"),
}


def read_verdicts(db: Path) -> list[dict]:
    rows = sqlite3.connect(db).execute(
        "SELECT created_at, kind, accepted, reasons, verdict_envelope FROM verdicts ORDER BY id"
    )
    out = []
    for created, kind, accepted, reasons, env in rows:
        verdict = open_envelope(env, Verdict, check_expiry=False).message
        rec = {"t": created, "kind": kind, "accepted": bool(accepted), "reasons": reasons}
        for c in verdict.checks:
            for k, v in c.metrics.items():
                if k in METRICS and METRICS[k][0] == c.name:
                    rec[k] = v
            if c.name == "logprobs":
                rec["tokens"] = int(c.metrics.get("tokens", 0))
                if "clipped_mean_abs_diff" in c.metrics:  # the per-node evidence's score
                    rec["clipped_mean_abs_diff"] = c.metrics["clipped_mean_abs_diff"]
        out.append(rec)
    return out


def _q(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(verdicts: list[dict], policy: VerificationPolicy) -> dict:
    t0 = min((v["t"] for v in verdicts), default=0.0)
    metrics = {}
    for k, (_, field) in METRICS.items():
        vals = [v for v in verdicts if k in v]
        if not vals:
            continue
        if field is None:
            over = sum(v[k] > policy.logprob_mean_limit(v["tokens"]) for v in vals)
            limit = policy.max_logprob_mean_abs_diff
        else:
            limit = getattr(policy, field)
            over = sum(v[k] > limit for v in vals)
        xs = [v[k] for v in vals]
        metrics[k] = {
            "median": _q(xs, 0.5),
            "p999": _q(xs, 0.999),
            "max": max(xs),
            "threshold": limit,
            "over": over,
        }
    rejected = [
        {"at_s": round(v["t"] - t0, 1), "tokens": v.get("tokens"), "reasons": v["reasons"]}
        for v in verdicts
        if not v["accepted"]
    ]
    return {
        "verdicts": len(verdicts),
        "rejected": len(rejected),
        "metrics": metrics,
        "rejections": rejected,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--verification", type=Path, required=True, help="the pool's thresholds")
    ap.add_argument("--out", type=Path, required=True, help="writes <out>.json")
    args = ap.parse_args()
    policy = VerificationPolicy(**tomllib.loads(args.verification.read_text())["verification"])
    verdicts = read_verdicts(args.run_dir / "swarm" / "scheduler.db")
    res = summarize(verdicts, policy)
    res["per_verdict"] = verdicts
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res))
    table = Table(title=f"{res['verdicts']} verdicts, {res['rejected']} rejected")
    for col in ("metric", "median", "p99.9", "max", "threshold", "over"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for k, m in res["metrics"].items():
        table.add_row(
            k, *(f"{m[x]:.4g}" for x in ("median", "p999", "max", "threshold")), str(m["over"])
        )
    Console().print(table)
    for r in res["rejections"]:
        print(f"  at {r['at_s']} s ({r['tokens']} tokens): {r['reasons']}")


if __name__ == "__main__":
    main()
