"""The GPU main-job benchmark (tests/bench/bench_rl_gpu.py) on this CPU box with the tiny
model: two time slots of one run, the second resumed with `--ckpt.resume` on a pool that
was stopped with the run (new worker processes, the trainer's seed on new addresses), and a
report that covers both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def segment(run: Path, out: Path, steps: int) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "tests/bench/bench_rl_gpu.py",
        "--config",
        "configs/rl/local-swarm-tiny.toml",
    ]
    # A slot runs to its last step here (about a minute on a quiet box): the budget only
    # stops a hung run, so how busy the machine is never turns "finished" into "interrupted".
    cmd += ["--run-dir", str(run), "--budget-s", "1500", "--out", str(out), "--"]
    cmd += ["--max-steps", str(steps), "--local-swarm.sft", "", "--local-swarm.workers", "2"]
    cmd += ["--batch-size", "16"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1700)


def test_two_slots_of_one_run_make_one_report(tmp_path):
    run, out = tmp_path / "run", tmp_path / "res" / "rl"
    first = segment(run, out, 2)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = segment(run, out, 4)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    res = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    segs = res["per_segment"]
    assert [s["outcome"] for s in segs] == ["finished", "finished"]
    assert [s["resumed"] for s in segs] == [False, True]
    # The resumed slot trained steps 3 and 4: its workers got version 2 from the restarted
    # trainer's seed (before the fix they waited for a seed that was not listening).
    assert [s["step"] for s in res["per_step"]] == [1, 2, 3, 4]
    assert all(s["loss"] is not None for s in res["per_step"])
    assert res["rollouts"]["accepted"] >= 4 * 16 and res["rollouts"]["rejected"] == 0
    assert res["nodes_banned"] == 0
    assert 0 < res["worker_verify_share"] < 1
    assert res["pool_tokens_per_s"] > 0
    assert res["reward_first_fifth"] is not None and res["reward_gain"] is not None
