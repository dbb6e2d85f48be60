"""tests/bench/bench_trust.py on the committed CPU statistics: thresholds calibrated on one
honest set reject nothing of the other, no replayed honest node is flagged, and the
per-node test flags the weight and sampling cheats whose logprobs it sees, and the narrower
top-p, which it cannot see, is banned by the disputes its rejected rollouts lose. Two
files pool their honest sets: the second's are judged too."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.pools import REPO


def test_trust_bench_replays_measured_statistics(tmp_path):
    out = tmp_path / "trust"
    results_dir = REPO / "tests" / "bench" / "results"
    stats = results_dir / "trust_stats_cpu_tiny.json"
    more = results_dir / "trust_stats_cpu_tiny_honest10k.json.gz"
    done = subprocess.run(
        [sys.executable, "tests/bench/bench_trust.py", str(stats), str(more),
         "--mix", "torch/float32/cpu",
         "--orders", "20", "--max-rollouts", "300", "--honest-nodes", "20", "--out", str(out),
         "--write-thresholds", str(tmp_path / "t.toml")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert results["honest_b"]["rollouts"] == 500 + 20_000
    assert results["honest_b"]["rejected_per_rollout"] == 0
    assert results["honest_b"]["nodes_flagged"] == results["honest_b"]["nodes_banned"] == 0
    top_p = results["top_p_0.9"]
    assert top_p["flagged_share"] == 0 and top_p["banned_share"] == 1.0, top_p
    for cheat in ("int8", "int4", "fp8", "noise_1e-3", "temp_0.8", "steered"):
        assert results[cheat]["flagged_share"] == 1.0, (cheat, results[cheat])
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "engine_mixes" in (tmp_path / "t.toml").read_text()
