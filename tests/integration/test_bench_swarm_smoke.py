"""The swarm broadcast benchmark still runs end to end, tiny (S = 4 MiB, B = 4 MiB/s, N = 1
and 3, 256 KiB pieces): one row per (topology, N), every download complete, byte-identical
and free of bad pieces, and the two topologies tell apart by what the trainer uploads (a
star about N x S, the swarm less)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_swarm_bench_tiny_run_tells_swarm_from_star(tmp_path):
    out = tmp_path / "swarm_tiny"
    proc = subprocess.run(
        [
            sys.executable, "tests/bench/bench_swarm.py",
            "--size-mib", "4", "--rate-mib", "4", "--ns", "1,3", "--piece-kib", "256",
            "--timeout-s", "60", "--out", str(out),
        ],
        cwd=REPO,
        timeout=170,
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["topology"], r["n"]): r for r in result["rows"]}
    assert sorted(rows) == [("star", 1), ("star", 3), ("swarm", 1), ("swarm", 3)]
    assert len(result["rows"]) == 4
    for key, r in rows.items():
        assert r["ok"], (key, r["reason"])
        assert r["identical"] and r["bad_pieces"] == 0, (key, r)
        assert r["last_done_s"] > 0 and r["trainer_upload_S"] >= 1 - 1e-9, (key, r)
    assert rows[("star", 3)]["trainer_upload_S"] >= 2.5, rows[("star", 3)]
    assert rows[("star", 3)]["mean_downloader_upload_S"] == 0, rows[("star", 3)]
    assert rows[("swarm", 3)]["trainer_upload_S"] < 2.5, rows[("swarm", 3)]
    assert result["checks"] == {"all_complete": True, "all_identical": True, "no_bad_pieces": True}
    assert set(result["targets"]) == {"swarm_time_max_n_over_n1", "swarm_trainer_upload_over_S"}
    assert result["machine"]["cpu_count"] >= 1
    assert out.with_suffix(".png").stat().st_size > 10_000
