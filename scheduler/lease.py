"""The replica lease: which of the scheduler replicas sharing one database is active.

Every replica tries to take or renew the database lease "scheduler" (`db.try_lease`,
one conditional UPDATE) every third of its TTL. The holder is active: it loaded state
and dispatches; every other replica is a standby (the server answers it 503) until the
lease is free, then it takes over exactly like a restart (`on_acquire`).

Invariants:
- Two replicas never dispatch together: a replica is `active` only after it took the
  lease, and an active replica that sees another holder, or has not renewed for 80% of
  the TTL (another replica may take over any moment now), exits at once
  (`os._exit(EXIT_LOST_LEASE)`: no cleanup that could still write or dispatch).
- A database outage during renewal counts as not renewed, never as held.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

from sqlalchemy.ext.asyncio import AsyncEngine

from scheduler import db

log = logging.getLogger("prime.scheduler")
LEASE = "scheduler"
EXIT_LOST_LEASE = 75


class ReplicaLease:
    def __init__(self, engine: AsyncEngine, replica_id: str, ttl_s: float, name: str = LEASE):
        self.engine = engine
        self.replica_id = replica_id
        self.ttl_s = ttl_s
        self.name = name
        self.holder = ""
        """The holder seen at the last attempt ('' before any)."""
        self.active = False
        """Whether this replica serves: it holds the lease and `on_acquire` returned."""

    async def renew(self) -> bool:
        """Take or renew the lease; whether this replica holds it now."""
        self.holder = await db.try_lease(self.engine, self.name, self.replica_id, self.ttl_s)
        return self.holder == self.replica_id

    async def acquire(self, on_acquire: Callable[[], Awaitable[None]]) -> bool:
        """One attempt (at startup): if the lease is taken, run `on_acquire` and serve."""
        if not await self.renew():
            return False
        await self._activate(on_acquire)
        return True

    async def run(self, on_acquire: Callable[[], Awaitable[None]]) -> None:
        """Renew forever: a standby takes over once the lease is free; an active replica
        that loses it exits the process."""
        last_renewed = time.monotonic()
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                held = await self.renew()
            except Exception as exc:  # noqa: BLE001 - a database outage is handled below
                log.warning("lease renewal failed: %s", exc)
                held = False
            if held:
                last_renewed = time.monotonic()
                if not self.active:
                    log.info("the previous active replica is gone: taking over")
                    await self._activate(on_acquire)
            elif self.active and (
                self.holder != self.replica_id or time.monotonic() - last_renewed > self.ttl_s * 0.8
            ):
                # Another replica may take over any moment now: stop before it does.
                log.critical("lost the scheduler lease (holder: %s): exiting", self.holder)
                os._exit(EXIT_LOST_LEASE)

    async def _activate(self, on_acquire: Callable[[], Awaitable[None]]) -> None:
        await on_acquire()
        self.active = True
