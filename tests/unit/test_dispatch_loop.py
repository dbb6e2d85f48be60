"""The dispatch loop (`scheduler.dispatch.Dispatcher`) driven over a FAKE node-call layer:
scripted nodes answer the loop's calls with real signed rollouts and verdicts, and the
store (SQLite), registry, lifecycle, evidence watch and verification protocol are the
real ones. Nothing here replaces a method of the dispatcher.

What is checked here: under every spot-check rate (0, 0.5, 1; the draws seeded), an
honest node's rollouts are released, and nothing of a node that is banned, or flagged by
per-node evidence, is released before its settlement (a flagged node's releases wait for
the fresh recheck; a banned node's are generated again elsewhere); audits and disputes
(which verdicts are asked, who loses reputation, what is released with which verdicts)
on both paths (orchestrator and OpenAI front); refunds to verifiers overturned about a
generator banned later. The fake stands in only for `scheduler.node_calls.NodeCalls`
(the channel, timeouts and call accounting); `test_dispatch_node_calls.py` runs that layer
for real over a node's channel.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack
import pytest

from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from protocol.messages import (
    CheckerPolicy,
    CheckResult,
    EvidencePolicy,
    PoolConfig,
    ReputationPolicy,
    Rollout,
    RolloutRequest,
    RolloutSpec,
    SamplingParams,
    SpotCheckPolicy,
    Verdict,
    VerificationPolicy,
    VerifyRequest,
)
from scheduler import db
from scheduler.config import DispatchConfig
from scheduler.dispatch import Dispatcher
from scheduler.ledger import WeightsLedger
from scheduler.metrics import SchedulerMetrics
from scheduler.node_calls import NodeFailed, NodeRefused, Reservation
from scheduler.pool import open_pool, sign_pool
from scheduler.registry import NodeRecord, Registry
from scheduler.store import Store
from tests.pools import node_record

pytestmark = pytest.mark.timeout(60)
HONEST, CHEAT, DRIFTER, REFUSER = "honest", "cheat", "drifter", "refuser"
# A free identity that fails every generation (503) and rejects every rollout it verifies.
SYBIL = "sybil"
# An honest generator that, as a checker, rejects every tenth rollout it verifies.
PICKY = "picky"
# Honest until it earned the right to check (TURN_AFTER accepted rollouts), then a checker
# that rejects everything.
TURNCOAT, TURN_AFTER = "turncoat", 4
# An honest generator that accepts every rollout it checks (it vouches for a cheat).
ACCEPTOR = "acceptor"
LOST = 0.75  # the reputation of a node that lost one dispute (default policy: 1 - 0.25)
OVERTURNED = 0.7  # of a verifier whose rejection was overturned once (1 - 0.25 * 1.2)
JOBS = 12
# One systematic excess flags a node at once, and fresh rechecks confirm it (the evidence
# model: honest scores sit at 0 with a spread of 0.01; a drifter's at 1.0).
EVIDENCE = EvidencePolicy(mu=0.0, between=0.01, token=0.0, false_flag_rate=0.5, horizon=1)


@dataclass
class FakeNode:
    identity: Identity
    record: NodeRecord
    kind: str
    held: list[asyncio.Future] = field(default_factory=list)  # generations not answered yet
    hold: bool = False  # hold its generations until `answer` (they arrive all at once)


class FakeNodeCalls:
    """FAKE node-call layer (`scheduler.node_calls.NodeCalls`' interface): scripted nodes.

    An honest node generates what it is asked and verifies truthfully; a cheat's rollouts
    fail verification, and the first it answers contradicts its request (a wrong seed, which
    the scheduler's own check catches even unverified); a drifter's rollouts pass every
    check but sign an error score far above honest noise (what per-node evidence sees).
    Generations of a node marked `hold` wait until `answer(node)`; verdicts about a
    generator in `verdicts_held` wait until `answer_verdicts(generator)`. `gone` fails the
    calls to a node whose answer has not arrived, as the real layer does on a node's death;
    an answer that arrived stays (the loop must not release it if the node is banned)."""

    def __init__(self, nodes: dict[str, FakeNode]):
        self.nodes = nodes
        self.verdicts_held: dict[str, list[asyncio.Future]] = {}
        self.gone_ids: set[str] = set()
        self.asked: Counter[tuple[str, str]] = Counter()  # (node id, request id) generations
        self.disproved: Counter[str] = Counter()  # refusals reported as disproved, per node
        self.verified_by: Counter[str] = Counter()  # verdicts given, per node id
        self.generated: Counter[str] = Counter()  # generations answered, per node id
        # Verdicts to give, in the order asked, whoever is asked (then truthful ones).
        self.script: list[bool] | None = None

    # -- the interface the loop uses -----------------------------------------------------
    def reserve(self, node: NodeRecord, tokens: int) -> Reservation:
        node.in_flight += 1  # the fake keeps the load the real layer keeps, for balancing
        node.outstanding_tokens += tokens
        return Reservation(node, tokens)

    async def post(
        self,
        node: NodeRecord,
        route: str,
        body: bytes,
        timeout_s: float,
        reservation: Reservation | None = None,
    ) -> bytes:
        reservation = reservation or self.reserve(node, 0)
        try:
            if node.node_id in self.gone_ids:
                raise NodeFailed(f"{node.label} is gone")
            me = self.nodes[node.node_id]
            if route == "/v1/rollouts":
                request_id = open_envelope(body, RolloutRequest).message.request_id
                self.asked[node.node_id, request_id] += 1
                if me.kind == REFUSER:
                    raise NodeRefused(f"{node.label} refused /v1/rollouts: too long for it")
                if me.kind == SYBIL:
                    raise NodeFailed(f"{node.label} failed /v1/rollouts: 503")
                answer = self.rollout_for(me, open_envelope(body, RolloutRequest).message)
                if me.hold:
                    return await self._wait(me.held, answer)
                self.generated[node.node_id] += 1
                return answer
            ask = open_envelope(body, VerifyRequest).message
            rollout = open_envelope(ask.rollout_envelope, Rollout, check_expiry=False).message
            answer = self.verdict_for(me, rollout)
            if rollout.node_id in self.verdicts_held:
                return await self._wait(self.verdicts_held[rollout.node_id], answer)
            return answer
        finally:
            node.in_flight -= 1
            node.outstanding_tokens -= reservation.tokens

    def refused_what_others_serve(self, node: NodeRecord) -> None:
        self.disproved[node.node_id] += 1

    def gone(self, node: NodeRecord, why: str = "") -> None:
        self.gone_ids.add(node.node_id)
        for fut in self.nodes[node.node_id].held:
            if not fut.done():
                fut.set_exception(NodeFailed(f"{node.label} died: {why}"))

    # -- what the test drives --------------------------------------------------------------
    def answer(self, node_id: str) -> int:
        """Every held generation of `node_id` is answered now, in one go; returns how many."""
        me = self.nodes[node_id]
        me.hold = False
        held, me.held = me.held, []
        for fut in held:
            fut.set_result(fut.answer)  # type: ignore[attr-defined]
            self.generated[node_id] += 1
        return len(held)

    def answer_verdicts(self, generator_id: str) -> None:
        for fut in self.verdicts_held.pop(generator_id, []):
            if not fut.done():
                fut.set_result(fut.answer)  # type: ignore[attr-defined]

    # -- scripted answers ------------------------------------------------------------------
    async def _wait(self, queue: list[asyncio.Future], answer: bytes) -> bytes:
        fut = asyncio.get_running_loop().create_future()
        fut.answer = answer  # type: ignore[attr-defined]
        queue.append(fut)
        return await fut

    def rollout_for(self, me: FakeNode, request: RolloutRequest) -> bytes:
        lie = me.kind == CHEAT and self.generated[me.record.node_id] + len(me.held) == 0
        rollout = Rollout(
            request_id=request.request_id,
            pool_id=request.pool_id,
            node_id=me.record.node_id,
            prompt_ids=request.prompt_ids,
            completion_ids=[5, 6],
            logprobs=[-0.5, -0.25],
            finish_reason="length",
            sampling=request.sampling,
            seed=request.seed + 1 if lie else request.seed,
            weights_version=me.record.weights_version,
            weights_hash=me.record.weights_hash,
            proof_params=request.proof,
            proof=[b"proof"],
        )
        return seal(me.identity, rollout)

    def verdict_for(self, me: FakeNode, rollout: Rollout) -> bytes:
        generator = self.nodes[rollout.node_id].kind
        score = 1.0 if generator == DRIFTER else 0.0
        self.verified_by[me.record.node_id] += 1
        accepted = self.script.pop(0) if self.script else generator != CHEAT
        accepted = accepted and me.kind != SYBIL
        if me.kind == PICKY and self.verified_by[me.record.node_id] % 10 == 0:
            accepted = False
        if me.kind == TURNCOAT and me.record.earned >= TURN_AFTER:
            accepted = False
        if me.kind == ACCEPTOR:
            accepted = True
        verdict = Verdict(
            request_id=rollout.request_id,
            rollout_digest=rollout.digest(),
            generator_id=rollout.node_id,
            verifier_id=me.record.node_id,
            weights_hash=me.record.weights_hash,
            accepted=accepted,
            checks=[
                CheckResult(
                    name="logprobs",
                    passed=accepted,
                    metrics={"clipped_mean_abs_diff": score, "tokens": 2.0},
                )
            ],
        )
        return seal(me.identity, verdict)


@dataclass
class Pool:
    dispatcher: Dispatcher
    calls: FakeNodeCalls
    nodes: dict[str, FakeNode]
    store: Store
    close: Callable

    def id_of(self, i: int) -> str:
        return list(self.nodes)[i]

    async def results(self) -> list:
        return list(await self.dispatcher.results_after(0, 10_000, 0))


async def make_pool(
    tmp_path,
    kinds: list[str],
    spot_check_rate: float = 1.0,
    seed: int = 7,
    audit_rate: float = 0.0,
    reputation: ReputationPolicy | None = None,
    records: list[dict] | None = None,
    verifier_wait_s: float = 10.0,
    max_attempts: int = 5,
    earn_after: int = 0,
    founders: int = 0,
    watch: dict | None = None,
    spot_checks: SpotCheckPolicy | None = None,
) -> Pool:
    """A started dispatcher over fake nodes of `kinds` (`records`: per-node record fields);
    with `earn_after`, the first `founders` nodes check from the start, the others earn it."""
    identities = [Identity.generate() for _ in kinds]
    config = PoolConfig(
        pool_id="p",
        model="tiny",
        trainer_public_key=Identity.generate().public_key,
        verification=VerificationPolicy(
            spot_check_rate=spot_check_rate,
            audit_rate=audit_rate,
            evidence=EVIDENCE,
            spot_checks=spot_checks,
        ),
        reputation=reputation or ReputationPolicy(),
        checkers=CheckerPolicy(
            earn_after=earn_after,
            founders=[i.node_id for i in identities[:founders]],
            **(watch or {}),
        ),
    )
    pool = open_pool(sign_pool(Identity.generate(), config))
    url = f"sqlite+aiosqlite:///{tmp_path / 'd.db'}"
    engine = db.create_engine(url)
    await db.migrate(engine, url)
    writer = db.Writer(engine, 0.005)
    writer.start()
    registry = Registry(config.reputation, 0, config.checkers, config.founding_checkers())
    nodes: dict[str, FakeNode] = {}
    for i, (kind, ident) in enumerate(zip(kinds, identities, strict=True)):
        fields = records[i] if records else {}
        rec = node_record(i, node_id=ident.node_id, public_key=ident.public_key, **fields)
        registry.add(rec)
        nodes[rec.node_id] = FakeNode(ident, rec, kind)
    calls = FakeNodeCalls(nodes)
    ledger = WeightsLedger()
    ledger.note(3, "h")  # the nodes' weights (`tests.pools.node_record`) were published
    store = Store(engine, writer, "p")
    dispatcher = Dispatcher(
        pool,
        Identity.generate(),
        registry,
        store,
        calls,
        DispatchConfig(verifier_wait_s=verifier_wait_s, max_attempts=max_attempts),
        SchedulerMetrics(),
        ledger,
        rng=random.Random(seed),
    )
    await dispatcher.start()

    async def close() -> None:
        await dispatcher.stop()
        await writer.stop()
        await engine.dispose()

    return Pool(dispatcher, calls, nodes, store, close)


async def until(cond: Callable[[], object], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


def released(d) -> int:
    """Results written so far (a job leaves `open_requests` just before its result is)."""
    totals = d.status()["totals"]
    return totals["accepted"] + totals["failed"]


def specs(n: int = JOBS, min_version: int = 0, first: int = 0) -> list[RolloutSpec]:
    return [
        RolloutSpec(
            request_id=f"r{i}",
            prompt_ids=[1, 2 + i],
            sampling=SamplingParams(),
            min_version=min_version,
        )
        for i in range(first, first + n)
    ]


async def released_by(pool: Pool) -> Counter[str]:
    return Counter(r.generator_id for r in await pool.results())


# How long a wrong release has to show once everything else settled: a correct loop passes
# whatever this is; a loop with the hole releases within a few event-loop turns.
GRACE_S = 0.3


@pytest.mark.parametrize("rate", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("suspect", [HONEST, CHEAT, DRIFTER])
async def test_nothing_of_a_banned_or_flagged_node_is_released_before_its_settlement(
    tmp_path, rate, suspect
):
    """Three honest nodes and a suspect (the last node). The suspect's generations are held
    until the honest nodes' rollouts are released, then answered at once. A cheat's first
    answer contradicts its request: it is banned before the loop looks at its others,
    which must not be released at any rate (they are generated again by honest nodes). A
    drifter is flagged by per-node evidence before its answers arrive: its releases wait
    for the fresh recheck (held here), which bans it; nothing of it is released."""
    # One lost dispute (or one contradiction) bans: the cheat is out on its first lie.
    ban_at_once = ReputationPolicy(penalty_lost_dispute=1.0, ban_below=0.5)
    pool = await make_pool(
        tmp_path, [HONEST, HONEST, HONEST, suspect], rate, reputation=ban_at_once
    )
    try:
        d, calls = pool.dispatcher, pool.calls
        sid = pool.id_of(3)
        suspect_node = pool.nodes[sid]
        suspect_node.hold = True
        if suspect == DRIFTER:
            calls.verdicts_held[sid] = []  # its recheck (and any verdict about it) waits
        await d.submit(specs())
        await until(lambda: len(suspect_node.held) == JOBS // 4)  # spread evenly by load
        held = len(suspect_node.held)
        await until(lambda: d.status()["totals"]["accepted"] == JOBS - held)
        if suspect == DRIFTER:
            _flag(pool, sid)
        assert calls.answer(sid) == held
        await asyncio.sleep(GRACE_S)
        before_settlement = await released_by(pool)
        if suspect != HONEST:
            assert before_settlement[sid] == 0, f"released before its settlement at rate {rate}"
        if suspect == DRIFTER:
            assert pool.nodes[sid].record.state == "healthy"  # flagged, not yet banned
            calls.answer_verdicts(sid)  # the fresh recheck confirms: banned
        await until(lambda: d.status()["totals"]["accepted"] == JOBS)
        await asyncio.sleep(GRACE_S)
        results = await pool.results()
        assert sorted(r.request_id for r in results) == sorted(s.request_id for s in specs())
        assert all(r.status == "accepted" for r in results)
        unverified = sum(r.detail == "unverified (spot check)" for r in results)
        assert {0.0: unverified == JOBS, 1.0: unverified == 0}.get(rate, 0 < unverified < JOBS)
        by = Counter(r.generator_id for r in results)
        for i in range(3):  # every honest node's rollouts are released
            assert by[pool.id_of(i)] >= 1
        if suspect == HONEST:
            assert by[sid] == held
        else:
            assert pool.nodes[sid].record.state == "banned"
            assert by[sid] == 0, f"a {suspect}'s rollouts were released at rate {rate}"
    finally:
        await pool.close()


def _flag(pool: Pool, sid: str) -> None:
    """Per-node evidence flags the suspect: a verdict with an error score far above honest
    noise about one of its rollouts (what a verifier of an earlier rollout signs)."""
    me, judge = pool.nodes[sid], next(iter(pool.nodes.values()))
    request = RolloutRequest(request_id="earlier", pool_id="p", prompt_ids=[1], seed=3)
    raw = pool.calls.rollout_for(me, request)
    rollout = open_envelope(raw, Rollout, check_expiry=False).message
    verdict = open_envelope(pool.calls.verdict_for(judge, rollout), Verdict).message
    pool.dispatcher.evidence.observe(rollout, raw, request, judge.record, verdict)
    assert sid in pool.dispatcher.evidence.rechecking


# -- audits and disputes ----------------------------------------------------------------
# A generator (weights v3) and verifiers that cannot generate (v2, the same weights hash:
# they verify v3's rollouts), so one job meets the scripted verdicts in order.
GEN_AND_VERIFIERS = [{}, *({"weights_version": 2} for _ in range(4))]
# (audit rate, verdicts in the order asked, kinds asked, verdicts released with the rollout
# (None: not released; with one attempt allowed, the request fails), who loses a dispute
# and the reputation it is left with: an overturned rejection costs more than a bad rollout).
AUDITS = [
    (0.0, [True], ["verify"], 1, {}),
    (0.0, [False, True], ["verify", "dispute"], 2, {"first": OVERTURNED}),
    (0.0, [False, False], ["verify", "dispute"], None, {"generator": LOST}),
    # An accepting verdict is audited; two that disagree are settled by a third.
    (1.0, [True, True], ["verify", "audit"], 2, {}),
    (1.0, [True, False, True], ["verify", "audit", "dispute"], 3, {"second": OVERTURNED}),
    # A verifier that accepted a rollout two others rejected loses like its generator.
    (
        1.0,
        [True, False, False],
        ["verify", "audit", "dispute"],
        None,
        {"generator": LOST, "first": LOST},
    ),
    # An overturned rejection is audited too.
    (1.0, [False, True, True], ["verify", "dispute", "audit"], 3, {"first": OVERTURNED}),
    (
        1.0,
        [False, True, False],
        ["verify", "dispute", "audit"],
        None,
        {"generator": LOST, "second": LOST},
    ),
]


@pytest.mark.parametrize(("audit_rate", "script", "kinds", "released", "losers"), AUDITS)
async def test_audits_and_disputes(tmp_path, audit_rate, script, kinds, released, losers):
    pool = await make_pool(
        tmp_path, [HONEST] * 5, audit_rate=audit_rate, records=GEN_AND_VERIFIERS, max_attempts=1
    )
    try:
        d, gen_id = pool.dispatcher, pool.id_of(0)
        pool.calls.script = list(script)
        await d.submit(specs(1, min_version=3))
        await until(lambda: not pool.calls.script and not d.open_requests)
        await asyncio.sleep(GRACE_S)
        asked = list(reversed(d.status()["recent_verdicts"]))
        assert [v["kind"] for v in asked] == kinds
        roles = {  # verifiers by the order asked (fewer than three when none disagreed)
            "generator": gen_id,
            **dict(
                zip(("first", "second", "third"), [v["verifier_id"] for v in asked], strict=False)
            ),
        }
        for role, node_id in roles.items():
            want = losers.get(role, 1.0)
            assert pool.nodes[node_id].record.reputation == want, role
        (result,) = await pool.results()
        assert pool.calls.generated[gen_id] == 1
        if released is None:  # not released: generated again (here: no attempt left)
            assert result.status == "failed" and result.generator_id == ""
            assert result.detail.startswith("gave up after 1 attempts: rollout from")
        else:
            assert result.status == "accepted" and result.generator_id == gen_id
            assert len(msgpack.unpackb(result.verdict_envelopes)) == released
    finally:
        await pool.close()


async def test_the_openai_front_takes_the_same_path(tmp_path):
    """A client's call: its rollout rejected by two of three verifiers is generated again
    by another generator, and the call answers with that one, audited."""
    records = [{}, {}, *({"weights_version": 2} for _ in range(4))]
    pool = await make_pool(tmp_path, [HONEST] * 6, audit_rate=1.0, records=records)
    try:
        pool.calls.script = [True, False, False, True, True]
        (answer,) = await pool.dispatcher.call(specs(1, min_version=3), timeout_s=20)
        asked = [v["kind"] for v in reversed(pool.dispatcher.status()["recent_verdicts"])]
        assert asked == ["verify", "audit", "dispute", "verify", "audit"]
        assert answer.status == "accepted" and answer.rollout is not None
        generated = pool.calls.generated
        assert sorted(generated.values()) == [1, 1]  # generated twice, by two nodes
        assert generated[answer.rollout.node_id] == 1
    finally:
        await pool.close()


async def test_a_verifier_overturned_about_a_node_banned_later_gets_its_reputation_back(tmp_path):
    """An honest verifier rejects a borderline cheat's rollout and the judge accepts it: the
    verifier loses the dispute. When that generator is banned later (evidence, disputes),
    the verifier was right and its reputation comes back; about an honest generator it
    does not."""
    waiting = {"state": "registered"}  # not healthy yet: no work until it heartbeats
    records = [
        {},
        waiting,
        *({"weights_version": 2} | (waiting if i >= 2 else {}) for i in range(4)),
    ]
    pool = await make_pool(tmp_path, [HONEST] * 6, records=records)
    try:
        d, reg = pool.dispatcher, pool.dispatcher.registry
        cheat, honest = pool.nodes[pool.id_of(0)].record, pool.nodes[pool.id_of(1)].record
        pool.calls.script = [False, True]
        await d.submit(specs(1, min_version=3))
        await until(lambda: d.status()["totals"]["accepted"] == 1)
        first = pool.nodes[d.status()["recent_verdicts"][-1]["verifier_id"]].record
        assert first.reputation == OVERTURNED
        # The next job goes to the other generator, checked by the other verifiers.
        for i in (0, 2, 3):
            reg.channel_closed(pool.nodes[pool.id_of(i)].record)
        for i in (1, 4, 5):
            reg.seen(pool.nodes[pool.id_of(i)].record)
        pool.calls.script = [False, True]
        await d.submit(specs(1, min_version=3, first=1))
        await until(lambda: d.status()["totals"]["accepted"] == 2)
        wrong = pool.nodes[d.status()["recent_verdicts"][1]["verifier_id"]].record
        assert wrong is not first and wrong.reputation == OVERTURNED
        assert {r.generator_id for r in await pool.results()} == {cheat.node_id, honest.node_id}
        d.sanctions.ban(cheat, "per-node evidence: confirmed")
        assert first.reputation == 1.0
        assert wrong.reputation == OVERTURNED  # the node it rejected is not banned
        assert cheat.state == "banned" and cheat.node_id not in d.sanctions.overturned
    finally:
        await pool.close()


async def test_a_request_every_node_failed_once_is_generated_again_not_stranded(tmp_path):
    """Two honest nodes and no judge: each rollout a verifier rejects waits for a judge that
    cannot exist and goes to another generator. Once both nodes generated it, the request
    goes back to them (it is still under `max_attempts`) instead of waiting for a node it
    has not met, which may never come; here the third generation is accepted."""
    pool = await make_pool(tmp_path, [HONEST, HONEST], verifier_wait_s=0.3)
    try:
        d = pool.dispatcher
        pool.calls.script = [False, False]  # the first verdict of each of two generations
        await d.submit(specs(1))
        await until(lambda: d.status()["totals"]["accepted"] == 1, timeout_s=10)
        assert sum(pool.calls.generated.values()) == 3
        assert set(pool.calls.generated) == set(pool.nodes)
    finally:
        await pool.close()


async def test_a_refusal_that_another_node_disproves_is_reported_once(tmp_path):
    """A node that refuses every generation (a 4xx, as if each request were invalid): each
    request goes to the honest node, the refuser is never asked for it again, and each of
    its refusals is reported to the node-call layer once another node served that request
    (where a run of them benches it)."""
    pool = await make_pool(tmp_path, [REFUSER, HONEST])
    try:
        d, calls = pool.dispatcher, pool.calls
        refuser, honest = pool.id_of(0), pool.id_of(1)
        await d.submit(specs(6))
        await until(lambda: d.status()["totals"]["accepted"] == 6)
        assert Counter(r.generator_id for r in await pool.results()) == {honest: 6}
        refused = {rid for (nid, rid), n in calls.asked.items() if nid == refuser}
        assert refused and all(calls.asked[refuser, rid] == 1 for rid in refused)
        assert calls.disproved == {refuser: len(refused)}
    finally:
        await pool.close()


async def test_a_call_no_healthy_node_can_take_fails_at_once(tmp_path):
    """A client's call whose generators all drop out while it waits is answered at once (a
    failed release: the front's 503 with Retry-After), not after its timeout."""
    pool = await make_pool(tmp_path, [HONEST, HONEST])
    try:
        d = pool.dispatcher
        for node in pool.nodes.values():
            node.hold = True
        call = asyncio.create_task(d.call(specs(1), timeout_s=30))
        await until(lambda: any(n.held for n in pool.nodes.values()))
        t0 = time.monotonic()
        for node in pool.nodes.values():
            d.registry.channel_closed(node.record)
            d.node_gone(node.record, "its channel closed")
        (released,) = await asyncio.wait_for(call, 5)
        assert time.monotonic() - t0 < 2
        assert released.status == "failed" and "no healthy node" in released.detail
    finally:
        await pool.close()


@pytest.mark.parametrize("earned", [False, True])
async def test_free_identities_that_reject_everything_cannot_ban_honest_nodes(tmp_path, earned):
    """Three honest nodes and four free identities that fail every generation and reject
    every rollout they verify. Where every admitted node checks at once (today's open
    pool), they decide disputes and honest generators lose; where the right to check is
    earned (`CheckerPolicy`: the three are founders), they never check anything, and
    every request is accepted with no honest node losing reputation."""
    kinds = [HONEST] * 3 + [SYBIL] * 4
    rights = {"earn_after": 4, "founders": 3} if earned else {}
    pool = await make_pool(tmp_path, kinds, verifier_wait_s=1.0, **rights)
    try:
        d, calls = pool.dispatcher, pool.calls
        await d.submit(specs(12))
        await until(lambda: released(d) == 12, timeout_s=30)
        honest = [pool.nodes[pool.id_of(i)].record for i in range(3)]
        sybils = [pool.id_of(i) for i in range(3, 7)]
        if not earned:
            assert min(n.reputation for n in honest) < 1.0  # the attack, as found
            return
        assert d.status()["totals"]["accepted"] == 12
        assert [n.reputation for n in honest] == [1.0] * 3
        assert all(calls.verified_by[s] == 0 for s in sybils), calls.verified_by
    finally:
        await pool.close()


async def test_a_newcomer_checks_once_its_own_rollouts_were_accepted(tmp_path):
    """Two founders and an honest newcomer (earn_after 3): the newcomer verifies nothing
    until three of its own rollouts were accepted, then it verifies like the founders."""
    pool = await make_pool(tmp_path, [HONEST] * 3, earn_after=3, founders=2)
    try:
        d, calls = pool.dispatcher, pool.calls
        newcomer = pool.nodes[pool.id_of(2)].record
        sent = 0
        while newcomer.earned < 3:  # rounds of three requests, one for each node
            assert calls.verified_by[newcomer.node_id] == 0 and not d.registry.can_check(newcomer)
            await d.submit(specs(3, first=sent))
            sent += 3
            await until(lambda n=sent: released(d) == n)
            assert sent <= 30
        assert d.registry.can_check(newcomer)
        while calls.verified_by[newcomer.node_id] == 0:  # checkers are drawn at random
            await d.submit(specs(6, first=sent))
            sent += 6
            await until(lambda n=sent: released(d) == n)
            assert sent <= 90, "the newcomer earned its right but was never asked to check"
        assert d.status()["totals"]["accepted"] == sent
    finally:
        await pool.close()


async def test_a_checker_the_others_outvote_too_often_loses_the_right_to_check(tmp_path):
    """Four founders, one of them picky: it rejects one honest rollout in ten it verifies.
    Each rejection is overturned, but its upheld verdicts earn more reputation than the
    overturned ones cost, so reputation alone never bans it; the per-checker test takes
    its right to check away (it still generates), and it earns the right back with
    accepted rollouts of its own. Honest checkers keep theirs and lose nothing."""
    watch = {
        "honest_wrong_rate": 0.01,
        "suspect_wrong_rate": 0.1,
        "false_alarm_rate": 1e-3,
        "reearn_after": 40,
    }
    pool = await make_pool(
        tmp_path,
        [HONEST] * 3 + [PICKY],
        reputation=ReputationPolicy(reward_accepted=0.05),
        earn_after=1,
        founders=4,
        watch=watch,
    )
    try:
        d, calls = pool.dispatcher, pool.calls
        honest = [pool.nodes[pool.id_of(i)].record for i in range(3)]
        picky = pool.nodes[pool.id_of(3)].record
        sent = 0
        while d.registry.can_check(picky):
            await d.submit(specs(20, first=sent))
            sent += 20
            await until(lambda n=sent: released(d) == n)
            assert sent <= 1000, "the picky checker kept its right"
        assert picky.state == "healthy" and picky.reputation > 0.5 and -40 <= picky.earned < 0
        outvoted = calls.verified_by[picky.node_id] // 10
        assert outvoted >= 4  # the alarm needs a run of wrong verdicts, not one
        assert all(d.registry.can_check(n) and n.reputation == 1.0 for n in honest)
        checked = calls.verified_by[picky.node_id]
        while not d.registry.can_check(picky):  # it generates on, and earns the right back
            assert calls.verified_by[picky.node_id] == checked
            await d.submit(specs(8, first=sent))
            sent += 8
            await until(lambda n=sent: released(d) == n)
            assert sent <= 2000
        assert d.status()["totals"]["accepted"] == sent
    finally:
        await pool.close()


@pytest.mark.parametrize("defended", [False, True])
async def test_identities_that_earn_their_rights_and_then_turn_cannot_ban_honest_nodes(
    tmp_path, defended
):
    """Three honest founders and four identities admitted a minute ago that generate
    honestly until they earned the right to check, then reject everything they check.
    Where recent checkers may decide a dispute (`recent_window_s` 0, the control), they
    judge each other's rejections and honest generators lose; where at most one checker
    of a rollout is recent (the default), every rejection of theirs goes to an established
    judge, they are banned for their overturned rejections, and no honest node loses."""
    kinds = [HONEST] * 3 + [TURNCOAT] * 4
    records = [{}] * 3 + [{"registered_at": time.time() - 60}] * 4
    watch = {} if defended else {"recent_window_s": 0.0}
    pool = await make_pool(
        tmp_path,
        kinds,
        records=records,
        reputation=ReputationPolicy(reward_accepted=0.0),  # a lost dispute shows for good
        earn_after=TURN_AFTER,
        founders=3,
        watch=watch,
        verifier_wait_s=2.0,
    )
    try:
        d = pool.dispatcher
        honest = [pool.nodes[pool.id_of(i)].record for i in range(3)]
        turncoats = [pool.nodes[pool.id_of(i)].record for i in range(3, 7)]
        sent = 0

        def honest_lost() -> bool:
            return min(n.reputation for n in honest) < 1.0

        while sent < 140 and not all(t.state == "banned" for t in turncoats):
            await d.submit(specs(14, first=sent))
            sent += 14
            await until(lambda n=sent: released(d) == n or honest_lost(), timeout_s=20)
            if honest_lost():
                break
        assert max(t.earned for t in turncoats) >= TURN_AFTER  # they did turn
        if not defended:
            assert honest_lost()  # the attack
            return
        assert [n.reputation for n in honest] == [1.0] * 3
        assert all(t.state == "banned" for t in turncoats)
        assert d.status()["totals"]["accepted"] == sent
    finally:
        await pool.close()


@pytest.mark.parametrize("defended", [False, True])
async def test_recent_identities_that_accept_everything_cannot_launder_a_cheat(tmp_path, defended):
    """Three honest founders, two identities admitted a minute ago that generate honestly,
    earn the right to check and then accept everything they check, and a cheat that joins
    once they may check. With recent checkers' acceptances taken alone (`recent_window_s`
    0, the control) the cheat's rollouts they verify are released; where a recent
    checker's acceptance is always audited by an established one (the default), nothing
    of the cheat is released and it is banned."""
    kinds = [HONEST] * 3 + [ACCEPTOR] * 2 + [CHEAT]
    recent = {"registered_at": time.time() - 60}
    records = [{}] * 3 + [recent] * 2 + [recent | {"state": "registered"}]
    pool = await make_pool(
        tmp_path,
        kinds,
        records=records,
        reputation=ReputationPolicy(penalty_lost_dispute=0.05),  # the cheat lasts a while
        earn_after=2,
        founders=3,
        watch={} if defended else {"recent_window_s": 0.0},
    )
    try:
        d = pool.dispatcher
        acceptors = [pool.nodes[pool.id_of(i)].record for i in (3, 4)]
        cheat = pool.nodes[pool.id_of(5)].record
        sent = 0
        while not all(d.registry.can_check(a) for a in acceptors):
            await d.submit(specs(10, first=sent))
            sent += 10
            await until(lambda n=sent: released(d) == n)
            assert sent <= 100
        d.registry.seen(cheat)  # it joins now

        async def cheat_released() -> bool:
            return any(r.generator_id == cheat.node_id for r in await pool.results())

        while cheat.state != "banned" and sent < 300:
            await d.submit(specs(10, first=sent))
            sent += 10
            await until(lambda n=sent: released(d) == n, timeout_s=30)
            if not defended and await cheat_released():
                break
        assert pool.calls.generated[cheat.node_id] > 0
        if not defended:
            assert await cheat_released()  # the attack: accomplices vouched for it
            return
        assert not await cheat_released() and cheat.state == "banned"
    finally:
        await pool.close()


# -- per-node spot checks ---------------------------------------------------------------
# Every rollout of a node is checked until 4 were accepted, then half, then a quarter. A
# hold of 30 s: the tail of each round must not wait for it (`until` gives up after 20 s).
SPOT = SpotCheckPolicy(full_until=4, halving=1, floor=0.25, hold_s=30.0)


@pytest.mark.parametrize("hold_s", [30.0, 0.0])
async def test_a_node_that_turns_once_its_checks_are_rare_gets_nothing_trained(tmp_path, hold_s):
    """Per-node spot checks: four nodes earn their way down to a quarter of their rollouts
    checked; then one turns to cheating on every rollout, and a burst of its rollouts
    arrives at once. With the hold, its skipped rollouts wait for its next check, which
    bans it: none is released, and every request is served by the honest nodes. Without
    the hold (the control), the skipped ones are released before the ban. A round's last
    rollouts are not held for `hold_s` when no check of their node is coming: one of
    them is checked at once and vouches for the rest."""
    ban_at_once = ReputationPolicy(penalty_lost_dispute=1.0, ban_below=0.5)
    policy = SPOT.model_copy(update={"hold_s": hold_s})
    pool = await make_pool(
        tmp_path,
        [HONEST] * 4,
        reputation=ban_at_once,
        records=[{"capacity": 16}] * 4,
        spot_checks=policy,
    )
    try:
        d, calls = pool.dispatcher, pool.calls
        sid = pool.id_of(3)
        records = [n.record for n in pool.nodes.values()]
        sent = 0
        while min(d.spot.rate(r) for r in records) > SPOT.floor:
            assert sent < 400, [r.earned for r in records]
            await d.submit(specs(20, first=sent))
            sent += 20
            await until(lambda n=sent: released(d) == n)
        before = await pool.results()
        checked = sum(r.detail != "unverified (spot check)" for r in before)
        assert 4 * SPOT.full_until <= checked < sent  # checked fully first, then not all
        me = pool.nodes[sid]
        me.kind, me.hold = CHEAT, True
        await d.submit(specs(40, first=sent))
        # Its generations are held until everything else of the 40 was released.
        await until(lambda: me.held and released(d) == sent + 40 - len(me.held))
        burst = calls.answer(sid)
        assert burst >= 8, burst
        await until(lambda: released(d) == sent + 40)
        await asyncio.sleep(GRACE_S)
        after = [r for r in await pool.results() if int(r.request_id[1:]) >= sent]
        assert me.record.state == "banned"
        assert all(r.status == "accepted" for r in after)
        from_cheat = sum(r.generator_id == sid for r in after)
        if hold_s:
            assert from_cheat == 0, "a skipped rollout of the cheat was released"
            assert d.spot.held(me.record) == 0
        else:
            assert from_cheat > 0  # the control: what the hold prevents
        for r in records[:3]:
            assert r.reputation == 1.0 and r.state == "healthy"  # no honest node lost
    finally:
        await pool.close()


async def test_lower_priority_work_waits_for_every_queued_training_request(tmp_path):
    """A busy pool with evaluation requests (priority 1) queued before training requests
    (priority 0): once capacity frees, every training request is generated before any of
    the evaluation ones; both are released."""
    pool = await make_pool(tmp_path, [HONEST, HONEST], spot_check_rate=0.0)
    try:
        d = pool.dispatcher
        for node in pool.nodes.values():
            node.hold = True
        await d.submit(specs(8, first=0))  # the nodes' capacity: 4 each, all held
        await until(lambda: sum(len(n.held) for n in pool.nodes.values()) == 8)
        evals = [s.model_copy(update={"priority": 1}) for s in specs(6, first=100)]
        await d.submit(evals)
        await d.submit(specs(6, first=200))
        for node_id in pool.nodes:
            pool.calls.answer(node_id)
        await until(lambda: released(d) == 20)
        order = [rid for _, rid in pool.calls.asked]
        assert sorted(order[8:14]) == sorted(f"r{i}" for i in range(200, 206)), order
        assert sorted(order[14:]) == sorted(f"r{i}" for i in range(100, 106)), order
    finally:
        await pool.close()
