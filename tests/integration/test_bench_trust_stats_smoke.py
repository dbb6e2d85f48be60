"""The trust-statistics benchmark still runs end to end (--quick, tiny model on the CPU)
and its JSON holds every strategy with the raw per-rollout, per-token and per-chunk lists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


@pytest.mark.timeout(120)
def test_trust_stats_quick_mode_writes_raw_lists_for_every_strategy(tmp_path):
    from tests.bench.bench_trust_stats import ALL_STRATEGIES

    out = tmp_path / "trust"
    subprocess.run(
        [
            sys.executable,
            "tests/bench/bench_trust_stats.py",
            "--quick",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
        cwd=REPO,
        check=True,
        timeout=110,
        capture_output=True,
    )
    result = json.loads(out.with_suffix(".json").read_text())
    assert set(result["strategies"]) == set(ALL_STRATEGIES)
    assert result["env"]["torch"] and "shipped_tiny_cpu_fp32" in result["policies"]
    for name, strat in result["strategies"].items():
        rollouts = strat["rollouts"]
        assert rollouts and strat["summary"]["rollouts"] == len(rollouts), name
        for r in rollouts:
            n = r["tokens"]
            assert len(r["logprob_err"]) == n and len(r["score_gap"]) == n, name
            assert r["tokens_outside"] == 0
            chunks = r["chunks"]
            assert len(chunks["exp_mismatches"]) == len(chunks["mant_err_mean"]) >= 1
            assert {"logprobs", "sampling", "proof"} <= set(r["checks"])
    # fp32 tiny: honest prefill matches decode exactly enough for the shipped thresholds.
    assert result["strategies"]["honest_a"]["summary"]["rejected"]["shipped_tiny_cpu_fp32"] == 0
    assert all("steer" in r for r in result["strategies"]["steered"]["rollouts"] if r["tokens"] > 1)
    assert out.with_suffix(".png").stat().st_size > 5_000
