"""Training samples and the batch files that carry them from orchestrator to trainer.

The orchestrator writes one file per step, `<run_dir>/rollouts/step_<n>.pt`; the trainer
waits for it, trains step n on it, and never looks at it again.

Invariants: a batch file appears whole or not at all (written to a temporary name, then
renamed); every sample carries the policy version that generated it, and `read_batch`
drops (and counts) any sample whose `staleness` exceeds async_level, so a stale rollout
is never trained on even if an orchestrator bug let one through; `logprobs` are the
workers' (mu), aligned with `input_ids` (entry i is the logprob of token i given
tokens < i; 0 where `loss_mask` is False).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass
class TrainingSample:
    """One sequence to train on: a prompt and the tokens a worker generated after it."""

    input_ids: list[int]
    """Prompt and completion token ids (for multi-turn: the turn's whole context)."""
    loss_mask: list[bool]
    """True on completion tokens (the ones the policy chose)."""
    logprobs: list[float]
    """Workers' logprobs mu per token (0 where loss_mask is False)."""
    advantage: float
    """Reward minus the mean reward of the sample's group."""
    version: int = 0
    """Policy version that generated the sample."""
    reward: float = 0.0
    """The episode's reward (for logs)."""
    rollout_id: str = ""
    """The scheduler's request id of the generation this sample came from (audits join it
    with the scheduler's results table: who generated it, which verdicts let it through)."""
    text: str = ""
    """The completion text the rubric scored (audits compare it with the signed ids)."""

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"sample fields disagree in length: input_ids {n}, loss_mask "
                f"{len(self.loss_mask)}, logprobs {len(self.logprobs)}"
            )


@dataclass
class Batch:
    """Everything the trainer needs for one step."""

    step: int
    samples: list[TrainingSample]
    metrics: dict[str, float] = field(default_factory=dict)
    """Orchestrator-side numbers for this step (rewards, drops, timings), logged by the trainer."""


def staleness(step: int, version: int) -> int:
    """Policy updates between a sample's generation and the step that trains on it.

    Step n (1-based) updates policy n - 1 into policy n: a sample of policy n - 1 is
    on-policy (0), so async_level 0 is synchronous RL and k lets generation run k policy
    updates ahead of training."""
    return step - 1 - version


def oldest_admissible(step: int, async_level: int) -> int:
    """The oldest policy version whose samples step `step` may train on."""
    return max(0, step - 1 - async_level)


def batch_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "rollouts" / f"step_{step}.pt"


def write_batch(run_dir: Path, batch: Batch) -> Path:
    path = batch_path(run_dir, batch.step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    payload = {
        "step": batch.step,
        "samples": [asdict(s) for s in batch.samples],
        "metrics": batch.metrics,
    }
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def read_batch(run_dir: Path, step: int, async_level: int) -> tuple[Batch, int]:
    """The batch of `step` and how many stale samples were dropped from it."""
    payload = torch.load(batch_path(run_dir, step), weights_only=True)
    samples = [TrainingSample(**s) for s in payload["samples"]]
    fresh = [s for s in samples if staleness(step, s.version) <= async_level]
    return Batch(step, fresh, payload.get("metrics", {})), len(samples) - len(fresh)


def wait_batch(
    run_dir: Path, step: int, async_level: int, timeout_s: float, poll_s: float = 0.05
) -> tuple[Batch, int, float]:
    """Block until the batch of `step` exists; returns it, the stale count and the wait in s."""
    path = batch_path(run_dir, step)
    t0 = time.monotonic()
    while not path.exists():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(
                f"no batch for step {step} after {timeout_s:.0f} s: is the orchestrator running "
                f"and writing into {path.parent}?"
            )
        time.sleep(poll_s)
    batch, stale = read_batch(run_dir, step, async_level)
    return batch, stale, time.monotonic() - t0
