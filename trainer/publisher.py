"""Publishing off the trainer's critical path (issue 28): each step's weights are written,
hashed, delta-coded and seeded on a background thread while the next step trains.

The trainer hands `submit(n, state)` a snapshot it owns (gathered to the CPU in the
serving dtype, so no later optimizer step can change it) and goes on; one thread runs the
transport's `save` and `cleanup` for each version in turn.

Invariants: versions are published in step order, one at a time, by this thread only (the
transport's folder and swarm seed have one writer); at most `depth` versions wait behind
the one being published, so a trainer faster than its publishing waits at hand-off
instead of piling snapshots up in memory (the wait is reported); a failed publication is
raised in the trainer at its next `submit` or at `flush`, never lost; `flush` returns
once every submitted version is published (before a checkpoint, which must never name a
version that is not, and at the end of a run).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

log = logging.getLogger("prime.trainer")

State = dict[str, torch.Tensor]


class PublishError(RuntimeError):
    """Publishing a version failed on the background thread (the cause is chained)."""


class Publisher:
    """Runs `save(step, state)` then `after(step)` for each submitted version, in order,
    on one background thread (`background=False`: in the caller, as before issue 28)."""

    def __init__(
        self,
        save: Callable[[int, State], None],
        after: Callable[[int], None] = lambda step: None,
        depth: int = 1,
        background: bool = True,
    ):
        self._save, self._after = save, after
        self.background = background
        self._queue: queue.Queue[tuple[int, State] | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._failed_step: int | None = None
        self.published: int | None = None
        """The newest version this publisher finished (None: none yet)."""
        self.publish_s = 0.0
        """Seconds spent publishing, summed (on the thread when in the background)."""
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="publisher", daemon=True)
            self._thread.start()

    def submit(self, step: int, state: State) -> float:
        """Publish `state` as version `step` (the caller must not touch `state` again);
        returns the seconds the caller waited (the whole publication when not in the
        background, else only for room in the queue)."""
        self._raise_if_failed()
        t0 = time.monotonic()
        if not self.background:
            self._publish(step, state)
            self._raise_if_failed()
        else:
            self._queue.put((step, state))
        return time.monotonic() - t0

    def flush(self) -> float:
        """Wait until every submitted version is published; returns the seconds waited."""
        t0 = time.monotonic()
        if self.background:
            self._queue.join()
        self._raise_if_failed()
        return time.monotonic() - t0

    def close(self) -> None:
        """Publish what is queued, then stop the thread (raises a failed publication)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise_if_failed()

    # -- the thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:  # after a failure nothing later is published
                    self._publish(*item)
            finally:
                self._queue.task_done()

    def _publish(self, step: int, state: State) -> None:
        t0 = time.monotonic()
        try:
            self._save(step, state)
            self._after(step)
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread
            log.exception("publishing version %d failed", step)
            self._error, self._failed_step = exc, step
            return
        finally:
            self.publish_s += time.monotonic() - t0
        self.published = step

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise PublishError(
                f"publishing weights version {self._failed_step} failed: {self._error}"
            ) from self._error
