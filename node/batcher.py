"""Collects concurrent requests into engine batches, run one at a time off the event loop.

Two kinds of batch function:
- plain, `fn(items) -> results`: the batch ends when all its items are done;
- streaming, `fn(items, more, deliver)`: while it runs, `more(k)` hands it up to k more
  queued items (continuous batching: a request joins when the engine has room) and
  `deliver(i, result)` answers item i (numbered in the order items were handed out) as
  soon as it is done, so a short request does not wait for the batch's longest.

Invariants: the engine is only ever called from the single executor thread passed in
(so generation, verification prefills and weight swaps never overlap); `more` hands out
nothing while `hold` says so (a weight swap waits for the running batch, which must then
end); a failing batch fails each of its undelivered callers with the same exception and
the batcher keeps running; items are taken in arrival order.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

More = Callable[[int], list[tuple[int, T]]]
Deliver = Callable[[int, R], None]


class Batcher(Generic[T, R]):
    def __init__(
        self,
        fn: Callable,
        executor: Executor,
        max_batch: int,
        wait_s: float,
        *,
        streaming: bool = False,
        hold: Callable[[], bool] = lambda: False,
    ):
        self.fn = fn
        self.executor = executor
        self.max_batch = max_batch
        self.wait_s = wait_s
        self.streaming = streaming
        self.hold = hold
        # A deque: the engine thread takes from it too (`more`); popleft/append are atomic.
        self.queue: collections.deque[tuple[T, asyncio.Future[R]]] = collections.deque()
        self._wake = asyncio.Event()
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
            self.queue.append((item, fut))
            self._wake.set()
            return await fut
        finally:
            self.pending -= 1

    def _take(self, k: int) -> list[tuple[T, asyncio.Future[R]]]:
        out = []
        while len(out) < k:
            try:
                item, fut = self.queue.popleft()
            except IndexError:
                break
            if not fut.done():  # its caller gave up
                out.append((item, fut))
        return out

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self.queue:
                continue
            if len(self.queue) < self.max_batch and self.wait_s > 0:
                await asyncio.sleep(self.wait_s)  # let a burst of requests arrive together
            live = self._take(self.max_batch)
            if self.queue:
                self._wake.set()
            if not live:
                continue
            if self.streaming:
                await self._stream(loop, live)
                continue
            try:
                results = await loop.run_in_executor(
                    self.executor, self.fn, [item for item, _ in live]
                )
            except Exception as exc:  # every caller of the batch learns why
                _fail(live, exc)
                continue
            for (_, fut), res in zip(live, results, strict=True):
                if not fut.done():
                    fut.set_result(res)

    async def _stream(self, loop: asyncio.AbstractEventLoop, live: list) -> None:
        def more(k: int) -> list[tuple[int, T]]:
            if self.hold():
                return []
            got = self._take(k)
            base = len(live)
            live.extend(got)
            return [(base + j, item) for j, (item, _) in enumerate(got)]

        def deliver(i: int, result: R) -> None:
            loop.call_soon_threadsafe(_resolve, live[i][1], result)

        try:
            await loop.run_in_executor(
                self.executor, self.fn, [item for item, _ in live], more, deliver
            )
        except Exception as exc:
            _fail(live, exc)
        else:  # the deliveries ran before this resumed (call_soon order)
            _fail(live, RuntimeError("the engine ended without answering this request"))
        if self.queue:
            self._wake.set()


def _resolve(fut: asyncio.Future, result: object) -> None:
    if not fut.done():
        fut.set_result(result)


def _fail(live: list, exc: Exception) -> None:
    for _, fut in live:
        if not fut.done():
            fut.set_exception(exc)
