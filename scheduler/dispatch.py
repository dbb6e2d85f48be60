"""Dispatch: every open request goes to a generator, its rollout to a verifier (and a judge
after a rejection), and its outcome into the results stream exactly once.

A `Job` is one open request. Its life: queued -> generating on node A -> (spot check) ->
verifying on node B -> accepted: (audit, see below) released; or rejected: a dispute judged
by node C -> B overturned: released (B loses reputation); A wrong: A loses reputation and
the job is queued again for another generator. Any failure of a node (connection, timeout,
5xx, death) sends the job elsewhere; after `max_attempts` generations it is released as
failed.

Audit (`VerificationPolicy.audit_rate`): with that probability a rollout is released as
accepted only when two verifiers accepted it, and a generator is punished only when two
rejected it. An accepting first verdict is checked by an auditor (neither A nor B) before
anything is released; an overturned rejection (B rejected, judge C accepted) is audited by
a fourth node. Whenever two verifiers disagree, a third decides by majority and the
minority loses reputation: an auditor that rejected an honest rollout, or a verifier that
accepted a rollout two others rejected (punished like its generator: this is what catches
a verifier that accepts everything). A rejected job is released as rejected (OpenAI
calls) or queued again (dispatch). With audit_rate 1.0 a cheating generator's rollout is
released only if two verifiers lie for it.

Cheap checks before any verifier runs (`_check_rollout`): the signed rollout must answer
exactly the request (id, seed, sampling, prompt, proof layout, min_version), and its
(weights_version, weights_hash) must be what the trainer published for that version (the
scheduler keeps every `WeightUpdate` it relays: `note_published`); a rollout claiming a
version newer than any published is a lie too. Version 0 (the pool's base model, which a
swarm trainer also announces under its manifest hash while nodes hash its folder) and
updates published without a hash are not checked here; the
verifier, who holds the weights of the claimed hash, checks what was generated.

Timeouts: a node that lets `TIMEOUTS_BEFORE_BENCH` calls in a row time out (it heartbeats
but never answers) is benched: unhealthy, no work, whatever its heartbeats say, for
`BENCH_S` (doubling with every further timeout); one answered call clears its record.

Invariants:
- A job is released (into `scheduler.results`) at most once: a job leaves `jobs` before its
  release is written, and the database refuses a second result for a request id.
- Nothing is released from a banned generator, and nothing unverified unless the pool's
  spot-check rate says so; nothing is released before its audit (when drawn) returned.
- Every verdict received is written to the audit table with the generator's signed
  rollout and the verifier's signed verdict.
- Restart: every request without a result is re-dispatched (or, for an OpenAI-endpoint
  call whose rollout was stored, re-verified), so a scheduler crash loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
import msgpack
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from protocol.client import RemoteError, post_raw
from protocol.codec import CodecError, decode, encode
from protocol.envelope import EnvelopeError, open_envelope, seal
from protocol.identity import Identity
from protocol.messages import (
    MAX_SEED,
    Rollout,
    RolloutRequest,
    RolloutSpec,
    Verdict,
    VerifyRequest,
)
from scheduler import db
from scheduler.config import DispatchConfig
from scheduler.metrics import SchedulerMetrics
from scheduler.pool import SignedPool
from scheduler.registry import NodeRecord, Registry
from scheduler.results import AlreadyReleased, ResultsStream

log = logging.getLogger("prime.scheduler.dispatch")
Source = Literal["dispatch", "openai"]
VerdictKind = Literal["verify", "dispute", "audit"]
TIMEOUTS_BEFORE_BENCH = 3
BENCH_S = 60.0
MAX_BENCH_S = 3600.0


class Saturated(Exception):
    """The pool has more queued work than it accepts; retry later."""


class NodeFailed(Exception):
    """A node did not do what was asked (down, timeout, error, malformed answer)."""


class Cheated(Exception):
    """A node signed something that contradicts what it was asked: proof of dishonesty."""


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
    rollout_envelope: bytes | None = None
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
class Judged:
    node: NodeRecord
    verdict: Verdict
    envelope: bytes


class Dispatcher:
    def __init__(
        self,
        pool: SignedPool,
        identity: Identity,
        registry: Registry,
        engine: AsyncEngine,
        writer: db.Writer,
        cfg: DispatchConfig,
        metrics: SchedulerMetrics,
    ):
        self.pool = pool
        self.pool_id = pool.config.pool_id
        self.identity = identity
        self.registry = registry
        self.engine = engine
        self.writer = writer
        self.cfg = cfg
        self.metrics = metrics
        self.jobs: dict[str, Job] = {}
        self.queue: deque[Job] = deque()
        self.wake = asyncio.Event()
        self.node_tasks: dict[str, set[asyncio.Task]] = {}
        self.session: aiohttp.ClientSession | None = None
        self._loop_task: asyncio.Task | None = None
        self.upsert_node = db.upsert_stmt(engine, db.nodes)
        self.totals = {
            "submitted": 0,
            "accepted": 0,
            "failed": 0,
            "verifications": 0,
            "rejections": 0,
            "disputes": 0,
            "banned": 0,
        }
        self.recent_verdicts: deque[dict] = deque(maxlen=50)
        # Weights version -> manifest hashes ('' when published without one) of every
        # trainer-signed `WeightUpdate` the scheduler relayed (see `note_published`); a
        # version republished under another manifest keeps both.
        self.published: dict[int, set[str]] = {}
        self.results = ResultsStream(engine, writer)
        # Statements are built once: the writer batches consecutive writes of one statement.
        self.insert_request = db.insert_ignoring_duplicates(engine, db.requests)
        self.insert_verdict = db.verdicts.insert()

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60),
        )
        await self.results.load()
        async with self.engine.connect() as conn:
            open_rows = (
                await conn.execute(
                    select(db.requests).where(
                        db.requests.c.request_id.not_in(select(db.results.c.request_id))
                    )
                )
            ).all()
        for row in open_rows:
            job = Job(
                row.request_id,
                row.source,
                decode(row.spec, RolloutSpec),
                row.seed,
                row.submitted_at,
            )
            job.rollout_envelope = row.rollout_envelope
            self.jobs[job.request_id] = job
            if job.source == "dispatch":
                self.queue.append(job)
            elif job.rollout_envelope is not None:
                self._spawn(job, self._reverify_stored(job))
            else:
                self._spawn(job, self._release(job, "failed", "scheduler restarted mid-call"))
        if open_rows:
            log.info("recovered %d open requests after a restart", len(open_rows))
        self._loop_task = asyncio.create_task(self._dispatch_loop(), name="dispatch")
        # Recovered work must not wait for a node's state to change before it moves.
        self.kick()

    async def stop(self) -> None:
        tasks = [t for t in (self._loop_task, *(j.task for j in self.jobs.values())) if t]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.session is not None:
            await self.session.close()

    def _spawn(self, job: Job, coro: Awaitable) -> None:
        job.task = asyncio.create_task(self._guard(job, coro), name=f"job-{job.request_id}")

    async def _guard(self, job: Job, coro: Awaitable) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a bug must not strand a request
            log.exception("job %s crashed; re-dispatching it", job.request_id)
            self._requeue(job, "internal error")

    # -- submission ------------------------------------------------------------------
    async def submit(self, specs: list[RolloutSpec]) -> tuple[int, int]:
        """Queue new requests and store them durably; returns (new, already known).

        Dispatch starts at once, while the database is asked which ids it has released
        already and the new ones are written: the answer (and so the durability promise)
        waits for the commit, the generators do not. A request found to be known is
        withdrawn; its generation, if it started, is wasted but never released (a result
        is released only for the job that is open under its id).
        """
        if len(self.queue) + len(specs) > self.cfg.max_queued:
            raise Saturated(
                f"pool is saturated: {len(self.queue)} requests queued "
                f"(limit {self.cfg.max_queued}); retry later"
            )
        ids = [s.request_id for s in specs]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate request_id within one batch")
        now = time.time()
        fresh = [
            Job(s.request_id, "dispatch", s, new_seed(), now)
            for s in specs
            if s.request_id not in self.jobs
        ]
        for job in fresh:
            self.jobs[job.request_id] = job
            self.queue.append(job)
        self.kick()
        try:
            new = await self._store_new(fresh)
        except BaseException:
            for job in fresh:
                self._withdraw(job)
            raise
        self.totals["submitted"] += len(new)
        self.metrics.requests_submitted_total.inc(len(new))
        self.metrics.queue_depth.set(len(self.queue))
        return len(new), len(specs) - len(new)

    async def _store_new(self, jobs: list[Job]) -> list[Job]:
        """Withdraw the jobs whose ids the database knows; write the others; await the commit."""
        if not jobs:
            return []
        async with self.engine.connect() as conn:
            known = set(
                (
                    await conn.execute(
                        select(db.requests.c.request_id).where(
                            db.requests.c.request_id.in_([j.request_id for j in jobs])
                        )
                    )
                ).scalars()
            )
        new = []
        for job in jobs:
            if job.request_id in known:
                self._withdraw(job)
            else:
                new.append(job)
        stmt = self.insert_request
        rows = (
            {
                "request_id": j.request_id,
                "source": "dispatch",
                "spec": encode(j.spec),
                "seed": j.seed,
                "submitted_at": j.submitted_at,
                "rollout_envelope": None,
            }
            for j in new
        )
        await asyncio.gather(*self.writer.write_many(stmt, rows))
        return new

    def _withdraw(self, job: Job) -> None:
        if self.jobs.get(job.request_id) is job:
            del self.jobs[job.request_id]

    def _is_open(self, job: Job) -> bool:
        return self.jobs.get(job.request_id) is job

    # -- the dispatch loop -----------------------------------------------------------
    def kick(self) -> None:
        """Capacity or nodes changed: look at the queue again."""
        self.wake.set()

    async def _dispatch_loop(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            self._dispatch_ready()

    def _dispatch_ready(self) -> None:
        waiting: deque[Job] = deque()
        scanned = 0
        while self.queue:
            job = self.queue.popleft()
            if not self._is_open(job):
                continue
            node = self.registry.pick_generator(job.spec.min_version, job.tried)
            if node is None:
                waiting.append(job)
                scanned += 1
                # Without any free node, nothing further down the queue can go either.
                if scanned >= 256 or self.registry.pick_generator(0) is None:
                    break
                continue
            # Reserve now: the next pick in this loop must see this node's new load.
            node.in_flight += 1
            node.outstanding_tokens += job.est_tokens
            self._spawn(job, self._run_job(job, node))
        waiting.extend(self.queue)
        self.queue = waiting
        self.metrics.queue_depth.set(len(self.queue))

    def _requeue(self, job: Job, why: str) -> None:
        if not self._is_open(job):
            return
        if job.source == "openai":
            # The answer went to the client already: there is nothing to generate again.
            self._spawn(job, self._release(job, "failed", why))
            return
        if job.attempts >= self.cfg.max_attempts:
            self._spawn(
                job, self._release(job, "failed", f"gave up after {job.attempts} attempts: {why}")
            )
            return
        log.info("re-dispatching %s: %s", job.request_id, why)
        self.metrics.dispatch_retries_total.inc()
        job.queued_at = time.monotonic()
        self.queue.appendleft(job)
        self.kick()

    # -- talking to nodes ------------------------------------------------------------
    async def _call(
        self, node: NodeRecord, route: str, body: bytes, timeout_s: float, reserve: bool = True
    ) -> bytes:
        """POST to a node; a node death (see `node_died`) cancels the call. `reserve=False`:
        the caller already counted this call in the node's load."""
        assert self.session is not None
        task = asyncio.create_task(post_raw(self.session, node.http_url + route, body))
        self.node_tasks.setdefault(node.node_id, set()).add(task)
        node.in_flight += reserve
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                task.cancel()
                self.note_timeout(node)
                raise NodeFailed(f"{node.label} did not answer {route} within {timeout_s:.0f} s")
            if task.cancelled():
                raise NodeFailed(f"{node.label} died during {route}")
            exc = task.exception()
            if isinstance(exc, RemoteError):
                raise NodeFailed(f"{node.label} answered {route} with {exc}")
            if exc is not None:
                self._note_failure(node)
                raise NodeFailed(f"{node.label} unreachable for {route}: {exc!r}")
            node.failures = 0
            node.timeouts = 0
            return task.result()
        finally:
            node.in_flight -= reserve
            self.node_tasks[node.node_id].discard(task)
            self.kick()

    def _note_failure(self, node: NodeRecord) -> None:
        node.failures += 1
        if node.failures >= 3 and node.state == "healthy":
            node.state = "unhealthy"
            log.warning("%s failed 3 calls in a row: unhealthy until it heartbeats", node.label)

    def note_timeout(self, node: NodeRecord) -> None:
        """A call to `node` timed out. Heartbeats do not clear this record (a node that
        heartbeats but never answers is exactly what it catches); an answered call does."""
        node.timeouts += 1
        if node.timeouts < TIMEOUTS_BEFORE_BENCH or node.state == "banned":
            return
        bench = min(MAX_BENCH_S, BENCH_S * 2 ** (node.timeouts - TIMEOUTS_BEFORE_BENCH))
        node.benched_until = time.time() + bench
        if node.state in ("healthy", "registered"):
            node.state = "unhealthy"
            self.persist_node(node)
        log.warning(
            "%s let %d calls in a row time out: no work for %.0f s",
            node.label,
            node.timeouts,
            bench,
        )

    def node_died(self, node: NodeRecord) -> None:
        """Cancel every call in flight to a dead node; their jobs go elsewhere."""
        for task in list(self.node_tasks.get(node.node_id, ())):
            task.cancel()

    # -- one job ---------------------------------------------------------------------
    async def _run_job(self, job: Job, gen: NodeRecord) -> None:
        job.attempts += 1
        self.metrics.dispatch_latency_seconds.observe(time.monotonic() - job.queued_at)
        request = job.request(self.pool_id, self.pool.config.verification.proof)
        try:
            raw = await self._call(
                gen,
                "/v1/rollouts",
                seal(self.identity, request),
                self.cfg.generate_timeout_s,
                reserve=False,
            )
            rollout = self._check_rollout(raw, gen, request)
        except NodeFailed as exc:
            job.tried.add(gen.node_id)
            self._requeue(job, str(exc))
            return
        except Cheated as exc:
            job.tried.add(gen.node_id)
            self._punish(gen, f"signed a rollout that contradicts its request: {exc}")
            self._requeue(job, f"{gen.label} cheated: {exc}")
            return
        finally:
            gen.in_flight -= 1
            gen.outstanding_tokens -= job.est_tokens
        gen.generated += 1
        gen.tokens += len(rollout.completion_ids)
        gen.first_work = gen.first_work or time.time()
        if self._is_open(job):  # not withdrawn (a resubmitted id) meanwhile
            gen.unsettled += 1
            try:
                await self._verify_and_release(job, gen, rollout, raw, request)
            finally:
                gen.unsettled -= 1
                self.kick()

    def note_published(self, version: int, weights_hash: str) -> set[str]:
        """The trainer published `version` with this manifest hash (the scheduler relays
        it); returns every hash known for that version."""
        known = self.published.setdefault(version, set())
        known.add(weights_hash)
        return known

    def _weights_claim_ok(self, version: int, weights_hash: str) -> bool:
        """Whether (version, hash) can be what the trainer published (see the module doc)."""
        if version == 0:
            # The pool's starting model: nodes hash its folder, a swarm trainer announces it
            # under its manifest hash; verifiers holding the claimed hash check it anyway.
            return True
        known = self.published.get(version)
        if known is None:
            return version == 0 or version <= max(self.published, default=0)
        return "" in known or weights_hash in known

    def _check_rollout(self, raw: bytes, gen: NodeRecord, request: RolloutRequest) -> Rollout:
        """Cheap checks the scheduler can make itself before anyone spends a prefill."""
        try:
            opened = open_envelope(raw, Rollout, check_expiry=False)
        except (EnvelopeError, CodecError, ValueError) as exc:
            raise NodeFailed(f"{gen.label} sent an unreadable rollout: {exc}") from exc
        if opened.sender != gen.public_key:
            raise NodeFailed(f"rollout from {gen.label} is signed by {opened.sender_id}")
        r = opened.message
        mismatches = [
            name
            for name, ok in (
                ("request_id", r.request_id == request.request_id),
                ("node_id", r.node_id == gen.node_id),
                ("seed", r.seed == request.seed),
                ("sampling", r.sampling == request.sampling),
                ("prompt", r.prompt_ids == request.prompt_ids),
                ("min_version", r.weights_version >= request.min_version),
                ("proof layout", r.proof_params == request.proof),
                ("weights", self._weights_claim_ok(r.weights_version, r.weights_hash)),
            )
            if not ok
        ]
        if mismatches:
            raise Cheated(", ".join(mismatches))
        return r

    async def _verify_and_release(
        self,
        job: Job,
        gen: NodeRecord,
        rollout: Rollout,
        raw: bytes,
        request: RolloutRequest | None,
    ) -> None:
        if random.random() >= self.pool.config.verification.spot_check_rate:
            await self._release(
                job, "accepted", "unverified (spot check)", raw, [], rollout, gen.node_id
            )
            return
        if gen.state == "banned":
            self._give_up_verification(job, gen, f"{gen.label} is banned")
            return
        first = await self._judge("verify", rollout, raw, request, exclude=[gen])
        if first is None:
            self._give_up_verification(job, gen, "no eligible verifier")
            return
        audited = random.random() < self.pool.config.verification.audit_rate
        if first.verdict.accepted:
            if not audited:
                self.registry.reward(gen)
                self.registry.reward(first.node)
                await self._release(
                    job, "accepted", "", raw, [first.envelope], rollout, gen.node_id, gen
                )
                return
            audit = await self._judge("audit", rollout, raw, request, exclude=[gen, first.node])
            if audit is None:
                self._give_up_verification(job, gen, "accepted, but no eligible auditor")
                return
            if audit.verdict.accepted:
                for node in (gen, first.node, audit.node):
                    self.registry.reward(node)
                await self._release(
                    job,
                    "accepted",
                    "",
                    raw,
                    [first.envelope, audit.envelope],
                    rollout,
                    gen.node_id,
                    gen,
                )
                return
            self.totals["disputes"] += 1
            # Settled even if the generator was banned meanwhile: the outcome also says
            # whether the first verifier lied.
            await self._settle(job, gen, rollout, raw, request, "dispute", yes=first, no=audit)
            return
        self.totals["disputes"] += 1
        if gen.state == "banned":  # banned meanwhile: no need to settle this one
            self._give_up_verification(job, gen, f"{gen.label} is banned")
            return
        judge = await self._judge("dispute", rollout, raw, request, exclude=[gen, first.node])
        if judge is None:
            # Nobody can settle it: punish no one, trust nothing from this rollout.
            self._give_up_verification(job, gen, "rejected, and no judge for the dispute")
            return
        if judge.verdict.accepted and audited:
            # One verdict each way: the audit of the judge's acceptance decides.
            await self._settle(job, gen, rollout, raw, request, "audit", yes=judge, no=first)
        elif judge.verdict.accepted:
            self.metrics.observe_dispute("verifier")
            self._punish(first.node, "lost a dispute: rejected an honest rollout")
            self.registry.reward(gen)
            await self._release(
                job,
                "accepted",
                "",
                raw,
                [first.envelope, judge.envelope],
                rollout,
                gen.node_id,
                gen,
            )
        else:
            self.metrics.observe_dispute("generator")
            self.registry.reward(first.node)
            job.tried.add(gen.node_id)
            self._punish(gen, "lost a dispute: its rollout was rejected by two verifiers")
            if job.source == "openai":
                await self._release(
                    job,
                    "rejected",
                    "; ".join(judge.verdict.reasons),
                    raw,
                    [first.envelope, judge.envelope],
                    rollout,
                    gen.node_id,
                )
            else:
                self._requeue(job, f"rollout from {gen.label} rejected in a dispute")

    async def _settle(
        self,
        job: Job,
        gen: NodeRecord,
        rollout: Rollout,
        raw: bytes,
        request: RolloutRequest | None,
        kind: VerdictKind,
        yes: Judged,
        no: Judged,
    ) -> None:
        """Two verifiers disagree (`yes` accepted, `no` rejected) in an audited rollout: a
        third node decides by majority, and the side in the minority loses reputation; a
        verifier that accepted a rollout two others rejected is punished like its
        generator (this is what catches a verifier that accepts everything unchecked)."""
        third = await self._judge(kind, rollout, raw, request, exclude=[gen, yes.node, no.node])
        if third is None:
            self._give_up_verification(job, gen, "verifiers disagree, and no third to settle it")
            return
        first, second = (yes, no) if kind == "dispute" else (no, yes)  # in the order asked
        envelopes = [first.envelope, second.envelope, third.envelope]
        if third.verdict.accepted:
            self.metrics.observe_dispute("verifier")
            self._punish(no.node, "lost a dispute: rejected an honest rollout")
            for node in (gen, yes.node, third.node):
                self.registry.reward(node)
            await self._release(job, "accepted", "", raw, envelopes, rollout, gen.node_id, gen)
            return
        self.metrics.observe_dispute("generator")
        self.registry.reward(no.node)
        self.registry.reward(third.node)
        job.tried.add(gen.node_id)
        self._punish(yes.node, "lost a dispute: accepted a rollout that two verifiers rejected")
        self._punish(gen, "lost a dispute: its rollout was rejected by two verifiers")
        if job.source == "openai":
            reasons = "; ".join(third.verdict.reasons)
            await self._release(job, "rejected", reasons, raw, envelopes, rollout, gen.node_id)
        else:
            self._requeue(job, f"rollout from {gen.label} rejected by two of three verifiers")

    def _give_up_verification(self, job: Job, gen: NodeRecord, why: str) -> None:
        job.tried.add(gen.node_id)
        if job.source == "openai":
            self._spawn(job, self._release(job, "failed", why))
        else:
            self._requeue(job, why)

    async def _judge(
        self,
        kind: VerdictKind,
        rollout: Rollout,
        raw: bytes,
        request: RolloutRequest | None,
        exclude: list[NodeRecord],
    ) -> Judged | None:
        """A verdict from an eligible node, retrying others on failure; None on timeout."""
        body = VerifyRequest(
            rollout_envelope=raw, expected_weights_hash=rollout.weights_hash, request=request
        )
        deadline = time.monotonic() + self.cfg.verifier_wait_s
        tried: set[str] = set()
        while time.monotonic() < deadline:
            node = self.registry.pick_verifier(rollout.weights_hash, exclude, tried)
            if node is None:
                await asyncio.sleep(0.2)
                continue
            try:
                envelope = await self._call(
                    node, "/v1/verify", seal(self.identity, body), self.cfg.verify_timeout_s
                )
                opened = open_envelope(envelope, Verdict, check_expiry=False)
            except (NodeFailed, EnvelopeError, CodecError, ValueError) as exc:
                log.info("verifier %s failed: %s", node.label, exc)
                tried.add(node.node_id)
                continue
            v = opened.message
            if (
                opened.sender != node.public_key
                or v.request_id != rollout.request_id
                or v.rollout_digest != rollout.digest()
                or v.generator_id != rollout.node_id
            ):
                log.warning("verifier %s sent a verdict about something else", node.label)
                tried.add(node.node_id)
                continue
            self._record_verdict(kind, rollout, raw, node, v, envelope)
            return Judged(node, v, envelope)
        return None

    def _record_verdict(
        self, kind: str, rollout: Rollout, raw: bytes, node: NodeRecord, v: Verdict, env: bytes
    ) -> None:
        node.verified += 1
        self.totals["verifications"] += 1
        if not v.accepted:
            self.totals["rejections"] += 1
        self.metrics.observe_verdict(v.accepted)
        gen = self.registry.get(rollout.node_id)
        if gen is not None:
            if v.accepted:
                gen.accepted += 1
            else:
                gen.rejected += 1
        now = time.time()
        self.writer.write(
            self.insert_verdict,
            {
                "request_id": rollout.request_id,
                "kind": kind,
                "generator_id": rollout.node_id,
                "verifier_id": node.node_id,
                "accepted": v.accepted,
                "reasons": "; ".join(v.reasons),
                "rollout_envelope": raw,
                "verdict_envelope": env,
                "created_at": now,
            },
        )
        self.recent_verdicts.appendleft(
            {
                "time": now,
                "request_id": rollout.request_id,
                "generator_id": rollout.node_id,
                "verifier_id": node.node_id,
                "accepted": v.accepted,
                "kind": kind,
                "reasons": v.reasons,
            }
        )

    def _punish(self, node: NodeRecord, reason: str) -> None:
        banned = self.registry.penalize(node, reason)
        log.warning("%s loses reputation (now %.2f): %s", node.label, node.reputation, reason)
        if banned:
            self.totals["banned"] += 1
            self.metrics.bans_total.inc()
            log.warning("%s is BANNED: %s", node.label, reason)
            self.node_died(node)
        self.persist_node(node)

    def persist_node(self, node: NodeRecord) -> asyncio.Future:
        return self.writer.write(self.upsert_node, node.row(self.pool_id))

    # -- release ---------------------------------------------------------------------
    async def _release(
        self,
        job: Job,
        status: Literal["accepted", "rejected", "failed"],
        detail: str,
        raw: bytes = b"",
        verdict_envelopes: list[bytes] | None = None,
        rollout: Rollout | None = None,
        generator_id: str = "",
        gen: NodeRecord | None = None,
    ) -> None:
        if gen is not None and gen.state == "banned":
            # Banned while its rollout was being checked: release nothing from it.
            job.tried.add(gen.node_id)
            self._requeue(job, f"{gen.label} was banned")
            return
        if not self._is_open(job):
            return
        del self.jobs[job.request_id]
        try:
            row = await self.results.append(
                {
                    "request_id": job.request_id,
                    "source": job.source,
                    "status": status,
                    "detail": detail,
                    "weights_version": rollout.weights_version if rollout else 0,
                    "generator_id": generator_id,
                    "rollout_envelope": raw,
                    "verdict_envelopes": msgpack.packb(verdict_envelopes or []),
                }
            )
        except AlreadyReleased:
            log.warning("%s was released before; not again", job.request_id)
            return
        except Exception as exc:  # noqa: BLE001 - the job must not be lost
            log.error("could not store the result of %s (%s); will retry", job.request_id, exc)
            self.jobs[job.request_id] = job
            await asyncio.sleep(1.0)
            self._requeue(job, "result write failed")
            return
        self.totals["accepted" if status != "failed" else "failed"] += 1
        self.metrics.observe_release(status, job.submitted_at, row["released_at"])

    async def _reverify_stored(self, job: Job) -> None:
        assert job.rollout_envelope is not None
        opened = open_envelope(job.rollout_envelope, Rollout, check_expiry=False)
        gen = self.registry.get(opened.sender_id)
        if gen is None:
            await self._release(job, "failed", "generator unknown after restart")
            return
        await self._verify_and_release(job, gen, opened.message, job.rollout_envelope, None)

    # -- OpenAI-endpoint calls -------------------------------------------------------
    async def adopt_openai(
        self, request_id: str, spec: RolloutSpec, seed: int, raw: bytes, gen: NodeRecord
    ) -> None:
        """Store an OpenAI-endpoint rollout durably and verify it behind the answer."""
        job = Job(request_id, "openai", spec, seed, time.time(), rollout_envelope=raw)
        await self.writer.write(
            self.insert_request,
            {
                "request_id": request_id,
                "source": "openai",
                "spec": encode(spec),
                "seed": seed,
                "submitted_at": job.submitted_at,
                "rollout_envelope": raw,
            },
        )
        self.jobs[request_id] = job
        self.totals["submitted"] += 1
        rollout = open_envelope(raw, Rollout, check_expiry=False).message
        if not self._weights_claim_ok(rollout.weights_version, rollout.weights_hash):
            self._punish(gen, "signed a rollout claiming weights the trainer never published")
            self._spawn(
                job,
                self._release(
                    job, "rejected", "weights never published", raw, [], rollout, gen.node_id
                ),
            )
            return
        self._spawn(job, self._verify_and_release(job, gen, rollout, raw, None))
