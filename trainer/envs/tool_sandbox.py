"""Running a tool on the trusted side, bounded (issue 29): a tool is a plain function of an
environment, run in a separate process with a memory cap and a time limit.

`ToolRunner.run(fn, kwargs)` sends the call to a small pool of worker processes started
by forkserver (never a fork of the orchestrator, which runs threads and an event loop);
each worker caps its own address space (`RLIMIT_AS`) when it starts. A call that raises,
runs past `timeout_s` or hits the memory cap raises `ToolFailed` with the reason; a call
past its time has its worker pool killed and a new one started, so a hanging tool costs
one call, never the run.

Invariants: nothing a tool does reaches the caller's process but its return value (or
`ToolFailed`); the function must be importable by name (module level), as the tools of
a bundled environment are; `run` is blocking: call it from a thread (`asyncio.to_thread`).
"""

from __future__ import annotations

import multiprocessing
import resource
import threading
from collections.abc import Callable
from typing import Any


class ToolFailed(RuntimeError):
    """A tool raised, ran past its time or over its memory; the message says which."""


def _cap_memory(memory_mb: int) -> None:
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _call(fn: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[bool, Any]:
    try:
        return True, fn(**kwargs)
    except MemoryError:
        return False, "the tool ran out of its memory"
    except Exception as exc:  # noqa: BLE001 - reported to the environment, not raised here
        return False, f"the tool raised {type(exc).__name__}: {exc}"


class ToolRunner:
    """A pool of `processes` tool workers, each capped at `memory_mb`."""

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, processes: int = 2):
        self.timeout_s, self.memory_mb, self.processes = timeout_s, memory_mb, processes
        self._lock = threading.Lock()
        self._pool: Any = None

    def _workers(self):
        with self._lock:
            if self._pool is None:
                ctx = multiprocessing.get_context("forkserver")
                self._pool = ctx.Pool(
                    self.processes, initializer=_cap_memory, initargs=(self.memory_mb,)
                )
            return self._pool

    def run(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        """`fn(**kwargs)` in a worker; its value, or `ToolFailed`."""
        pool = self._workers()
        pending = pool.apply_async(_call, (fn, kwargs))
        try:
            ok, value = pending.get(self.timeout_s)
        except multiprocessing.TimeoutError:
            self._restart(pool)
            raise ToolFailed(f"the tool did not return within {self.timeout_s:g} s") from None
        except Exception as exc:  # the call or its value could not travel (pickling)
            raise ToolFailed(f"the tool could not be run: {exc}") from exc
        if not ok:
            raise ToolFailed(value)
        return value

    def _restart(self, pool) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.terminate()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.terminate()
