"""The network benchmark still runs end to end, tiny (the session's SFT model, 2 RL steps,
async 0 and 2 on 2 workers, one forged-proof worker among 3): every section of the JSON is
there, the workers' /health reported time spent generating and verifying, and the
dishonest worker was caught (its rollouts rejected)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_network_bench_tiny_run_writes_every_section(tmp_path, sft_model):
    out = tmp_path / "net"
    proc = subprocess.run(
        [
            sys.executable, "tests/bench/bench_network.py", "--model", str(sft_model),
            "--steps", "2", "--levels", "0,2", "--workers", "2", "--pool-size", "3",
            "--dishonest", "1", "--out", str(out),
        ],
        cwd=REPO,
        timeout=400,
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert {"git", "machine", "args", "sft_s", "bench_s", "async_levels", "verify_share",
            "dishonest"} <= set(result)  # fmt: skip
    assert sorted(result["async_levels"]) == ["0", "2"]
    for r in result["async_levels"].values():
        assert r["steps"] == 2 and r["rl_s"] > 0 and 0 <= r["idle_fraction"] <= 1
        assert set(r["ratio_vs_async0"]) == {
            "wall_per_step_s", "steady_wall_per_step_s", "step_plus_idle_s", "idle_fraction",
        }  # fmt: skip
        assert r["busy"]["answered"] == 2 and r["busy"]["generate_s"] > 0
        assert r["busy"]["verify_s"] > 0 and 0 < r["busy"]["verify_share"] < 1
    assert result["async_levels"]["0"]["ratio_vs_async0"]["wall_per_step_s"] == 1
    assert 0 < result["verify_share"]["overall"] < 1
    (row,) = result["dishonest"]
    assert row["dishonest"] == 1 and row["samples"] > 0 and row["samples_per_s"] > 0
    (cheat,) = row["dishonest_nodes"]
    assert cheat["kind"] == "forged-proof"
    # Nothing it generated got through: every verdict on it is a rejection (2 steps may end
    # before it is banned, or before it got any work at all).
    assert cheat["accepted"] == 0, cheat
    assert {"banned_at_s", "banned_during_step", "rejected_by_verifier", "lost_disputes"} <= set(
        cheat
    )
    assert row["totals"]["rejections"] >= cheat["rejected_by_verifier"]
    assert out.with_suffix(".png").stat().st_size > 10_000
