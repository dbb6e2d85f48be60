"""A whole RL run on this CPU box: SFT warm-up of the tiny model on reverse-text, then
`prime-trainer rl` against a real pool (scheduler + three workers on loopback) that
generates and verifies every rollout. Asserts what a user of the run would check:
it finishes in time, no trained sample is older than async_level, every trained
episode was verified, the trainer's idle time is reported, the curves and configs are
written; and the multi-turn environment goes through the same path."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.pools import make_pool
from trainer.batch import batch_path
from trainer.monitor import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
FAST_HEARTBEATS = (
    "--lifecycle.heartbeat-interval-s", "1",
    "--lifecycle.unhealthy-after-s", "10",
    "--lifecycle.dead-after-s", "20",
)  # fmt: skip


def trainer_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", *args],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


SFT_SECONDS = 0.0


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory) -> Path:
    global SFT_SECONDS
    run = tmp_path_factory.mktemp("sft")
    t0 = time.monotonic()
    out = trainer_cli(
        "sft", "@", "configs/rl/sft-reverse-text-tiny.toml", "--run-dir", str(run),
        "--monitor.progress", "false",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    SFT_SECONDS = time.monotonic() - t0
    sft = read_metrics(run, "sft")
    assert sft[-1]["loss"] < sft[0]["loss"] / 2, "SFT warm-up did not learn"
    return run / "final"


def run_rl(tmp_path: Path, sft: Path, *args: str) -> tuple[Path, float]:
    pool = make_pool(tmp_path, model=str(sft))
    try:
        pool.start_scheduler(*FAST_HEARTBEATS)
        pool.join_many(["w0", "w1", "w2"])
        run = tmp_path / "run"
        t0 = time.monotonic()
        out = trainer_cli(
            "rl", "@", "configs/rl/reverse-text-tiny.toml", "--model.name", str(sft),
            "--run-dir", str(run), "--orchestrator.pool", str(pool.pool_file),
            "--orchestrator.trainer-key", str(tmp_path / "trainer.key"),
            "--orchestrator.scheduler", pool.url, "--monitor.progress", "false", *args,
        )  # fmt: skip
        took = time.monotonic() - t0
        assert out.returncode == 0, (
            out.stderr[-3000:] + (run / "logs" / "trainer.log").read_text()[-3000:]
        )
        return run, took
    finally:
        pool.close()


def test_rl_on_reverse_text_through_a_verifying_pool(tmp_path, sft_model):
    steps, async_level = 30, 2  # configs/rl/reverse-text-tiny.toml
    run, took = run_rl(tmp_path, sft_model)
    trained = read_metrics(run, "trainer")
    made = read_metrics(run, "orchestrator")
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    # No trained sample is more than async_level steps stale: check the batch files.
    for n in range(1, steps + 1):
        batch = torch.load(batch_path(run, n), weights_only=True)
        assert batch["samples"], f"step {n} had nothing to train on"
        versions = [s["version"] for s in batch["samples"]]
        assert min(versions) >= n - async_level, (n, min(versions))
    assert all(r["stale_dropped"] == 0 for r in trained)
    # Every episode the orchestrator scored was verified: nothing came back rejected.
    assert not any(r.get("dropped_rejected") for r in made)
    idle = [r["idle_s"] for r in trained[1:]]
    rewards = [r["reward_mean"] for r in made]
    fifth = steps // 5
    first, last = rewards[:fifth], rewards[-fifth:]
    report = {
        "sft_and_rl_s": round(SFT_SECONDS + took, 1),
        "rl_s": round(took, 1),
        "trainer_idle_s_mean": round(statistics.fmean(idle), 3),
        "trainer_step_s_mean": round(statistics.fmean(r["step_time_s"] for r in trained), 2),
        "reward_first_fifth": round(statistics.fmean(first), 3),
        "reward_first_fifth_sd": round(statistics.stdev(first), 3),
        "reward_last_fifth": round(statistics.fmean(last), 3),
        "reward_last_fifth_sd": round(statistics.stdev(last), 3),
        "mismatch_kl_mean": round(statistics.fmean(r["mismatch_kl"] for r in trained), 4),
    }
    print("\nRL run:", json.dumps(report))
    # The whole run (SFT warm-up included) fits in 10 minutes on this 2-core box.
    assert SFT_SECONDS + took < 600, report
    # The reward rises clearly: beyond twice the standard error of the difference.
    gain = statistics.fmean(last) - statistics.fmean(first)
    noise = (statistics.variance(first) / fifth + statistics.variance(last) / fifth) ** 0.5
    assert gain > max(0.03, 2 * noise), report
    # Inference keeps up here, so the trainer barely waits (its first step waits for the
    # first batch, the pipeline's fill).
    assert statistics.fmean(idle) < 0.5 * report["trainer_step_s_mean"], report
    assert (run / "curves.png").stat().st_size > 10_000
    for name in ("rl", "trainer", "orchestrator"):
        assert (run / "configs" / f"{name}.toml").is_file()


def test_multi_turn_episodes_train_on_every_turn(tmp_path, sft_model):
    run, _ = run_rl(
        tmp_path, sft_model, "--max-steps", "2", "--batch-size", "16", "--group-size", "4",
        "--orchestrator.env.id", "reverse-text-chain",
        "--orchestrator.env.args", '{"num_examples": 200}',
    )  # fmt: skip
    made = read_metrics(run, "orchestrator")
    for n in (1, 2):
        batch = torch.load(batch_path(run, n), weights_only=True)
        samples = batch["samples"]
        assert samples
        # Two turns per episode: each turn is a sample; the second turn's context holds the first.
        assert len(samples) == 2 * made[n - 1]["groups"] * 4
        longest = max(len(s["input_ids"]) for s in samples)
        shortest = min(len(s["input_ids"]) for s in samples)
        assert longest > shortest + 10
