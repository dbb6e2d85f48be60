"""Trainer checkpoints: `<run_dir>/checkpoints/step_<n>/trainer/`.

Model and optimizer state go through torch.distributed.checkpoint (DCP), one code path
for a single process and for FSDP2 (each rank writes its own shards); the LR scheduler,
the step and the RNG states (torch, CUDA, python, numpy; one file per rank) go in small
`extra_rank<r>.pt` files.

Invariants: the `COMPLETE` marker is written last, by rank 0, after every rank has
finished writing, so a checkpoint without it is never loaded and never counted;
`cleanup` deletes only complete checkpoints older than the newest `keep_last` ones and
only the `trainer/` part (the orchestrator keeps its state beside it); loading restores
exactly the state that was saved, so a resumed run reproduces an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

MARKER = "COMPLETE"


def step_dir(run_dir: Path, step: int) -> Path:
    """`<run_dir>/checkpoints/step_<n>/`: the trainer's part and the orchestrator's file."""
    return Path(run_dir) / "checkpoints" / f"step_{step}"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return step_dir(run_dir, step) / "trainer"


def complete_steps(run_dir: Path) -> list[int]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    steps = []
    for p in root.glob("step_*"):
        suffix = p.name.removeprefix("step_")
        if suffix.isdigit() and (p / "trainer" / MARKER).exists():
            steps.append(int(suffix))
    return sorted(steps)


def latest_checkpoint(run_dir: Path) -> int | None:
    """The step of the newest complete trainer checkpoint (None: there is none)."""
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process save/load, which is a supported use here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, model, optimizer, scheduler) -> Path:
    """Write the trainer state after `step` optimizer steps (collective: all ranks call it)."""
    folder = checkpoint_dir(run_dir, step)
    if _rank() == 0 and folder.exists():
        shutil.rmtree(folder)  # leftovers of a crash before the marker
    _barrier()
    folder.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _single_process_quiet():
        dcp.save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=str(folder),
            no_dist=not dist.is_initialized(),
        )
    extra = {"step": step, "scheduler": scheduler.state_dict(), "rng": _rng_state()}
    torch.save(extra, folder / f"extra_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        (folder / MARKER).write_text(f"{step}\n")
    _barrier()
    return folder


def load_checkpoint(run_dir: Path, step: int, model, optimizer, scheduler) -> int:
    """Restore the state saved at `step` into the (already built and sharded) objects."""
    folder = checkpoint_dir(run_dir, step)
    if not (folder / MARKER).exists():
        raise FileNotFoundError(f"no complete trainer checkpoint in {folder}")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(folder), no_dist=not dist.is_initialized())
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    extra_file = folder / f"extra_rank{_rank()}.pt"
    if not extra_file.exists():  # resumed with more ranks than saved: rank 0's schedule
        extra_file = folder / "extra_rank0.pt"
    extra = torch.load(extra_file, weights_only=False)  # our own file: numpy RNG state
    scheduler.load_state_dict(extra["scheduler"])
    _set_rng_state(extra["rng"])
    return int(extra["step"])


def cleanup_checkpoints(run_dir: Path, keep_last: int) -> list[int]:
    """Delete complete trainer checkpoints beyond the newest `keep_last` (rank 0 only)."""
    if _rank() != 0:
        return []
    steps = complete_steps(run_dir)
    doomed = steps[:-keep_last] if keep_last > 0 else steps
    for s in doomed:
        folder = checkpoint_dir(run_dir, s)
        (folder / MARKER).unlink()  # first: a half-deleted folder is never taken as complete
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):  # only if the orchestrator left nothing beside it
            folder.parent.rmdir()
    return doomed
