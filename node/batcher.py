"""Collects concurrent requests into engine batches, run one at a time off the event loop.

Invariants: the engine is only ever called from the single executor thread passed in
(so generation, verification prefills and weight swaps never overlap); a failing batch
fails each of its callers with the same exception and the batcher keeps running; items
are taken in arrival order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Batcher(Generic[T, R]):
    def __init__(
        self, fn: Callable[[list[T]], list[R]], executor: Executor, max_batch: int, wait_s: float
    ):
        self.fn = fn
        self.executor = executor
        self.max_batch = max_batch
        self.wait_s = wait_s
        self.queue: asyncio.Queue[tuple[T, asyncio.Future[R]]] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.pending = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def submit(self, item: T) -> R:
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self.pending += 1
        try:
            await self.queue.put((item, fut))
            return await fut
        finally:
            self.pending -= 1

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + self.wait_s
            while len(batch) < self.max_batch:
                timeout = deadline - loop.time()
                if timeout <= 0 and self.queue.empty():
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), max(timeout, 0)))
                except TimeoutError:
                    break
            live = [(item, fut) for item, fut in batch if not fut.done()]
            if not live:
                continue
            try:
                results = await loop.run_in_executor(
                    self.executor, self.fn, [item for item, _ in live]
                )
            except Exception as exc:  # every caller of the batch learns why
                for _, fut in live:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), res in zip(live, results, strict=True):
                if not fut.done():
                    fut.set_result(res)
