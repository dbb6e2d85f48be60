"""`prime-node doctor` against a real scheduler: with a join command line that works every
check passes (exit 0); a node whose engine mix the pool's thresholds do not cover, a
scheduler URL nobody answers and a listen port already taken each fail their check, say
what to do, and make the exit status 1; nothing is registered."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from protocol.processes import free_port
from tests.pools import FAST_LIFECYCLE, REPO, make_pool

pytestmark = pytest.mark.slow


def doctor(pool, *args: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "node.cli", "doctor", "--pool", pool.pool_id,
         "--key-file", str(pool.workdir / "d.key"), "--weights.folder",
         str(pool.workdir / "weights"), *args],
        cwd=REPO, capture_output=True, text=True, timeout=180,
        env={**os.environ, "COLUMNS": "250"},
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def row(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if name in line)


def test_doctor_passes_a_working_node_and_names_each_problem(tmp_path):
    pool = make_pool(tmp_path)
    try:
        pool.start_scheduler(*FAST_LIFECYCLE)
        rc, out = doctor(pool, "--scheduler", pool.url)
        assert rc == 0, out
        for name in ("node key", "scheduler http", "clock vs", "pool config", "engine",
                     "calibration", "disk for weights", "HTTP port", "channel http",
                     "swarm reachability"):  # fmt: skip
            assert "pass" in row(out, name) or "warn" in row(out, name), (name, out)
        assert "fail" not in out, out
        assert "torch/float32/cpu" in row(out, "calibration")

        # bf16 on a pool calibrated for fp32; a dead replica listed first; a taken port.
        dead = f"http://127.0.0.1:{free_port()}"
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            rc, out = doctor(
                pool, "--scheduler", f"{dead},{pool.url}", "--engine.dtype", "bfloat16",
                "--server.port", str(port), "--weights.peer.use-relay", "false",
            )  # fmt: skip
        assert rc == 1, out
        assert "fail" in row(out, f"scheduler {dead}") and "unreachable" in out
        assert "fail" in row(out, f"channel {dead}"), out
        assert "pass" in row(out, f"scheduler {pool.url}")
        calibration = row(out, "calibration")
        assert "fail" in calibration and "torch/bfloat16/cpu" in calibration, out
        assert "prime-node calibrate" in out
        assert "fail" in row(out, "HTTP port"), out
        # A private swarm address without the relay: nobody outside could fetch from it.
        assert "fail" in row(out, "swarm reachability"), out
        # Nothing registered.
        assert pool.state()["nodes"] == []
    finally:
        pool.close()
