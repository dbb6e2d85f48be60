"""Trainer checkpoints: `<run_dir>/checkpoints/step_<n>/trainer/`.

Model and optimizer state go through torch.distributed.checkpoint (DCP), one code path
for a single process and for FSDP2 (each rank writes its own shards); the LR scheduler,
the step and the RNG states (torch, CUDA, python, numpy; one file per rank) go in small
`extra_rank<r>.pt` files.

Invariants: the `COMPLETE` marker is written last, by rank 0, after every rank has
finished writing, so a checkpoint without it is never loaded and never counted;
`cleanup` deletes only complete checkpoints older than the newest `keep_last` ones and
only the `trainer/` part (the orchestrator keeps its state beside it); loading restores
exactly the state that was saved, so a resumed run reproduces an uninterrupted one; a
checkpoint written in the background (`CheckpointWriter`) holds the state as it was when
`save` was called, whatever the trainer did while it was written.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
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
    folder = _start(run_dir, step, scheduler)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _single_process_quiet():
        dcp.save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=str(folder),
            no_dist=not dist.is_initialized(),
        )
    _barrier()
    if _rank() == 0:
        (folder / MARKER).write_text(f"{step}\n")
    _barrier()
    return folder


def _start(run_dir: Path, step: int, scheduler) -> Path:
    """A fresh folder for `step`'s checkpoint holding this rank's small extras (schedule,
    step, RNG states: taken now, before anything moves on)."""
    folder = checkpoint_dir(run_dir, step)
    if _rank() == 0 and folder.exists():
        shutil.rmtree(folder)  # leftovers of a crash before the marker
    _barrier()
    folder.mkdir(parents=True, exist_ok=True)
    extra = {"step": step, "scheduler": scheduler.state_dict(), "rng": _rng_state()}
    torch.save(extra, folder / f"extra_rank{_rank()}.pt")
    return folder


class CheckpointWriter:
    """Saves a run's checkpoints and keeps the newest `keep_last` (issue 28: off the
    critical path). In the background (one process only: DCP's async save needs a CPU
    process group where there are several), the model and optimizer state are copied to
    CPU memory in the caller, which then goes on, and written by DCP on a thread; the
    marker and the cleanup of older checkpoints follow when the write is done. One
    checkpoint is written at a time: `save` first waits for the one before. Otherwise
    `save` writes in the caller (collective, as `save_checkpoint`)."""

    def __init__(self, run_dir: Path, keep_last: int, background: bool = True):
        self.run_dir, self.keep_last = Path(run_dir), keep_last
        self.background = background and not dist.is_initialized()
        self._pending: tuple[Future, threading.Event] | None = None

    def save(self, step: int, model, optimizer, scheduler) -> None:
        """Checkpoint the state after `step` optimizer steps."""
        self.wait()
        if not self.background:
            save_checkpoint(self.run_dir, step, model, optimizer, scheduler)
            cleanup_checkpoints(self.run_dir, self.keep_last)
            return
        folder = _start(self.run_dir, step, scheduler)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        with _single_process_quiet():
            future = dcp.async_save(
                {"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder), no_dist=True
            )
        done = threading.Event()
        future.add_done_callback(lambda f: self._complete(step, folder, f, done))
        self._pending = (future, done)

    def _complete(self, step: int, folder: Path, future: Future, done: threading.Event) -> None:
        # On DCP's thread, as soon as the write is done: a run stopped later resumes here.
        try:
            if future.exception() is None:
                (folder / MARKER).write_text(f"{step}\n")
                cleanup_checkpoints(self.run_dir, self.keep_last)
        finally:
            done.set()

    def wait(self) -> None:
        """Return once the checkpoint under way (if any) is complete, its marker written;
        raises its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            future, done = pending
            with _single_process_quiet():
                future.result()
            done.wait()


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
