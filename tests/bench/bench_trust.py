"""Trust figures from measured verification statistics: per-rollout thresholds at a target
false-rejection rate, and the per-node evidence test, on honest and cheating rollouts.

Input: one or more `bench_trust_stats.py` JSON files of one engine mix (per rollout: every
check's metrics and the per-token score gaps; strategies honest_a, honest_b and the
cheats). Thresholds and the evidence model are calibrated on the first file's `honest_a`
(or on both its honest sets, `--calibrate-on all-honest`) exactly as `prime-node calibrate` does it (`verifier.calibration.propose` at
`--target-rate`, `propose_evidence`), then judged on data they never saw: every other
honest set of every file is pooled as `honest_b` (more files: more honest rollouts
judged), the cheats of all files are pooled by name.
- honest false rejections per rollout on `honest_b`;
- per strategy, the share of its rollouts the thresholds reject, and how many of its
  rollouts (and tokens) the per-node test needs before it flags the node (`--orders`
  random orders of its rollouts, resampled to `--max-rollouts`): median and maximum;
- per strategy, the rollouts until the node is banned either way: flagged, or its
  reputation under the default `ReputationPolicy` falls below the ban level from the
  disputes its rejected rollouts lose (what bans a cheat the thresholds mostly reject);
- honest nodes flagged over `--honest-nodes` nodes x `--max-rollouts` rollouts replayed
  from `honest_b` (target 0).
`--run-verdicts FILE` (`verdict_stats.py` JSON of an all-honest run: a real pool's regime,
its batch mixes and trained weights, which a bench's prompts do not reproduce) adds that
run's verdicts as honest rollouts: every other one calibrates too, as a regime of its own
(`propose_over_regimes`: each threshold the larger of the bench's and the run's), the rest
are judged as `honest_run` (with `--calibrate-on all-honest` all calibrate, and
`honest_run` is then judged in sample). Those verdicts carry each check's worst value, not
per-token score gaps, which is what `rejects` needs when no sampling mismatch is allowed.
`--judge-verdicts FILE` judges another run's verdicts only (`honest_heldout`): thresholds
fitted on one run, judged on the next.
Prints a table, writes JSON and a PNG of the per-node statistic over rollouts (honest
against each cheat); `--write-thresholds FILE` writes the calibrated table as TOML.

    .venv/bin/python tests/bench/bench_trust.py tests/bench/results/trust_stats_h200_smollm2_bf16.json \\
        --mix torch/bfloat16/cuda --out tests/bench/results/trust_h200_smollm2_bf16 \\
        --write-thresholds configs/verification/smollm2-torch-cuda-bf16.toml
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
from pathlib import Path

import tomli_w
from rich.console import Console
from rich.table import Table

from protocol.evidence import NodeEvidence
from protocol.messages import CheckResult, EngineMix, ReputationPolicy, VerificationPolicy
from verifier.calibration import propose_evidence, propose_over_regimes, rejects

console = Console(width=160)
HONEST_SETS = {"honest_a", "honest_b"}


def load_stats(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def checks_of(rollout: dict) -> list[CheckResult]:
    return [
        CheckResult(
            name=name,
            passed=bool(c.get("passed", True)),
            metrics={k: float(v) for k, v in c.items() if k != "passed"},
        )
        for name, c in rollout["checks"].items()
    ]


def run_rollouts(path: Path) -> list[dict]:
    """A run's verdicts (`verdict_stats.py`'s `per_verdict`) in `bench_trust_stats`'s form."""
    checks = {  # check -> the metrics verdict_stats keeps of it
        "sampling": ("max_score_gap",),
        "logprobs": ("max_abs_diff", "mean_abs_diff", "tokens", "clipped_mean_abs_diff"),
        "proof": ("exp_mismatches", "mant_err_mean", "mant_err_median"),
    }
    out = []
    for v in load_stats(path)["per_verdict"]:
        if "max_abs_diff" not in v:  # a verdict that ended before the numeric checks
            continue
        rollout = {name: {k: v[k] for k in keys if k in v} for name, keys in checks.items()}
        rollout["support"] = {"tokens_outside": 0.0}
        out.append({"checks": rollout, "score_gap": None})
    return out


def scored(rollouts: list[dict]) -> int:
    """How many of `rollouts` carry the per-node evidence's score (a run's verdicts may not)."""
    return sum("clipped_mean_abs_diff" in r["checks"]["logprobs"] for r in rollouts)


def rejected(rollout: dict, p: VerificationPolicy) -> bool:
    """Whether `p`'s thresholds reject a rollout, from its measured metrics."""
    return rejects(checks_of(rollout), p, rollout["score_gap"])


def score(rollout: dict) -> tuple[float, int]:
    lp = rollout["checks"]["logprobs"]
    return lp["clipped_mean_abs_diff"], int(lp["tokens"])


def until_flag(
    rollouts: list[dict], policy, n: int, rng: random.Random, rep: ReputationPolicy | None = None
) -> tuple[int, int, list, int]:
    """(rollouts, tokens) the per-node test needs to flag a node making these rollouts in
    a random order (resampled to `n`), (0, 0) if never; the statistic's path; and the
    rollouts until the node is banned by either way (0: never): the flag, or the reputation
    rule `rep` over its rollouts (each rejected one loses a dispute, each accepted one earns
    the reward; its verifier work is left out)."""
    rep = rep or ReputationPolicy()
    ev, tokens, path, reputation, banned_at = NodeEvidence(), 0, [], rep.initial, 0
    for i, r in enumerate((rng.choice(rollouts) for _ in range(n)), 1):
        s, t = score(r)
        tokens += t
        flagged = ev.add(policy.evidence, s, t)
        path.append(ev.statistic)
        if rejected(r, policy):
            reputation -= rep.penalty_lost_dispute
        else:
            reputation = min(1.0, reputation + rep.reward_accepted)
        if not banned_at and (flagged or reputation < rep.ban_below):
            banned_at = i
        if flagged:
            return ev.rollouts, tokens, path, banned_at
    return 0, 0, path, banned_at


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "stats", type=Path, nargs="+", help="bench_trust_stats.py JSON files (.json or .json.gz)"
    )
    ap.add_argument(
        "--calibrate-on",
        choices=["honest_a", "all-honest"],
        default="honest_a",
        help="the first file's sets that calibrate (all-honest: honest_a and honest_b)",
    )
    ap.add_argument("--mix", default="torch/bfloat16/cuda", help="engine/dtype/device")
    ap.add_argument("--target-rate", type=float, default=1e-4)
    ap.add_argument("--orders", type=int, default=200)
    ap.add_argument("--max-rollouts", type=int, default=1000)
    ap.add_argument("--honest-nodes", type=int, default=100)
    ap.add_argument("--out", type=Path, required=True, help="output prefix (.json, .png)")
    ap.add_argument("--write-thresholds", type=Path)
    ap.add_argument("--run-verdicts", type=Path, nargs="*", default=[], help="verdict_stats JSON")
    ap.add_argument(
        "--judge-verdicts",
        type=Path,
        nargs="*",
        default=[],
        help="verdict_stats JSON of other runs: judged as honest_heldout, never calibrated on",
    )
    args = ap.parse_args()
    files = [load_stats(path) for path in args.stats]
    data = files[0]
    calibrating = {"honest_a"} if args.calibrate_on == "honest_a" else HONEST_SETS
    calib = [r for name in sorted(calibrating) for r in data["strategies"][name]["rollouts"]]
    strategies: dict[str, list[dict]] = {}
    for i, stats in enumerate(files):
        for name, entry in stats["strategies"].items():
            if i == 0 and name in calibrating:
                continue
            pooled = "honest_b" if name.startswith("honest") else name
            strategies.setdefault(pooled, []).extend(entry["rollouts"])
    run = [r for path in args.run_verdicts for r in run_rollouts(path)]
    run_calib = run if args.calibrate_on == "all-honest" else run[::2]
    strategies["honest_run"] = run if args.calibrate_on == "all-honest" else run[1::2]
    strategies["honest_heldout"] = [r for path in args.judge_verdicts for r in run_rollouts(path)]
    strategies = {k: v for k, v in strategies.items() if v}
    engine, dtype, device = args.mix.split("/")
    policy = propose_over_regimes(
        [[checks_of(r) for r in calib], [checks_of(r) for r in run_calib]],
        VerificationPolicy(),
        args.target_rate,
    )
    policy = policy.model_copy(
        update={
            # The regime with the largest honest mean error sets the model: a fit to the
            # short, low-entropy completions of an RL run (mean 0.008) flags every honest
            # node of the bench's long ones (0.04), so the regimes are never pooled here.
            "evidence": max(
                (
                    propose_evidence([checks_of(r) for r in rs])
                    for rs in (calib, run_calib)
                    if scored(rs) >= 2
                ),
                key=lambda e: e.mu,
            ),
            "engine_mixes": [EngineMix(engine=engine, dtype=dtype, device=device)],
        }
    )
    rng = random.Random(0)
    rows, paths = {}, {}
    for name, rollouts in strategies.items():
        rej = sum(rejected(r, policy) for r in rollouts) / len(rollouts)
        if name in ("honest_run", "honest_heldout") and scored(rollouts) < len(rollouts):
            rows[name] = {
                "rollouts": len(rollouts),
                "rejected_per_rollout": rej,
                "in_sample": args.calibrate_on == "all-honest",
            }
            continue
        if name.startswith("honest"):
            flags = [
                until_flag(rollouts, policy, args.max_rollouts, rng)
                for _ in range(args.honest_nodes)
            ]
            rows[name] = {
                "rollouts": len(rollouts),
                "rejected_per_rollout": rej,
                "nodes_replayed": args.honest_nodes,
                "rollouts_replayed": args.honest_nodes * args.max_rollouts,
                "nodes_flagged": sum(f[0] > 0 for f in flags),
                "nodes_banned": sum(f[3] > 0 for f in flags),
            }
            paths[name] = flags[0][2]
            continue
        runs = [until_flag(rollouts, policy, args.max_rollouts, rng) for _ in range(args.orders)]
        caught = [r for r in runs if r[0]]
        banned = [r[3] for r in runs if r[3]]
        rows[name] = {
            "rollouts": len(rollouts),
            "rejected_per_rollout": rej,
            "flagged_share": len(caught) / len(runs),
            "median_rollouts_to_flag": statistics.median(r[0] for r in caught) if caught else None,
            "max_rollouts_to_flag": max(r[0] for r in caught) if caught else None,
            "median_tokens_to_flag": statistics.median(r[1] for r in caught) if caught else None,
            "banned_share": len(banned) / len(runs),
            "median_rollouts_to_ban": statistics.median(banned) if banned else None,
            "max_rollouts_to_ban": max(banned) if banned else None,
        }
        paths[name] = runs[0][2]
    table = Table(
        title=f"trust on {', '.join(p.name for p in args.stats)} (thresholds at {args.target_rate:g} per rollout)"
    )
    for col in (
        "strategy",
        "rejected/rollout",
        "flagged",
        "median to flag",
        "max",
        "median tokens",
        "banned (flag or disputes): median / max",
    ):
        table.add_column(col)
    for name, r in rows.items():
        if name.startswith("honest"):
            table.add_row(
                f"{name} ({r['rollouts']})",
                f"{r['rejected_per_rollout']:.4f}",
                f"{r['nodes_flagged']}/{r['nodes_replayed']} nodes" if "nodes_flagged" in r else "",
                "",
                "",
                "",
                "",
            )
        else:
            table.add_row(
                name,
                f"{r['rejected_per_rollout']:.3f}",
                f"{r['flagged_share']:.2f}",
                str(r["median_rollouts_to_flag"]),
                str(r["max_rollouts_to_flag"]),
                str(r["median_tokens_to_flag"]),
                f"{r['median_rollouts_to_ban']} / {r['max_rollouts_to_ban']}",
            )
    console.print(table)
    report = {
        "stats": [str(p) for p in args.stats],
        "calibrated_on": {"bench": len(calib), "run": len(run_calib)},
        "args": {k: str(v) for k, v in vars(args).items()},
        "policy": policy.model_dump(mode="json", exclude_none=True),
        "threshold": policy.evidence.threshold,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, path in paths.items():
        ax.plot(range(1, len(path) + 1), path, label=name, lw=2 if name.startswith("honest") else 1)
    ax.axhline(policy.evidence.threshold, color="k", ls="--", lw=1, label="flag level")
    ax.set_xscale("log")
    ax.set_xlabel("rollouts of the node")
    ax.set_ylabel("per-node CUSUM statistic")
    ax.set_ylim(0, policy.evidence.threshold * 3)
    ax.set_title(f"per-node evidence, {args.stats[0].stem}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)
    if args.write_thresholds:
        header = (
            f"# Calibrated by tests/bench/bench_trust.py from {args.stats[0].name}"
            + "".join(f" + {p.name}" for p in args.run_verdicts)
            + f" ({args.calibrate_on}, "
            f"{len(calib)} + {len(run_calib)} rollouts; {data.get('title', '')}); target {args.target_rate:g} per rollout.\n"
        )
        args.write_thresholds.write_text(
            header
            + tomli_w.dumps({"verification": policy.model_dump(mode="json", exclude_none=True)})
        )
        console.print(f"thresholds written to {args.write_thresholds}")


if __name__ == "__main__":
    main()
