"""Judge `bench_trust_stats.py` files against an exact tier's thresholds (issue 27).

Reads one or more trust-stats JSON files of one engine mix (raw per-rollout figures),
pools the honest sets and the cheats by name, and recomputes every rollout's verdict
under a verification file's thresholds (`bench_trust_stats.rejected_by`): honest
rejections (target 0), per cheat the share rejected, the share of its rollouts holding a
token off the replayed seeded choice (a gap above `verifier.checks.OFF_REPLAY_GAP`: what an
exact tier can see at all; a rollout without one is what an honest node would have sent),
and which checks fired. Also the honest maxima that say whether the mix is exact.

    python tests/bench/exact_tier.py tests/bench/results/trust_stats_h100_slots_b.json.gz \
        tests/bench/results/trust_stats_h100_slots_a.json.gz --strategies-from 0 \
        --judge configs/verification/smollm2-torch-cuda-bf16-exact.toml \
        --out tests/bench/results/exact_tier_h100.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from protocol.messages import VerificationPolicy  # noqa: E402
from tests.bench.bench_trust_stats import rejected_by  # noqa: E402
from verifier.checks import OFF_REPLAY_GAP  # noqa: E402


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["strategies"]


def honest_maxima(rs: list[dict]) -> dict:
    def worst(key):
        return max((max(r["chunks"][key], default=0) for r in rs), default=0)

    return {
        "rollouts": len(rs),
        "tokens": sum(r["tokens"] for r in rs),
        "max_logprob_err": max(max(r["logprob_err"] or [0]) for r in rs),
        "max_score_gap": max(max(r["score_gap"] or [0]) for r in rs),
        "tokens_off_replay": sum(sum(g > OFF_REPLAY_GAP for g in r["score_gap"]) for r in rs),
        "max_exp_mismatches": worst("exp_mismatches"),
        "max_mant_err_mean": worst("mant_err_mean"),
        "max_mant_err_median": worst("mant_err_median"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--judge", required=True, help="verification TOML whose thresholds judge")
    ap.add_argument(
        "--strategies-from",
        type=int,
        default=None,
        help="take the cheats from this file only (index into FILES); honest sets from all",
    )
    ap.add_argument("--out", required=True, help="JSON to write")
    args = ap.parse_args(argv)
    with open(args.judge, "rb") as f:
        policy = VerificationPolicy(**tomllib.load(f)["verification"])
    honest: list[dict] = []
    cheats: dict[str, list[dict]] = {}
    for i, path in enumerate(args.files):
        for name, s in load(path).items():
            if name.startswith("honest"):
                honest += s["rollouts"]
            elif args.strategies_from is None or args.strategies_from == i:
                cheats.setdefault(name, []).extend(s["rollouts"])
    maxima = honest_maxima(honest)
    honest_rejected = sum(bool(rejected_by(r, policy)) for r in honest)
    rows = {}
    for name, rs in cheats.items():
        verdicts = [rejected_by(r, policy) for r in rs]
        by: dict[str, int] = {}
        for v in verdicts:
            for check in v:
                by[check] = by.get(check, 0) + 1
        rows[name] = {
            "rollouts": len(rs),
            "rejected": sum(bool(v) for v in verdicts) / len(rs),
            "holding_a_token_off_replay": sum(
                any(g > OFF_REPLAY_GAP for g in r["score_gap"]) for r in rs
            )
            / len(rs),
            "off_replay_per_token": sum(sum(g > OFF_REPLAY_GAP for g in r["score_gap"]) for r in rs)
            / max(1, sum(r["tokens"] for r in rs)),
            "by_check": by,
        }
    console = Console()
    console.print(f"honest: {maxima} -> rejected {honest_rejected} of {len(honest)}")
    table = Table(title=f"cheats judged by {Path(args.judge).name}")
    for col in (
        "strategy",
        "rollouts",
        "rejected",
        "holding a token off",
        "off per token",
        "checks",
    ):
        table.add_column(col, justify="left" if col in ("strategy", "checks") else "right")
    for name, r in rows.items():
        table.add_row(
            name,
            str(r["rollouts"]),
            f"{r['rejected']:.3f}",
            f"{r['holding_a_token_off_replay']:.3f}",
            f"{r['off_replay_per_token']:.4f}",
            ", ".join(f"{k} {v}" for k, v in sorted(r["by_check"].items())),
        )
    console.print(table)
    report = {
        "files": args.files,
        "judge": args.judge,
        "honest": maxima,
        "honest_rejected": honest_rejected,
        "cheats": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
