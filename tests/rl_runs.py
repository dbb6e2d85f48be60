"""Test and benchmark helper: a whole RL run on this machine. SFT warm-up of the tiny
model on reverse-text, a real pool on loopback (scheduler + workers serving the SFT
model, fast heartbeats), then `prime-trainer rl` against it; and a summary of what the
run's metrics files say. Pools may hold dishonest workers (`tests.adversaries`), and the
workers' `/health` can be read before the pool closes (`worker_health`)."""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from tests.pools import Pool, make_pool
from trainer.monitor import read_metrics

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
FAST_HEARTBEATS = (
    "--lifecycle.heartbeat-interval-s", "1",
    "--lifecycle.unhealthy-after-s", "10",
    "--lifecycle.dead-after-s", "20",
)  # fmt: skip


# `rl_args` flags that turn the reverse-text run into the tool run (issue 29): tool-arithmetic
# on 16 problems, turns and context capped, room for a call block, one sample per packed
# row (about 500-token prompts), a learning rate the tool run is stable at.
TOOL_RL_ARGS = (
    "--orchestrator.env.id", "tool-arithmetic",
    "--orchestrator.env.args", '{"num_examples": 16}',
    "--orchestrator.env.max-turns", "4",
    "--orchestrator.env.max-context-tokens", "2048",
    "--orchestrator.sampling.max-tokens", "96",
    "--trainer.micro-batch-tokens", "1024",
    "--trainer.optim.lr", "2e-4",
)  # fmt: skip


class RunFailed(AssertionError):
    """A child command of the run exited non-zero (the message holds its log tail)."""


def trainer_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", *args],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def sft_warmup(run: Path, *args: str) -> tuple[Path, float]:
    """SFT the tiny model on reverse-text (`args`: extra flags, e.g. `--max-steps 30`);
    returns the model folder and the seconds taken."""
    t0 = time.monotonic()
    out = trainer_cli(
        "sft", "@", "configs/rl/sft-reverse-text-tiny.toml", "--run-dir", str(run),
        "--monitor.progress", "false", *args,
    )  # fmt: skip
    if out.returncode:
        raise RunFailed(out.stderr[-3000:])
    return run / "final", time.monotonic() - t0


@contextlib.contextmanager
def serving_pool(
    workdir: Path,
    model: Path,
    workers: int = 3,
    dishonest: Sequence[str] = (),
    async_level: int = 2,
) -> Iterator[Pool]:
    """A scheduler and `workers` nodes serving `model`, stopped on exit. `dishonest`: kinds
    (`tests.adversaries.DISHONEST_WORKERS`) of that many of the `workers`, named d0, d1, ...;
    the honest ones are w0, w1, ... The pool is signed with `async_level`: an rl run on it
    must pass the same `--async-level`."""
    if len(dishonest) > workers:
        raise ValueError(f"{len(dishonest)} dishonest workers in a pool of {workers}")
    honest = [f"w{i}" for i in range(workers - len(dishonest))]
    cheats = {f"d{i}": kind for i, kind in enumerate(dishonest)}
    pool = make_pool(workdir, model=str(model), async_level=async_level)
    try:
        pool.start_scheduler(*FAST_HEARTBEATS)
        pool.join_many([*honest, *cheats], **cheats)
        yield pool
    finally:
        pool.close()


def rl_args(pool: Pool, model: Path, run: Path, *args: str) -> list[str]:
    """`prime-trainer rl` arguments for the reverse-text config on `pool`."""
    return [
        "rl", "@", "configs/rl/reverse-text-tiny.toml", "--model.name", str(model),
        "--run-dir", str(run), "--orchestrator.pool", str(pool.pool_file),
        "--orchestrator.trainer-key", str(pool.workdir / "trainer.key"),
        "--orchestrator.scheduler", pool.url, "--orchestrator.api-key-file",
        str(pool.api_key_file), "--monitor.progress", "false", *args,
    ]  # fmt: skip


def check_finished(out: subprocess.CompletedProcess, run: Path) -> None:
    if out.returncode:
        logs = run / "logs"
        tails = [
            (logs / f"{n}.log").read_text()[-2000:]
            for n in ("trainer", "orchestrator")
            if (logs / f"{n}.log").exists()
        ]
        raise RunFailed("\n".join([out.stderr[-2000:], *tails]))


def run_rl(pool: Pool, model: Path, run: Path, *args: str, timeout: float = 600) -> float:
    """`prime-trainer rl @ configs/rl/reverse-text-tiny.toml` on `pool` into `run`; returns
    the seconds the rl command took (raises RunFailed if it failed)."""
    t0 = time.monotonic()
    out = trainer_cli(*rl_args(pool, model, run, *args), timeout=timeout)
    check_finished(out, run)
    return time.monotonic() - t0


def rl_through_pool(
    workdir: Path, model: Path, *args: str, workers: int = 3, async_level: int = 2
) -> tuple[Path, float]:
    """`prime-trainer rl @ configs/rl/reverse-text-tiny.toml` on a fresh pool serving
    `model` (signed with `async_level`, which `args` must not contradict); returns the run
    directory and the seconds the rl command took."""
    with serving_pool(workdir, model, workers, async_level=async_level) as pool:
        run = workdir / "run"
        return run, run_rl(pool, model, run, *args)


def worker_health(pool: Pool) -> dict[str, dict | None]:
    """Each worker's `GET /health` JSON by name (None for one that no longer answers, e.g. a
    banned node that left)."""
    out: dict[str, dict | None] = {}
    for name, child in pool.nodes.items():
        try:
            out[name] = httpx.get(child.health_url, timeout=5).json()
        except (httpx.HTTPError, ValueError):
            out[name] = None
    return out


def reward_trend(run: Path) -> tuple[float, float]:
    """The rise of the per-step reward over the run by a least-squares line through every
    step, and its standard error: every step counts (a fifth at each end counted only
    two fifths of them, so a real rise read as noise more often)."""
    rewards = [r["reward_mean"] for r in read_metrics(run, "orchestrator")]
    steps = range(len(rewards))
    slope, intercept = statistics.linear_regression(steps, rewards)
    residual = sum((y - slope * x - intercept) ** 2 for x, y in zip(steps, rewards, strict=True))
    mean = statistics.fmean(steps)
    spread = sum((x - mean) ** 2 for x in steps)
    se = math.sqrt(residual / (len(rewards) - 2) / spread)
    return slope * (len(rewards) - 1), se * (len(rewards) - 1)


def summarize(run: Path) -> dict[str, float]:
    """Reward of the first and last fifth of the steps (mean and sd), the trainer's idle
    time per step (its wait for the orchestrator, the pipeline's first fill excluded),
    step times, and the orchestrator's time per batch."""
    trained, made = read_metrics(run, "trainer"), read_metrics(run, "orchestrator")
    rewards = [r["reward_mean"] for r in made]
    fifth = max(2, len(rewards) // 5)
    first, last = rewards[:fifth], rewards[-fifth:]
    idle = [r["idle_s"] for r in trained[1:]]
    return {
        "steps": len(trained),
        "reward_first_fifth": statistics.fmean(first),
        "reward_first_fifth_sd": statistics.stdev(first),
        "reward_last_fifth": statistics.fmean(last),
        "reward_last_fifth_sd": statistics.stdev(last),
        "trainer_step_s": statistics.fmean(r["step_time_s"] for r in trained),
        "trainer_idle_s": statistics.fmean(idle),
        "trainer_idle_fraction": sum(idle)
        / (sum(idle) + sum(r["step_time_s"] for r in trained[1:])),
        "orchestrator_generate_s": statistics.fmean(r["generate_s"] for r in made),
        "orchestrator_wait_policy_s": statistics.fmean(r["wait_policy_s"] for r in made),
        "mismatch_kl": statistics.fmean(r["mismatch_kl"] for r in trained),
    }
