"""The proofs-beside-decoding benchmark still runs end to end on the tiny model: generation
alone, beside a proof thread and beside one proof process, and in both beside-modes proofs
were really built while the engine generated (a pool that never started would report 0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_proof_pool_bench_compares_thread_and_process(tmp_path):
    out = tmp_path / "proof_pool"
    cmd = [sys.executable, "tests/bench/bench_proof_pool.py", "--batch", "4"]
    cmd += ["--max-tokens", "48", "--processes", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, timeout=220, capture_output=True, text=True)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [r["mode"] for r in results] == [
        "alone",
        "proofs in a thread",
        "proofs in 1 process(es)",
    ]
    assert all(r["gen_s"] > 0 and r["slowdown"] > 0 for r in results)
    assert all(r["proof_chunks_per_s"] > 0 for r in results[1:]), results
