"""The dispatcher's store: requests, verdicts, results and node rows in the database, the
counters the dashboard shows, and what a restarted scheduler recovers.

It owns the writes of `requests` (every submitted request, durably, before it is acked),
`verdicts` (the audit: every verdict with the generator's signed rollout and the
verifier's signed verdict), `results` (through `scheduler.results.ResultsStream`) and
`nodes` rows, plus the in-memory `totals` and `recent_verdicts`; and the work counters of
a node (`generated`, `tokens`, `first_work`, `verified`, `accepted`, `rejected`: see
`scheduler.node_record`). It decides nothing: the dispatch loop (`scheduler.dispatch`)
says what to write.

Invariants:
- `release` writes one result per request at most (the database refuses a second:
  `AlreadyReleased`), and builds the row from a `Release` (rollout, generator, verdicts)
  or a `Failure` (none of them), nothing else.
- Every verdict recorded is written to the audit table.
- `open_jobs` returns every submitted request without a result: a restart loses nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, Literal

import msgpack
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from protocol.codec import decode, encode
from protocol.messages import Rollout, RolloutSpec, Verdict
from scheduler import db
from scheduler.jobs import Failure, Job, Release, Released
from scheduler.node_record import NodeRecord
from scheduler.results import ResultsStream
from scheduler.verification import VerdictKind

RECENT_VERDICTS = 50
Total = Literal[
    "submitted", "accepted", "failed", "verifications", "rejections", "disputes", "banned"
]


class Store:
    def __init__(self, engine: AsyncEngine, writer: db.Writer, pool_id: str):
        self.engine = engine
        self.writer = writer
        self.pool_id = pool_id
        self.results = ResultsStream(engine, writer)
        self.totals: dict[Total, int] = {
            "submitted": 0,
            "accepted": 0,
            "failed": 0,
            "verifications": 0,
            "rejections": 0,
            "disputes": 0,
            "banned": 0,
        }
        self.recent_verdicts: deque[dict] = deque(maxlen=RECENT_VERDICTS)
        # Statements are built once: the writer batches consecutive writes of one statement.
        self._insert_request = db.insert_ignoring_duplicates(engine, db.requests)
        self._insert_verdict = db.verdicts.insert()
        self._upsert_node = db.upsert_stmt(engine, db.nodes)

    def count(self, total: Total, n: int = 1) -> None:
        self.totals[total] += n

    # -- requests --------------------------------------------------------------------
    async def open_jobs(self) -> list[Job]:
        """Every submitted request without a result (the results sequence continues too)."""
        await self.results.load()
        async with self.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(db.requests).where(
                        db.requests.c.request_id.not_in(select(db.results.c.request_id))
                    )
                )
            ).all()
        return [
            Job(r.request_id, r.source, decode(r.spec, RolloutSpec), r.seed, r.submitted_at)
            for r in rows
        ]

    async def known(self, request_ids: list[str]) -> set[str]:
        """Which of `request_ids` were submitted before (whatever became of them)."""
        if not request_ids:
            return set()
        async with self.engine.connect() as conn:
            found = await conn.execute(
                select(db.requests.c.request_id).where(db.requests.c.request_id.in_(request_ids))
            )
            return set(found.scalars())

    async def write_requests(self, jobs: list[Job]) -> None:
        """Write new requests durably (returns once committed)."""
        rows = (
            {
                "request_id": j.request_id,
                "source": j.source,
                "spec": encode(j.spec),
                "seed": j.seed,
                "submitted_at": j.submitted_at,
                "rollout_envelope": None,
            }
            for j in jobs
        )
        await asyncio.gather(*self.writer.write_many(self._insert_request, rows))
        self.count("submitted", len(jobs))

    # -- generations and verdicts ------------------------------------------------------
    def record_generation(self, gen: NodeRecord, rollout: Rollout) -> None:
        gen.generated += 1
        gen.tokens += len(rollout.completion_ids)
        gen.first_work = gen.first_work or time.time()

    def record_verdict(
        self,
        kind: VerdictKind,
        rollout: Rollout,
        raw: bytes,
        verifier: NodeRecord,
        gen: NodeRecord | None,
        v: Verdict,
        envelope: bytes,
    ) -> None:
        """`verifier` signed verdict `v` (`envelope`) about `rollout` (`raw`) of `gen`."""
        verifier.verified += 1
        self.count("verifications")
        if not v.accepted:
            self.count("rejections")
        if gen is not None:
            if v.accepted:
                gen.accepted += 1
            else:
                gen.rejected += 1
        now = time.time()
        self.writer.write(
            self._insert_verdict,
            {
                "request_id": rollout.request_id,
                "kind": kind,
                "generator_id": rollout.node_id,
                "verifier_id": verifier.node_id,
                "accepted": v.accepted,
                "reasons": "; ".join(v.reasons),
                "rollout_envelope": raw,
                "verdict_envelope": envelope,
                "created_at": now,
            },
        )
        self.recent_verdicts.appendleft(
            {
                "time": now,
                "request_id": rollout.request_id,
                "generator_id": rollout.node_id,
                "verifier_id": verifier.node_id,
                "accepted": v.accepted,
                "kind": kind,
                "reasons": v.reasons,
            }
        )

    # -- results -----------------------------------------------------------------------
    async def release(self, out: Release | Failure) -> tuple[dict[str, Any], Released]:
        """Write `out`'s result; once committed, the row and what the front renders.
        Raises `AlreadyReleased` (a result exists) or the write's error."""
        job = out.job
        if isinstance(out, Release):
            made = out.generated
            status, detail = "accepted", out.detail
            released = Released(status, detail, made.raw, made.rollout)
            row = {
                "weights_version": made.rollout.weights_version,
                "generator_id": made.gen.node_id,
                "rollout_envelope": made.raw,
                "verdict_envelopes": msgpack.packb(list(out.verdicts)),
            }
        else:
            status, detail = "failed", out.why
            released = Released(status, detail, refused=out.refused)
            row = {
                "weights_version": 0,
                "generator_id": "",
                "rollout_envelope": b"",
                "verdict_envelopes": msgpack.packb([]),
            }
        written = await self.results.append(
            {
                "request_id": job.request_id,
                "source": job.source,
                "status": status,
                "detail": detail,
                **row,
            }
        )
        self.count(status)
        return written, released

    async def results_after(self, cursor: int, limit: int, wait_s: float) -> list:
        return await self.results.after(cursor, limit, wait_s)

    # -- nodes -------------------------------------------------------------------------
    def persist_node(self, node: NodeRecord) -> asyncio.Future:
        """Write `node`'s row (its state, reputation, weights); await it to be durable."""
        return self.writer.write(self._upsert_node, node.row(self.pool_id))
