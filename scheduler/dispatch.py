"""Dispatch: every open request goes to a generator, its rollout to a verifier (and a judge
after a rejection), and its outcome into the results stream exactly once.

The dispatcher is a loop that applies decisions made elsewhere (as vLLM v1 keeps its
scheduler): `scheduler.verification.next_step` decides which verdict comes next and what
the verdicts decide (pure, table-tested); the loop picks the nodes (`scheduler.registry`),
calls them through a node-call layer (`scheduler.node_calls.NodeCalls`: channel, timeout,
the call counters and benching; a test passes a fake with its interface), writes through
the store (`scheduler.store`: requests, verdicts, results, node rows, restart recovery)
and applies rewards and punishments through `scheduler.sanctions`. What it releases is
one value: a `Release` (a rollout, with the generator that made it) or a `Failure` (no
rollout, no generator; `scheduler.jobs`).

A `Job` (`scheduler.jobs`, which keeps the open jobs and the queue) is one open request:
submitted by the orchestrator (`submit`, source "dispatch") or made by the OpenAI front
for a client's call (`call`, source "openai"; the front waits for its release and renders
the answer from the released signed rollout). Both take the same path. Its life: queued ->
generating on node A -> (spot check) -> verifying on node B -> accepted: (audit, see
below) released; or rejected: a dispute judged by node C -> B overturned: released (B
loses reputation); A wrong: A loses reputation and the job is queued again for another
generator. Any failure of a node (connection, timeout, 5xx, death) sends the job
elsewhere; after `max_attempts` generations it is released as failed. "Another generator"
while one is left: once every node able to serve a job has tried it, they may again
(`Registry.pick_generator`), so a job never waits for a node it has not met. A node that refuses
the request itself (a 4xx: too long for it, say) is not punished; once
`REFUSALS_BEFORE_FAILING` nodes (or every node able to serve it) refused it, it is
released as failed with their reason (the front answers it as the client's error); a node
that refused a request is never asked for it again, and once another node serves it, its
refusal counts as a failed call (`scheduler.node_calls`: a node refusing everything is
benched). A client's call (source "openai") that no healthy node can take any more is
released as failed at once (503 with Retry-After at the front), not after
`openai_timeout_s`.

Spot checks (`scheduler.spot_checks`): a rollout is verified with the pool's rate
(`VerificationPolicy.spot_check_rate`) or its generator's own (`spot_checks`: a rate that
falls with the node's accepted history); one that is not is released as accepted,
"unverified (spot check)", through the same release as every other (it waits for its
generator's settlement and is never released from a banned generator). Under per-node
rates it is first held until a verified rollout its generator made later was accepted;
if a check of that node is rejected, or none comes, it is verified itself. The draws
(spot check, audit) come from the `rng` given to the constructor, so a test can seed them.

Audit (`VerificationPolicy.audit_rate`): with that probability a rollout is released as
accepted only when two verifiers accepted it, and a generator is punished only when two
rejected it. An accepting first verdict is checked by an auditor (neither A nor B) before
anything is released; an overturned rejection (B rejected, judge C accepted) is audited by
a fourth node. Whenever two verifiers disagree, a third decides by majority and the
minority loses reputation: an auditor that rejected an honest rollout, or a verifier that
accepted a rollout two others rejected (punished like its generator: this is what catches
a verifier that accepts everything). A rejected job is queued again for another
generator. With audit_rate 1.0 a cheating generator's rollout is released only if two
verifiers lie for it. A verifier that lost a dispute about a generator banned later gets
its reputation back (`scheduler.sanctions`).

Cheap checks before any verifier runs (`scheduler.checks.open_rollout`): the signed
rollout must answer exactly the request (`protocol.answers.request_mismatches`, the same
comparison every verifier makes) and claim weights the published-weights ledger allows
(`scheduler.ledger.WeightsLedger.check`); a contradiction signed by the generator is
punished like a lost dispute.

Per-node evidence (`scheduler.evidence_watch`): every verdict (but the evidence rechecks'
own) feeds its generator's sequential test; the release of a flagged node's rollouts
waits until the recheck is over, and nothing of a node it bans is released.

Failing and timing-out nodes are benched by the node-call layer (`scheduler.node_calls`:
calls failing with 5xx or timing out in a row make a node unhealthy for a backoff that
heartbeats do not shorten; an answered call ends the run).

Invariants:
- A job is released (into `scheduler.results`) at most once: a job leaves `jobs` before its
  release is written, and the database refuses a second result for a request id.
- Nothing is released from a banned generator, nothing of a flagged generator before its
  recheck settled, and nothing unverified unless the pool's spot-check rate says so; on
  every path (verified or spot-checked), as a `Release` carries its generator; under
  per-node rates, nothing unverified before a check of a rollout its generator made later
  was accepted. Nothing is released before its audit (when drawn) returned, and a
  rollout a recent checker (`Registry.is_recent`) accepted is always audited by an
  established one.
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
from typing import Any, Protocol

from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import Rollout, RolloutRequest, RolloutSpec, VerifyRequest
from scheduler.checker_watch import CheckerWatch
from scheduler.checks import Cheated, open_rollout, open_verdict
from scheduler.config import DispatchConfig
from scheduler.evidence_watch import EvidenceWatch
from scheduler.jobs import Failure, Generated, Job, JobTable, Judged, Release, Released, Saturated
from scheduler.ledger import WeightsLedger
from scheduler.metrics import SchedulerMetrics
from scheduler.node_calls import NodeFailed, NodeRefused, Reservation
from scheduler.node_record import NodeRecord
from scheduler.pool import SignedPool
from scheduler.registry import Registry
from scheduler.results import AlreadyReleased
from scheduler.sanctions import Sanctions
from scheduler.spot_checks import SpotChecks
from scheduler.store import Store
from scheduler.verification import (
    ASK_ORDER,
    REJECTED_HONEST,
    Decision,
    Role,
    VerdictKind,
    next_step,
)

__all__ = ["Dispatcher", "NodeCaller", "Saturated"]

log = logging.getLogger("prime.scheduler.dispatch")
REFUSALS_BEFORE_FAILING = 2
GENERATE_ROUTE = "/v1/rollouts"
VERIFY_ROUTE = "/v1/verify"


class NodeCaller(Protocol):
    """The node-call layer the loop uses (`scheduler.node_calls.NodeCalls`)."""

    def reserve(self, node: NodeRecord, tokens: int) -> Reservation: ...

    async def post(
        self,
        node: NodeRecord,
        route: str,
        body: bytes,
        timeout_s: float,
        reservation: Reservation | None = None,
    ) -> bytes: ...

    def gone(self, node: NodeRecord, why: str = "") -> None: ...

    def refused_what_others_serve(self, node: NodeRecord) -> None: ...


class Dispatcher:
    def __init__(
        self,
        pool: SignedPool,
        identity: Identity,
        registry: Registry,
        store: Store,
        calls: NodeCaller,
        cfg: DispatchConfig,
        metrics: SchedulerMetrics,
        ledger: WeightsLedger | None = None,
        rng: random.Random | None = None,
    ):
        self.pool = pool
        self.identity = identity
        self.registry = registry
        self.store = store
        self.calls = calls
        self.cfg = cfg
        self.metrics = metrics
        # What the trainer published: each rollout's weights claim is checked against it.
        self.ledger = ledger or WeightsLedger()
        # Spot-check and audit draws. Who verifies is what a generator must not predict
        # (`Registry.pick_verifier` uses the OS's randomness); these only need to be fair.
        self.rng = rng or random.Random()
        self.spot = SpotChecks(pool.config.verification, self.rng)
        self.jobs = JobTable(cfg.max_queued)
        watch = CheckerWatch(pool.config.checkers) if registry.earn_after else None
        self.sanctions = Sanctions(registry, store, metrics, calls.gone, watch)
        self.evidence = EvidenceWatch(
            pool.config.verification.evidence, registry, self.judge, self.sanctions.ban
        )
        # Request id -> the OpenAI front waiting for that job's release.
        self.waiters: dict[str, asyncio.Future[Released]] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None

    # -- the public surface (server, OpenAI front, evidence watch) ----------------------
    async def start(self) -> None:
        """Recover open requests (restart, takeover) and start the loop."""
        recovered = await self.store.open_jobs()
        for job in recovered:
            if job.source == "dispatch":
                self.jobs.admit([job])
            else:
                self.jobs[job.request_id] = job
                self._spawn(job, self._release(Failure(job, "scheduler restarted mid-call")))
        if recovered:
            log.info("recovered %d open requests after a restart", len(recovered))
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

    def kick(self) -> None:
        """Capacity or nodes changed: look at the queue again."""
        self._wake.set()

    def node_gone(self, node: NodeRecord, why: str = "") -> None:
        """`node` died, left, was banned or registered again (it restarted): its calls in
        flight fail at once and their jobs go elsewhere."""
        self.calls.gone(node, why)

    @property
    def queued(self) -> int:
        return self.jobs.queued

    @property
    def open_requests(self) -> int:
        return len(self.jobs)

    def status(self) -> dict[str, Any]:
        """Totals (with queued and in-flight requests) and recent verdicts, for the dashboard."""
        totals: dict[str, int] = dict(self.store.totals)
        totals["queued"] = self.queued
        totals["in_flight"] = self.open_requests - self.queued
        return {"totals": totals, "recent_verdicts": list(self.store.recent_verdicts)}

    async def results_after(self, cursor: int, limit: int, wait_s: float) -> list:
        """Released results with seq > cursor (long-polls up to `wait_s` when none)."""
        return await self.store.results_after(cursor, limit, wait_s)

    async def judge(
        self,
        kind: VerdictKind,
        rollout: Rollout,
        raw: bytes,
        request: RolloutRequest,
        exclude: list[NodeRecord],
        wait_s: float | None = None,
    ) -> Judged | None:
        """A verdict from an eligible node, retrying others on failure; None on timeout."""
        body = seal(
            self.identity,
            VerifyRequest(
                rollout_envelope=raw, expected_weights_hash=rollout.weights_hash, request=request
            ),
        )
        deadline = time.monotonic() + (self.cfg.verifier_wait_s if wait_s is None else wait_s)
        tried: set[str] = set()
        while time.monotonic() < deadline:
            checkers = [n for n in exclude if n.node_id != rollout.node_id]
            node = self.registry.pick_verifier(rollout.weights_hash, exclude, tried, checkers)
            if node is None:
                await asyncio.sleep(0.2)
                continue
            try:
                envelope = await self.calls.post(
                    node, VERIFY_ROUTE, body, self.cfg.verify_timeout_s
                )
                v = open_verdict(envelope, node, rollout)
            except NodeFailed as exc:
                log.info("verifier %s failed: %s", node.label, exc)
                tried.add(node.node_id)
                continue
            finally:
                self.kick()  # its capacity is free again
            gen = self.registry.get(rollout.node_id)
            self.store.record_verdict(kind, rollout, raw, node, gen, v, envelope)
            self.metrics.observe_verdict(v.accepted)
            if kind != "evidence":
                self.evidence.observe(rollout, raw, request, node, v)
            return Judged(node, v, envelope)
        return None

    # -- admission -------------------------------------------------------------------
    async def _admit(self, jobs: list[Job]) -> list[Job]:
        """Queue `jobs` (dispatch starts at once) and store them durably; returns the ones
        stored (those whose ids the database knew are withdrawn)."""
        self.jobs.admit(jobs)
        self.kick()
        try:
            known = await self.store.known([j.request_id for j in jobs])
            new = []
            for job in jobs:
                if job.request_id in known:
                    self.jobs.withdraw(job)
                else:
                    new.append(job)
            await self.store.write_requests(new)
        except BaseException:
            for job in jobs:
                self.jobs.withdraw(job)
            raise
        self.metrics.requests_submitted_total.inc(len(new))
        self.metrics.queue_depth.set(self.queued)
        return new

    # -- the loop --------------------------------------------------------------------
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

    async def _dispatch_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._dispatch_ready()

    def _dispatch_ready(self) -> None:
        waiting: deque[Job] = deque()
        scanned = 0
        while (job := self.jobs.next_open()) is not None:
            node = self.registry.pick_generator(job.spec.min_version, job.tried, job.refused_by)
            if node is None and self._unservable(job):
                continue
            if node is None:
                waiting.append(job)
                scanned += 1
                # Without any free node, nothing further down the queue can go either.
                if scanned >= 256 or self.registry.pick_generator(0) is None:
                    break
                continue
            # Reserved now: the next pick in this loop must see this node's new load.
            self._spawn(job, self._run_job(job, self.calls.reserve(node, job.est_tokens)))
        self.jobs.put_back(waiting)
        self.metrics.queue_depth.set(self.queued)

    def _unservable(self, job: Job) -> bool:
        """A client's call (source "openai") that no healthy node can take now is released
        as failed at once (its client gets 503 and Retry-After) instead of waiting out
        `openai_timeout_s`; the orchestrator's requests wait for nodes (they are durable)."""
        if job.source != "openai" or self.registry.able(job.spec.min_version, job.refused_by):
            return False
        why = f"no healthy node holds weights version >= {job.spec.min_version} now"
        self._spawn(job, self._release(Failure(job, why)))
        return True

    def _requeue(self, job: Job, why: str) -> None:
        if not self.jobs.is_open(job):
            return
        if job.attempts >= self.cfg.max_attempts:
            why = f"gave up after {job.attempts} attempts: {why}"
            self._spawn(job, self._release(Failure(job, why)))
            return
        if self._unservable(job):
            return
        log.info("re-dispatching %s: %s", job.request_id, why)
        self.metrics.dispatch_retries_total.inc()
        self.jobs.requeue(job)
        self.kick()

    def _elsewhere(self, job: Job, gen: NodeRecord, why: str) -> None:
        """Queue `job` again for another generator than `gen`."""
        job.tried.add(gen.node_id)
        self._requeue(job, why)

    # -- one job ---------------------------------------------------------------------
    async def _run_job(self, job: Job, slot: Reservation) -> None:
        gen = slot.node
        job.attempts += 1
        self.metrics.dispatch_latency_seconds.observe(time.monotonic() - job.queued_at)
        request = job.request(self.pool.config.pool_id, self.pool.config.verification.proof)
        body = seal(self.identity, request)
        try:
            raw = await self.calls.post(
                gen, GENERATE_ROUTE, body, self.cfg.generate_timeout_s, slot
            )
            rollout = open_rollout(raw, gen, request, self.ledger)
        except NodeRefused as exc:
            job.refusals.append(str(exc))
            job.refused_by.add(gen.node_id)
            if len(job.refusals) >= REFUSALS_BEFORE_FAILING or not self.registry.able(
                job.spec.min_version, besides=job.refused_by
            ):
                why = f"refused by {len(job.refusals)} node(s): " + "; ".join(job.refusals)
                self._spawn(job, self._release(Failure(job, why, refused=True)))
            else:
                self._elsewhere(job, gen, str(exc))
            return
        except NodeFailed as exc:
            self._elsewhere(job, gen, str(exc))
            return
        except Cheated as exc:
            self.sanctions.punish(gen, f"signed a rollout that contradicts its request: {exc}")
            self._elsewhere(job, gen, f"{gen.label} cheated: {exc}")
            return
        finally:
            self.kick()  # its capacity is free again
        self.store.record_generation(gen, rollout)
        for node_id in job.refused_by:  # they refused what a node serves: not the request
            if (refuser := self.registry.get(node_id)) is not None:
                self.calls.refused_what_others_serve(refuser)
        job.tried |= job.refused_by
        job.refused_by.clear()
        if not self.jobs.is_open(job):  # withdrawn (a resubmitted id) meanwhile
            return
        gen.unsettled += 1
        try:
            await self._verify(job, Generated(gen, rollout, raw), request)
        finally:
            gen.unsettled -= 1
            self.kick()

    async def _verify(self, job: Job, made: Generated, request: RolloutRequest) -> None:
        """Run the verification protocol (`next_step` decides) over real nodes, then apply
        its decision; or, when the spot check skips this rollout, release it unverified."""
        gen = made.gen
        ticket = self.spot.arrived(gen)
        if self.spot.skip(gen):
            gen.unsettled -= 1  # held, not worked on: it takes none of the node's slots
            try:
                release = await self.spot.hold(gen, ticket)
            finally:
                gen.unsettled += 1
            if release:
                await self._release(Release(job, made, detail="unverified (spot check)"))
                return
            if gen.state == "banned":  # what a ban must drop: nothing of it is verified
                self._elsewhere(job, gen, f"{gen.label} was banned")
                return
        self.spot.started(gen, ticket)
        try:
            await self._check(job, made, request, ticket)
        finally:
            self.spot.ended(gen, ticket)

    async def _check(self, job: Job, made: Generated, request: RolloutRequest, ticket: int) -> None:
        """The verification protocol over real nodes, and its decision applied."""
        gen = made.gen
        audited = self.rng.random() < self.pool.config.verification.audit_rate
        nodes: dict[Role, NodeRecord] = {"generator": gen}
        judged: list[Judged] = []
        while True:
            step = next_step(audited, tuple(j.verdict.accepted for j in judged))
            if isinstance(step, Decision):
                break
            if step.opens_dispute:
                self.store.count("disputes")
            if step.unless_banned and gen.state == "banned":
                self._elsewhere(job, gen, f"{gen.label} is banned")
                return
            exclude = [nodes[r] for r in step.exclude]
            answer = await self.judge(step.kind, made.rollout, made.raw, request, exclude)
            if answer is None:
                self._elsewhere(job, gen, step.if_none)
                return
            nodes[step.role] = answer.node
            judged.append(answer)
            # A recent checker's word is never enough alone: an established one audits it.
            audited = audited or self.registry.is_recent(answer.node, time.time())
        self._apply(step, nodes)
        self.spot.checked(gen, ticket, step.released)
        if step.released:
            await self._release(Release(job, made, tuple(j.envelope for j in judged)))
        else:
            self._elsewhere(job, gen, step.requeue_reason.format(generator=gen.label))

    def _apply(self, decision: Decision, nodes: dict[Role, NodeRecord]) -> None:
        """Rewards and punishments of a decision (and the dispute metric)."""
        for role in decision.rewards:
            self.sanctions.reward(nodes[role])
        outvoted = {role for role, _ in decision.punish}
        for role in ASK_ORDER:
            if role in nodes:
                self.sanctions.checked(nodes[role], role in outvoted)
        for role, why in decision.punish:
            overturned = why == REJECTED_HONEST
            # A checker's loss names whose rollout it was about: an operator (or an audit)
            # tells a borderline cheat's rollout from an honest one it misjudged.
            about = "" if role == "generator" else f" (a rollout of {nodes['generator'].label})"
            self.sanctions.punish(nodes[role], why + about, overturned)
            if overturned:
                self.sanctions.overturned_about(nodes["generator"], nodes[role])
        if decision.lost_by:
            self.metrics.observe_dispute(decision.lost_by)

    # -- release ---------------------------------------------------------------------
    async def _release(self, out: Release | Failure) -> None:
        job = out.job
        if isinstance(out, Release):
            gen = out.generated.gen
            await self.evidence.settled(gen)  # a flagged node's releases wait for its recheck
            if gen.state == "banned":  # banned meanwhile: release nothing of it
                self._elsewhere(job, gen, f"{gen.label} was banned")
                return
        if not self.jobs.withdraw(job):
            return
        try:
            row, released = await self.store.release(out)
        except AlreadyReleased:
            log.warning("%s was released before; not again", job.request_id)
            return
        except Exception as exc:  # noqa: BLE001 - the job must not be lost
            log.error("could not store the result of %s (%s); will retry", job.request_id, exc)
            self.jobs[job.request_id] = job
            await asyncio.sleep(1.0)
            self._requeue(job, "result write failed")
            return
        if isinstance(out, Release) and out.verdicts:  # checkers accepted it (not a spot check)
            self.sanctions.earned(out.generated.gen)
        self.metrics.observe_release(row["status"], job.submitted_at, row["released_at"])
        waiter = self.waiters.get(job.request_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(released)
