"""The orchestrator's client of a pool scheduler: submit rollout requests, read the results
stream, publish weights. Everything it sends is signed by the trainer key.

Invariants: `submit` is idempotent per request id (resubmitting after a crash or a
timeout cannot create a second request); `stream` yields each result once, in seq
order, and resumes from any cursor the caller kept (pass the last seq you processed).
A saturated pool (503) and a scheduler that is down or restarting (connection errors) are
retried for up to `retry_s` (both routes are safe to repeat); other errors raise `RemoteError`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import aiohttp
from pydantic import BaseModel

from protocol.client import RemoteError, call, post_raw
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import (
    ResultsPage,
    ResultsQuery,
    RolloutResult,
    RolloutSpec,
    SubmitAck,
    SubmitRollouts,
    WeightUpdate,
)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class SchedulerClient:
    def __init__(
        self,
        url: str,
        identity: Identity,
        pool_id: str,
        timeout_s: float = 120.0,
        retry_s: float = 300.0,
    ):
        # Several replicas: "http://a:7000,http://b:7000"; the client moves on when one fails.
        self.urls = [u.strip().rstrip("/") for u in url.split(",")]
        self.current = 0
        self.identity = identity
        self.pool_id = pool_id
        self.retry_s = retry_s
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def close(self) -> None:
        await self.session.close()

    async def __aenter__(self) -> SchedulerClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _retrying(self, attempt: Callable[[str], Awaitable[T]]) -> T:
        """Run `attempt(base_url)`, moving across replicas and waiting out restarts and 503s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_s
        while True:
            try:
                return await attempt(self.url)
            except RemoteError as exc:
                if exc.status != 503 or loop.time() > deadline:
                    raise
            except aiohttp.ClientConnectionError:
                if loop.time() > deadline:
                    raise
            self.current = (self.current + 1) % len(self.urls)
            await asyncio.sleep(1.0 if self.current == 0 else 0.1)

    @property
    def url(self) -> str:
        return self.urls[self.current]

    async def _call(self, route: str, message: BaseModel, response: type[M]) -> M:
        async def attempt(url: str) -> M:
            opened, _ = await call(self.session, url + route, self.identity, message, response)
            return opened.message

        return await self._retrying(attempt)

    async def submit(self, specs: Sequence[RolloutSpec]) -> SubmitAck:
        """Submit a batch (durable when this returns); known request ids are ignored."""
        msg = SubmitRollouts(pool_id=self.pool_id, requests=list(specs))
        return await self._call("/v1/rollouts/submit", msg, SubmitAck)

    async def results(self, after: int = 0, limit: int = 500, wait_s: float = 0.0) -> ResultsPage:
        q = ResultsQuery(after=after, limit=limit, wait_s=wait_s)
        return await self._call("/v1/rollouts/results", q, ResultsPage)

    async def stream(self, after: int = 0, wait_s: float = 10.0) -> AsyncIterator[RolloutResult]:
        """Results after `after`, forever (long-polling); the caller breaks out."""
        while True:
            page = await self.results(after, wait_s=wait_s)
            for r in page.results:
                yield r
            after = page.last_seq

    async def health(self) -> dict:
        """The scheduler's `/health` (node counts, healthy nodes per weights version)."""

        async def attempt(url: str) -> dict:
            async with self.session.get(f"{url}/health") as resp:
                resp.raise_for_status()
                return await resp.json()

        return await self._retrying(attempt)

    async def publish_weights(self, update: WeightUpdate) -> int:
        """Make `update` the pool's current weights (nodes get it with their next heartbeat)."""

        async def attempt(url: str) -> int:
            raw = await post_raw(self.session, f"{url}/v1/weights", seal(self.identity, update))
            return int(json.loads(raw)["weights_version"])

        return await self._retrying(attempt)
