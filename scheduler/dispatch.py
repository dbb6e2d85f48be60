"""Dispatch: every open request goes to a generator, its rollout to a verifier (and a judge
after a rejection), and its outcome into the results stream exactly once.

A `Job` (`scheduler.jobs`, which keeps the open jobs and the queue) is one open request:
submitted by the orchestrator (`submit`, source "dispatch") or made by the OpenAI front
for a client's call (`call`, source "openai"; the front waits for its release and renders
the answer from the released signed rollout). Both take the same path. Its life: queued ->
generating on node A -> (spot check) -> verifying on node B -> accepted: (audit, see
below) released; or rejected: a dispute judged by node C -> B overturned: released (B
loses reputation); A wrong: A loses reputation and the job is queued again for another
generator. Any failure of a node (connection, timeout, 5xx, death) sends the job
elsewhere; after `max_attempts` generations it is released as failed. A node that refuses
the request itself (a 4xx: too long for it, say) is not punished; once
`REFUSALS_BEFORE_FAILING` nodes refused it, it is released as failed with their reason
(the front answers it as the client's error).

Audit (`VerificationPolicy.audit_rate`): with that probability a rollout is released as
accepted only when two verifiers accepted it, and a generator is punished only when two
rejected it. An accepting first verdict is checked by an auditor (neither A nor B) before
anything is released; an overturned rejection (B rejected, judge C accepted) is audited by
a fourth node. Whenever two verifiers disagree, a third decides by majority and the
minority loses reputation: an auditor that rejected an honest rollout, or a verifier that
accepted a rollout two others rejected (punished like its generator: this is what catches
a verifier that accepts everything). A rejected job is queued again for another
generator. With audit_rate 1.0 a cheating generator's rollout is
released only if two verifiers lie for it. Which verdict comes next and what the verdicts
decide is `scheduler.verification.next_step` (pure, table-tested); this module picks and
calls the nodes and applies the decision.

Cheap checks before any verifier runs (`_check_rollout`): the signed rollout must answer
exactly the request (id, pool, seed, sampling, prompt, proof layout, min_version), and its
(weights_version, weights_hash) must pass the published-weights ledger
(`scheduler.ledger.WeightsLedger.check`: every `WeightUpdate` the scheduler relayed; a
version newer than any published is a lie; version 0 and hashless updates are left to
the verifier, who holds the weights of the claimed hash).

Per-node evidence (`scheduler.evidence_watch`): every verdict (but the evidence rechecks'
own) feeds its generator's sequential test; the release of a flagged node's rollouts
waits until the recheck is over, and nothing of a node it bans is released.

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
- Every verification is given the signed request, whatever the job's source.
- Restart: every submitted request without a result is re-dispatched, so a scheduler
  crash loses nothing; an OpenAI call open at the crash is released as failed (its
  client's connection is gone with the process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable
from typing import Literal

import msgpack
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from protocol.client import RemoteError
from protocol.codec import CodecError, decode, encode
from protocol.envelope import EnvelopeError, open_envelope, seal
from protocol.identity import Identity
from protocol.messages import Rollout, RolloutRequest, RolloutSpec, Verdict, VerifyRequest
from scheduler import db
from scheduler.channel import NodeChannels
from scheduler.config import DispatchConfig
from scheduler.evidence_watch import EvidenceWatch
from scheduler.jobs import Job, JobTable, Judged, Released, Saturated
from scheduler.ledger import WeightsLedger
from scheduler.lifecycle import BENCHED, CALLS_FAILING, transition
from scheduler.metrics import SchedulerMetrics
from scheduler.pool import SignedPool
from scheduler.registry import NodeRecord, Registry
from scheduler.results import AlreadyReleased, ResultsStream
from scheduler.verification import REJECTED_HONEST, Decision, Role, VerdictKind, next_step

log = logging.getLogger("prime.scheduler.dispatch")
TIMEOUTS_BEFORE_BENCH = 3
REFUSALS_BEFORE_FAILING = 2
# Overturned rejections remembered per generator (for a refund if it is banned later).
OVERTURNED_KEPT = 64
BENCH_S = 60.0
MAX_BENCH_S = 3600.0


class NodeFailed(Exception):
    """A node did not do what was asked (down, timeout, error, malformed answer)."""


class NodeRefused(NodeFailed):
    """A node answered 4xx: it found the request itself invalid (not a node fault)."""


class Cheated(Exception):
    """A node signed something that contradicts what it was asked: proof of dishonesty."""


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
        channels: NodeChannels,
        ledger: WeightsLedger | None = None,
    ):
        self.pool = pool
        self.channels = channels
        self.pool_id = pool.config.pool_id
        self.identity = identity
        self.registry = registry
        self.engine = engine
        self.writer = writer
        self.cfg = cfg
        self.metrics = metrics
        self.jobs = JobTable(cfg.max_queued)
        self.wake = asyncio.Event()
        self.node_tasks: dict[str, set[asyncio.Task]] = {}
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
        # Generator id -> verifiers that lost a dispute for rejecting one of its rollouts
        # (a judge accepted it): if that generator is banned later they were right, and
        # get the reputation back (an honest verifier rejecting a borderline cheat).
        self.overturned: dict[str, deque[str]] = {}
        self.evidence = EvidenceWatch(
            pool.config.verification.evidence, registry, self._judge, self._ban
        )
        # Request id -> the OpenAI front waiting for that job's release.
        self.waiters: dict[str, asyncio.Future[Released]] = {}
        # What the trainer published (`scheduler.ledger`): `_check_rollout` checks each
        # rollout's claim against it.
        self.ledger = ledger or WeightsLedger()
        self.results = ResultsStream(engine, writer)
        # Statements are built once: the writer batches consecutive writes of one statement.
        self.insert_request = db.insert_ignoring_duplicates(engine, db.requests)
        self.insert_verdict = db.verdicts.insert()

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
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
            if job.source == "dispatch":
                self.jobs.admit([job])
            else:
                self.jobs[job.request_id] = job
                self._spawn(job, self._release(job, "failed", "scheduler restarted mid-call"))
        if open_rows:
            log.info("recovered %d open requests after a restart", len(open_rows))
        self._loop_task = asyncio.create_task(self._dispatch_loop(), name="dispatch")
        # Recovered work must not wait for a node's state to change before it moves.
        self.kick()

    async def stop(self) -> None:
        tasks = [t for t in (self._loop_task, *(j.task for j in self.jobs.values())) if t]
        tasks += self.evidence.tasks
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

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
        new = await self._admit(self.jobs.new_jobs(specs, "dispatch"))
        return len(new), len(specs) - len(new)

    async def _admit(self, jobs: list[Job]) -> list[Job]:
        """Queue `jobs` (dispatch starts at once) and store them durably; returns the ones
        stored (those whose ids the database knew are withdrawn)."""
        self.jobs.admit(jobs)
        self.kick()
        try:
            new = await self._store_new(jobs)
        except BaseException:
            for job in jobs:
                self.jobs.withdraw(job)
            raise
        self.totals["submitted"] += len(new)
        self.metrics.requests_submitted_total.inc(len(new))
        self.metrics.queue_depth.set(len(self.jobs.queue))
        return new

    async def call(self, specs: list[RolloutSpec], timeout_s: float) -> list[Released]:
        """The OpenAI front's path: run fresh requests like any submission and wait for
        their release (TimeoutError past `timeout_s`; they are released anyway, later)."""
        needed = 2 if self.pool.config.verification.spot_check_rate > 0 else 1
        version = min(s.min_version for s in specs)
        able = sum(
            n.state == "healthy" and n.weights_version >= version for n in self.registry.healthy()
        )
        if able < needed:
            raise Saturated(
                f"{able} healthy node(s) hold weights version >= {version}; a call needs "
                f"{needed} (a generator and a verifier); retry later"
            )
        jobs = self.jobs.new_jobs(specs, "openai")
        if len(jobs) != len(specs):
            raise ValueError("request ids are already open")
        loop = asyncio.get_running_loop()
        # Waiting before dispatch starts: a release can come before the store returns.
        waits = [self.waiters.setdefault(j.request_id, loop.create_future()) for j in jobs]
        try:
            if len(await self._admit(jobs)) != len(jobs):
                raise ValueError("request ids were used before")
            async with asyncio.timeout(timeout_s):
                return list(await asyncio.gather(*waits))
        finally:
            for job in jobs:
                self.waiters.pop(job.request_id, None)

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
                self.jobs.withdraw(job)
            else:
                new.append(job)
        stmt = self.insert_request
        rows = (
            {
                "request_id": j.request_id,
                "source": j.source,
                "spec": encode(j.spec),
                "seed": j.seed,
                "submitted_at": j.submitted_at,
                "rollout_envelope": None,
            }
            for j in new
        )
        await asyncio.gather(*self.writer.write_many(stmt, rows))
        return new

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
        while (job := self.jobs.next_open()) is not None:
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
        self.jobs.put_back(waiting)
        self.metrics.queue_depth.set(len(self.jobs.queue))

    def _requeue(self, job: Job, why: str) -> None:
        if not self.jobs.is_open(job):
            return
        if job.attempts >= self.cfg.max_attempts:
            self._spawn(
                job, self._release(job, "failed", f"gave up after {job.attempts} attempts: {why}")
            )
            return
        log.info("re-dispatching %s: %s", job.request_id, why)
        self.metrics.dispatch_retries_total.inc()
        self.jobs.requeue(job)
        self.kick()

    # -- talking to nodes ------------------------------------------------------------
    async def _call(
        self, node: NodeRecord, route: str, body: bytes, timeout_s: float, reserve: bool = True
    ) -> bytes:
        """POST to a node over its channel; a node death (see `node_died`) or a closed
        channel fails the call. `reserve=False`: the caller already counted this call in
        the node's load."""
        task = asyncio.create_task(self.channels.post(node, route, body))
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
                if exc.status in (400, 413, 422):
                    raise NodeRefused(f"{node.label} refused {route}: {exc.message}")
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
            transition(node, "unhealthy", CALLS_FAILING)
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
            transition(node, "unhealthy", BENCHED)
            self.persist_node(node)
        log.warning(
            "%s let %d calls in a row time out: no work for %.0f s",
            node.label,
            node.timeouts,
            bench,
        )

    def node_died(self, node: NodeRecord, why: str = "") -> None:
        """Cancel every call in flight to a node that died, left, was banned or registered
        again (it restarted), and close its channel; their jobs go elsewhere."""
        for task in list(self.node_tasks.get(node.node_id, ())):
            task.cancel()
        self.channels.close(node.node_id, why or f"the node is {node.state}")

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
        except NodeRefused as exc:
            job.tried.add(gen.node_id)
            job.refusals.append(str(exc))
            if len(job.refusals) >= REFUSALS_BEFORE_FAILING:
                why = f"refused by {len(job.refusals)} nodes: " + "; ".join(job.refusals)
                self._spawn(job, self._release(job, "failed", why, refused=True))
            else:
                self._requeue(job, str(exc))
            return
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
        if self.jobs.is_open(job):  # not withdrawn (a resubmitted id) meanwhile
            gen.unsettled += 1
            try:
                await self._verify_and_release(job, gen, rollout, raw, request)
            finally:
                gen.unsettled -= 1
                self.kick()

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
                ("pool_id", r.pool_id == request.pool_id),
                ("node_id", r.node_id == gen.node_id),
                ("seed", r.seed == request.seed),
                ("sampling", r.sampling == request.sampling),
                ("prompt", r.prompt_ids == request.prompt_ids),
                ("min_version", r.weights_version >= request.min_version),
                ("proof layout", r.proof_params == request.proof),
                ("weights", self.ledger.check(r.weights_version, r.weights_hash)),
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
        request: RolloutRequest,
    ) -> None:
        """Run the verification protocol (`scheduler.verification.next_step`, which decides)
        over real nodes, then apply its decision."""
        verification = self.pool.config.verification
        if random.random() >= verification.spot_check_rate:
            await self._release(
                job, "accepted", "unverified (spot check)", raw, [], rollout, gen.node_id
            )
            return
        audited = random.random() < verification.audit_rate
        nodes: dict[Role, NodeRecord] = {"generator": gen}
        judged: list[Judged] = []
        while True:
            step = next_step(audited, tuple(j.verdict.accepted for j in judged))
            if isinstance(step, Decision):
                break
            if step.opens_dispute:
                self.totals["disputes"] += 1
            if step.unless_banned and gen.state == "banned":
                self._give_up_verification(job, gen, f"{gen.label} is banned")
                return
            exclude = [nodes[r] for r in step.exclude]
            answer = await self._judge(step.kind, rollout, raw, request, exclude=exclude)
            if answer is None:
                self._give_up_verification(job, gen, step.if_none)
                return
            nodes[step.role] = answer.node
            judged.append(answer)
        for role in step.rewards:
            self.registry.reward(nodes[role])
        for role, why in step.punish:
            self._punish(nodes[role], why)
            if why == REJECTED_HONEST:
                lost = self.overturned.setdefault(gen.node_id, deque(maxlen=OVERTURNED_KEPT))
                lost.append(nodes[role].node_id)
        if gen.state == "banned":  # banned meanwhile
            self._refund_overturned(gen)
        if step.lost_by:
            self.metrics.observe_dispute(step.lost_by)
        if step.released:
            envelopes = [j.envelope for j in judged]
            await self._release(job, "accepted", "", raw, envelopes, rollout, gen.node_id, gen)
        else:
            job.tried.add(gen.node_id)
            self._requeue(job, step.requeue_reason.format(generator=gen.label))

    def _give_up_verification(self, job: Job, gen: NodeRecord, why: str) -> None:
        job.tried.add(gen.node_id)
        self._requeue(job, why)

    async def _judge(
        self,
        kind: VerdictKind,
        rollout: Rollout,
        raw: bytes,
        request: RolloutRequest,
        exclude: list[NodeRecord],
        wait_s: float | None = None,
    ) -> Judged | None:
        """A verdict from an eligible node, retrying others on failure; None on timeout."""
        body = VerifyRequest(
            rollout_envelope=raw, expected_weights_hash=rollout.weights_hash, request=request
        )
        deadline = time.monotonic() + (self.cfg.verifier_wait_s if wait_s is None else wait_s)
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
            if kind != "evidence":
                self.evidence.observe(rollout, raw, request, node, v)
            return Judged(node, v, envelope)
        return None

    def _ban(self, node: NodeRecord, reason: str) -> None:
        """Ban outright (the per-node evidence was confirmed)."""
        if self.registry.ban(node, reason):
            self._banned(node, reason)
        self.persist_node(node)

    def _banned(self, node: NodeRecord, reason: str) -> None:
        """`node` was just banned: its calls end, and verifiers that lost a dispute for
        rejecting one of its rollouts get that reputation back."""
        self.totals["banned"] += 1
        self.metrics.bans_total.inc()
        log.warning("%s is BANNED: %s", node.label, reason)
        self.node_died(node)
        self._refund_overturned(node)

    def _refund_overturned(self, generator: NodeRecord) -> None:
        for verifier_id in self.overturned.pop(generator.node_id, ()):
            verifier = self.registry.get(verifier_id)
            if verifier is not None and self.registry.refund(verifier):
                log.warning(
                    "%s regains reputation (now %.2f): it rejected a rollout of %s, banned since",
                    verifier.label,
                    verifier.reputation,
                    generator.label,
                )
                self.persist_node(verifier)

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
            self._banned(node, reason)
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
        refused: bool = False,
    ) -> None:
        if gen is not None:
            await self.evidence.settled(gen)  # a flagged node's releases wait for its recheck
        if gen is not None and gen.state == "banned":
            # Banned while its rollout was being checked: release nothing from it.
            job.tried.add(gen.node_id)
            self._requeue(job, f"{gen.label} was banned")
            return
        if not self.jobs.withdraw(job):
            return
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
        waiter = self.waiters.get(job.request_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(Released(status, detail, raw, rollout, refused))
