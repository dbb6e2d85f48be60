"""The results stream: each request's final outcome, written once, read by cursor.

`ResultsStream.append` gives a result the next `seq`, writes it through the group
committing writer and, once committed, makes it visible to readers; `after` answers
"results with seq > cursor" (long-polling), from memory for recent cursors and from the
database for older ones (or after a restart).

Invariants:
- A result becomes visible only after its row committed, and `results.request_id` is
  unique in the database: a request is delivered at most once, whatever happens.
- `seq` strictly increases in commit order (one active scheduler per database), so a
  reader that passes the last seq it processed never misses or repeats a result.
- `recent` holds the newest committed results, contiguous in seq: serving a cursor from
  it gives exactly what the database would.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import time
from collections import deque
from types import SimpleNamespace
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from scheduler import db

RECENT_RESULTS = 20_000
# A woken long-poll yields this long so one answer carries a whole group commit.
COALESCE_S = 0.002


class AlreadyReleased(Exception):
    """The database already holds a result for this request."""


class ResultsStream:
    def __init__(self, engine: AsyncEngine, writer: db.Writer):
        self.engine = engine
        self.writer = writer
        self.seq = 0
        self.recent: deque[SimpleNamespace] = deque(maxlen=RECENT_RESULTS)
        self._released = asyncio.Condition()
        self._insert = db.results.insert()

    async def load(self) -> None:
        """Continue the sequence where the database left it (start, restart, takeover)."""
        async with self.engine.connect() as conn:
            self.seq = await db.max_seq(conn)

    async def append(self, row: dict[str, Any]) -> dict[str, Any]:
        """Write one result (all columns but `seq`); return it once committed.

        Raises `AlreadyReleased` if the request has a result already, or the write error.
        """
        self.seq += 1
        row = {"seq": self.seq, "released_at": time.time(), **row}
        try:
            await self.writer.write(self._insert, row)
        except Exception:
            if await self._has(row["request_id"]):
                raise AlreadyReleased(row["request_id"]) from None
            raise
        self.recent.append(SimpleNamespace(**row))
        async with self._released:
            self._released.notify_all()
        return row

    async def _has(self, request_id: str) -> bool:
        with contextlib.suppress(Exception):
            async with self.engine.connect() as conn:
                found = await conn.execute(
                    select(db.results.c.seq).where(db.results.c.request_id == request_id)
                )
                return found.first() is not None
        return False

    async def after(self, cursor: int, limit: int, wait_s: float) -> list:
        """Results with seq > cursor, oldest first; waits up to wait_s when there are none."""
        rows = await self._from(cursor, limit)
        if rows or wait_s <= 0:
            return rows
        with contextlib.suppress(TimeoutError):
            async with self._released:
                await asyncio.wait_for(self._released.wait(), wait_s)
            await asyncio.sleep(COALESCE_S)
        return await self._from(cursor, limit)

    async def _from(self, cursor: int, limit: int) -> list:
        recent = self.recent
        if recent and cursor >= recent[0].seq - 1:
            start = bisect.bisect_right(recent, cursor, key=lambda r: r.seq)
            return list(itertools.islice(recent, start, start + limit))
        async with self.engine.connect() as conn:
            return (
                await conn.execute(
                    select(db.results)
                    .where(db.results.c.seq > cursor)
                    .order_by(db.results.c.seq)
                    .limit(limit)
                )
            ).all()
