"""The worker-node benchmark still runs end to end with the slot decode (tiny model on the
CPU, two lengths, the continuous-batching mix): table, JSON with every row, the mix and
the targets, and the PNG; the engine verified every rollout it made."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_bench_node_runs_with_the_slot_decode(tmp_path):
    out = tmp_path / "node"
    res = subprocess.run(
        [
            sys.executable,
            "tests/bench/bench_node.py",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--decode",
            "slots",
            "--batch-sizes",
            "2,4",
            "--max-tokens",
            "8,24",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    rows = report["rows"]
    assert {(r["batch_size"], r["max_tokens"]) for r in rows} == {(2, 8), (4, 8), (2, 24), (4, 24)}
    assert all(r["accepted"] == r["batch_size"] for r in rows), [r["failed_checks"] for r in rows]
    assert all(r["engine_steps"] > 0 and r["proof_chunks"] > 0 for r in rows)
    assert report["decode"]["mode"] == "slots"
    (mix,) = report["mix"]
    assert mix["batch_size"] == 4 and mix["requests"] == 8 and mix["continuous_tok_s"] > 0
    assert set(report["targets"]["met"]) >= {"never slower than HF", "proof <= 2% of generation"}
    assert out.with_suffix(".png").stat().st_size > 10_000
