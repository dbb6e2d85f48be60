"""Jobs: the open requests and the queue of those waiting for a generator (plain data and
bookkeeping, no I/O; `scheduler.dispatch` runs the protocol over them).

A `Job` is one open request: submitted by the orchestrator (source "dispatch") or made by
the OpenAI front for a client's call (source "openai"). The `JobTable` maps each open
request id to its job and keeps the queue; `Generated` is a rollout a generator signed
that passed the scheduler's own checks; `Judged` is one verdict a node gave about a
rollout. What the dispatch loop releases is one value: a `Release` (a rollout, always with
the generator that made it, and the verdicts that go out with it) or a `Failure` (no
rollout and no generator, by construction). `Released` is what became of a request, as
the OpenAI front renders it.

Invariants:
- At most one job is open per request id; a new batch never reopens an id that is open,
  and never holds one id twice (`new_jobs`).
- A job is open exactly while it is in the table: withdrawing or releasing takes it out
  (`withdraw` succeeds once), and a job that is not open is never handed out by the queue
  (`next_open` drops it).
- New work is refused (`Saturated`) once the queue would exceed `max_queued`; a job put
  back for another generator goes to the front of its priority's queue.
- The queue hands out jobs by priority (`RolloutSpec.priority`, lower first, as vLLM's),
  first come first served within one: a lower-priority job (an orchestrator's online
  evaluation) never goes before a waiting job of a higher one (its training requests).
- A `Release` cannot be built without its generator (`Generated.gen`): whoever releases it
  can always wait for that generator's settlement and check it is not banned.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from protocol.messages import MAX_SEED, Rollout, RolloutRequest, RolloutSpec, Verdict
from scheduler.node_record import NodeRecord

Source = Literal["dispatch", "openai"]


class Saturated(Exception):
    """The pool has more queued work than it accepts; retry later."""


def new_seed() -> int:
    return secrets.randbits(63) & MAX_SEED


@dataclass
class Job:
    request_id: str
    source: Source
    spec: RolloutSpec
    seed: int
    submitted_at: float
    queued_at: float = field(default_factory=time.monotonic)
    attempts: int = 0
    tried: set[str] = field(default_factory=set)
    refusals: list[str] = field(default_factory=list)
    refused_by: set[str] = field(default_factory=set)  # never asked again for this job
    task: asyncio.Task | None = None

    @property
    def est_tokens(self) -> int:
        return len(self.spec.prompt_ids) + self.spec.sampling.max_tokens

    def request(self, pool_id: str, proof) -> RolloutRequest:
        return RolloutRequest(
            request_id=self.request_id,
            pool_id=pool_id,
            prompt_ids=self.spec.prompt_ids,
            sampling=self.spec.sampling,
            seed=self.seed,
            min_version=self.spec.min_version,
            proof=proof,
        )


@dataclass
class Released:
    """What became of one request: the OpenAI front renders its answer from this."""

    status: Literal["accepted", "rejected", "failed"]
    detail: str
    envelope: bytes = b""
    rollout: Rollout | None = None
    refused: bool = False
    """Failed because nodes refused the request itself (the client's error)."""


@dataclass(frozen=True)
class Generated:
    """A rollout `gen` signed (`raw`, the envelope) that passed the scheduler's checks."""

    gen: NodeRecord
    rollout: Rollout
    raw: bytes


@dataclass(frozen=True)
class Release:
    """Release `job` as accepted with this rollout: unverified (a spot check skipped it) or
    with the verdicts (envelopes) that decided it."""

    job: Job
    generated: Generated
    verdicts: tuple[bytes, ...] = ()
    detail: str = ""


@dataclass(frozen=True)
class Failure:
    """Release `job` as failed: no rollout, no generator. `refused`: nodes refused the
    request itself (the client's error)."""

    job: Job
    why: str
    refused: bool = False


@dataclass
class Judged:
    """A verdict `node` signed (`envelope`) about a rollout."""

    node: NodeRecord
    verdict: Verdict
    envelope: bytes


class JobTable(dict[str, Job]):
    """The open jobs by request id, and the queues of those waiting for a generator: one
    per priority, each in order."""

    def __init__(self, max_queued: int):
        super().__init__()
        self.max_queued = max_queued
        self.queues: dict[int, deque[Job]] = {}

    @property
    def queued(self) -> int:
        """Jobs waiting for a generator (closed ones still queued included)."""
        return sum(len(q) for q in self.queues.values())

    def _queue(self, job: Job) -> deque[Job]:
        priority = job.spec.priority
        if priority not in self.queues:
            self.queues = dict(sorted({**self.queues, priority: deque()}.items()))
        return self.queues[priority]

    def new_jobs(self, specs: list[RolloutSpec], source: Source) -> list[Job]:
        """Jobs for the specs whose ids are not open (they are not queued yet)."""
        if self.queued + len(specs) > self.max_queued:
            raise Saturated(
                f"pool is saturated: {self.queued} requests queued "
                f"(limit {self.max_queued}); retry later"
            )
        ids = [s.request_id for s in specs]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate request_id within one batch")
        now = time.time()
        return [
            Job(s.request_id, source, s, new_seed(), now) for s in specs if s.request_id not in self
        ]

    def admit(self, jobs: list[Job]) -> None:
        """Open `jobs` and queue them."""
        for job in jobs:
            self[job.request_id] = job
            self._queue(job).append(job)

    def is_open(self, job: Job) -> bool:
        return self.get(job.request_id) is job

    def withdraw(self, job: Job) -> bool:
        """Close `job`; False if it was not open (withdrawn or released already)."""
        if not self.is_open(job):
            return False
        del self[job.request_id]
        return True

    def requeue(self, job: Job) -> None:
        """Put an open job back at the front of its queue, for another generator."""
        job.queued_at = time.monotonic()
        self._queue(job).appendleft(job)

    def next_open(self) -> Job | None:
        """Take the first open job of the most urgent priority off the queues (closed ones
        are dropped); None if every queue is empty."""
        for queue in self.queues.values():
            while queue:
                job = queue.popleft()
                if self.is_open(job):
                    return job
        return None

    def put_back(self, waiting: deque[Job]) -> None:
        """Jobs taken by `next_open` but not dispatched return ahead of the rest of their
        queue, in order."""
        for job in reversed(waiting):
            self._queue(job).appendleft(job)
