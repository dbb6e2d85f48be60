"""The main job: `prime-trainer rl @ configs/rl/local-swarm-tiny.toml` starts the whole
network on this machine (scheduler with SQLite in the run directory, worker nodes, trainer
and orchestrator, weights over the swarm), shows it, and tears it all down: at the end,
on Ctrl-C, and when any child fails. The full-length run (SFT warm-up included) is what
`make demo` does; these tests use the session's warmed-up model and fewer steps."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.pools import processes_with
from tests.rl_runs import ENV, REPO
from trainer.monitor import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
CONFIG = "configs/rl/local-swarm-tiny.toml"


def launch(run: Path, model: Path, *args: str, progress: bool = True) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "trainer.cli", "rl", "@", CONFIG, "--run-dir", str(run),
        "--local-swarm.sft", "", "--model.name", str(model),
        "--monitor.progress", str(progress).lower(), *args,
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, cwd=REPO, env={**ENV, "COLUMNS": "120"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def wait_for(predicate, proc: subprocess.Popen, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"rl exited before {what}:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.2)


def test_local_swarm_runs_the_whole_network_and_tears_it_down(tmp_path, sft_model, report):
    run = tmp_path / "run"
    t0 = time.monotonic()
    proc = launch(run, sft_model, "--max-steps", "6")
    out, _ = proc.communicate(timeout=500)
    took = time.monotonic() - t0
    assert proc.returncode == 0, out[-4000:]
    assert "run summary" in out and "reward" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["steps"] == 6
    assert summary["rollouts_verified"] >= summary["rollouts_accepted"] > 0
    # Every worker ended healthy, holding a policy the trainer published over the swarm.
    assert set(summary["nodes"]) == {"w0", "w1", "w2"}
    assert all(
        n["state"] == "healthy" and n["weights_version"] >= 1 for n in summary["nodes"].values()
    )
    for name in ("scheduler", "w0", "w1", "w2", "trainer", "orchestrator"):
        assert (run / "logs" / f"{name}.log").stat().st_size > 0, name
    assert (run / "swarm" / "scheduler.db").is_file()
    assert (run / "curves.png").stat().st_size > 10_000
    assert [r["step"] for r in read_metrics(run, "trainer")] == list(range(1, 7))
    assert not processes_with(str(run)), "processes left behind"
    report("local swarm: 6 steps, 3 workers (model warmed up)", {"wall_s": took, **summary})


def test_ctrl_c_stops_every_process(tmp_path, sft_model):
    run = tmp_path / "run"
    proc = launch(run, sft_model, "--max-steps", "50", "--local-swarm.workers", "2")
    wait_for(lambda: read_metrics(run, "trainer"), proc, 300, "a trained step")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "interrupted" in out
    assert json.loads((run / "summary.json").read_text())["outcome"] == "interrupted"
    time.sleep(1)
    assert not processes_with(str(run)), "processes left behind"


def test_a_failing_child_stops_the_run(tmp_path, sft_model):
    """A worker dying is a failure of the local run: named, its log shown, all stopped."""
    run = tmp_path / "run"
    proc = launch(run, sft_model, "--max-steps", "50", "--local-swarm.workers", "2", progress=False)
    wait_for(lambda: read_metrics(run, "trainer"), proc, 300, "a trained step")
    (pid,) = processes_with(str(run), "node.cli join", "w1.key")
    subprocess.run(["kill", "-9", str(pid)], check=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "w1 failed" in out
    time.sleep(1)
    assert not processes_with(str(run)), "processes left behind"
