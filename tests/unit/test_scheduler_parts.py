"""Scheduler pieces in isolation: schema migrations (SQLite and PostgreSQL), the group
committing writer, node choice, reputation and bans, rate limits, pool files and invites,
config validation, the published-weights ledger. The dispatch loop is driven in
test_dispatch_loop.py (over a fake node-call layer) and test_dispatch_node_calls.py (its
node calls for real, over a channel)."""

from __future__ import annotations

import base64
import contextlib
import random
import sys
import time

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import func, select

from protocol.config import ConfigError, load_config
from protocol.identity import Identity
from protocol.messages import AdmissionPolicy, CheckerPolicy, PoolConfig, ReputationPolicy
from scheduler import db
from scheduler.checker_watch import CheckerWatch, WrongRateTest
from scheduler.config import PoolCreateConfig, SchedulerConfig
from scheduler.pool import PoolError, check_invite, make_invite, open_pool, sign_pool
from scheduler.ratelimit import RateLimited, RateLimiter
from scheduler.registry import NodeRecord, Registry
from tests.pools import TINY_THRESHOLDS, node_record, postgres_database


def node(i: int, **kw) -> NodeRecord:
    return node_record(i, **kw)


def test_a_node_without_an_open_channel_does_not_turn_healthy_by_heartbeating():
    reg = Registry(ReputationPolicy())
    n = node(1, state="registered", connected=False)
    reg.add(n)
    reg.seen(n)
    assert n.state == "registered"  # heartbeats prove it is alive, not that calls reach it
    n.connected = True  # it opened its channel (a hello signed by its key)
    reg.seen(n)
    assert n.state == "healthy"


@pytest.fixture(params=["sqlite", "postgresql"])
async def engine_url(request, tmp_path):
    async with contextlib.AsyncExitStack() as stack:
        if request.param == "postgresql":
            url = await stack.enter_async_context(postgres_database())
        else:
            url = f"sqlite+aiosqlite:///{tmp_path / 's.db'}"
        engine = db.create_engine(url)
        await db.migrate(engine, url)
        yield engine, url
        await engine.dispose()


async def test_migrated_schema_matches_the_tables_in_code(engine_url):
    engine, url = engine_url

    def diff(sync_conn):
        return compare_metadata(MigrationContext.configure(sync_conn), db.metadata)

    async with engine.connect() as conn:
        assert await conn.run_sync(diff) == []
    await db.migrate(engine, url)  # idempotent


async def test_writer_group_commits_and_results_are_unique(engine_url):
    engine, _ = engine_url
    writer = db.Writer(engine, 0.005)
    writer.start()
    rows = [
        {
            "seq": i,
            "request_id": f"r{i}",
            "source": "dispatch",
            "status": "accepted",
            "detail": "",
            "weights_version": 0,
            "generator_id": "g",
            "rollout_envelope": b"x",
            "verdict_envelopes": b"",
            "released_at": 0.0,
        }
        for i in range(1, 51)
    ]
    for f in writer.write_many(db.results.insert(), rows):
        await f
    # A second release of the same request is refused by the database itself.
    dup = dict(rows[0], seq=99)
    with pytest.raises(Exception, match="(?i)unique|duplicate"):
        await writer.write(db.results.insert(), dup)
    # A failed batch does not poison later ones.
    await writer.write(db.results.insert(), dict(rows[0], seq=100, request_id="fresh"))
    await writer.stop()
    async with engine.connect() as conn:
        assert (await conn.execute(select(func.count()).select_from(db.results))).scalar() == 51
        assert await db.max_seq(conn) == 100


def test_generator_choice_respects_version_capacity_state_and_load():
    reg = Registry(ReputationPolicy())
    a, b, c, d = node(0), node(1, weights_version=1), node(2, state="unhealthy"), node(3)
    for n in (a, b, c, d):
        reg.add(n)
    a.outstanding_tokens = 100
    d.outstanding_tokens = 10
    assert reg.pick_generator(min_version=2) is d  # b too old, c unhealthy, a busier
    d.in_flight = d.capacity
    assert reg.pick_generator(min_version=2) is a  # d is full
    assert reg.pick_generator(min_version=2, tried={"n0"}) is None  # d, untried, is full
    assert reg.pick_generator(min_version=0, tried={"n0"}) is b
    # Every node able to serve the request was tried: they are candidates again.
    assert reg.pick_generator(min_version=2, tried={"n0", "n3"}) is a
    # Reputation weighs load: half the reputation counts like twice the load.
    d.in_flight = 0
    d.outstanding_tokens = 60
    d.reputation = 0.5
    assert reg.pick_generator(min_version=2) is a


def test_verifier_is_never_the_generator_its_operator_or_other_weights():
    reg = Registry(ReputationPolicy())
    gen = node(0, operator="acme")
    same_op = node(1, operator="acme")
    other_weights = node(2, weights_hash="other")
    good = node(3)
    for n in (gen, same_op, other_weights, good):
        reg.add(n)
    for _ in range(50):
        assert reg.pick_verifier("h", [gen], set()) is good
    assert reg.pick_verifier("h", [gen], {"n3"}) is None
    # A judge excludes the first verifier's operator too.
    judge_pool = Registry(ReputationPolicy())
    for n in (gen, good, node(4, operator=good.operator), node(5)):
        judge_pool.add(n)
    assert {judge_pool.pick_verifier("h", [gen, good], set()).node_id for _ in range(50)} == {"n5"}


def test_reputation_bans_after_bounded_lost_disputes_and_ban_is_final():
    reg = Registry(ReputationPolicy(initial=1.0, penalty_lost_dispute=0.25, ban_below=0.3))
    n = node(0)
    reg.add(n)
    assert [reg.penalize(n, "lost") for _ in range(3)] == [False, False, True]
    assert n.state == "banned" and n.reason == "lost"
    reg.reward(n)
    assert n.reputation == 0.25  # nothing earns a banned node reputation back
    reg.seen(n)
    assert n.state == "banned"
    assert reg.pick_generator(0) is None and reg.pick_verifier("h", [], set()) is None
    with pytest.raises(ValueError, match="ban_below must be lower"):
        ReputationPolicy(initial=0.5, ban_below=0.6)


def test_missed_heartbeats_make_nodes_unhealthy_then_dead():
    reg = Registry(ReputationPolicy())
    n = node(0, last_seen=100.0)
    reg.add(n)
    assert reg.sweep(110.0, 25, 45) == []
    assert reg.sweep(130.0, 25, 45) == [n] and n.state == "unhealthy"
    assert reg.pick_generator(0) is None
    assert reg.sweep(150.0, 25, 45) == [n] and n.state == "dead"
    reg.seen(node(1))  # unrelated
    n2 = node(2, state="unhealthy")
    reg.seen(n2)
    assert n2.state == "healthy"


def test_rate_limiter_refuses_over_burst_and_refills():
    now = [0.0]
    rl = RateLimiter(per_s=2, burst=3, what="node key", clock=lambda: now[0])
    for _ in range(3):
        rl.check("a")
    with pytest.raises(RateLimited, match="more than 2 requests/s from this node key"):
        rl.check("a")
    rl.check("b")  # other keys are not affected
    now[0] = 0.5  # one token back
    rl.check("a")
    with pytest.raises(RateLimited):
        rl.check("a")


def test_pool_signature_and_invites():
    owner, trainer, other = Identity.generate(), Identity.generate(), Identity.generate()
    cfg = PoolConfig(pool_id="p", model="tiny", trainer_public_key=trainer.public_key)
    pool = open_pool(sign_pool(owner, cfg))
    assert pool.config == cfg and pool.owner_key == owner.public_key
    tampered = bytearray(sign_pool(owner, cfg))
    tampered[-70] ^= 1
    with pytest.raises(PoolError):
        open_pool(bytes(tampered))
    token = base64.urlsafe_b64decode(make_invite(owner, "p", ttl_s=60))
    assert check_invite(token, pool, "anyone").pool_id == "p"
    with pytest.raises(PoolError, match="not trusted"):
        check_invite(base64.urlsafe_b64decode(make_invite(other, "p", 60)), pool, "x")
    with pytest.raises(PoolError, match="expired"):
        check_invite(base64.urlsafe_b64decode(make_invite(owner, "p", -1)), pool, "x")


def test_configs_fail_fast_with_clear_messages(tmp_path):
    with pytest.raises(ConfigError, match="pool file .* not found"):
        load_config(SchedulerConfig, ["--pool-file", str(tmp_path / "missing.pool")])
    pool_file = tmp_path / "p.pool"
    pool_file.write_bytes(b"x")
    with pytest.raises(ConfigError, match="async driver"):
        load_config(
            SchedulerConfig, ["--pool-file", str(pool_file), "--database.url", "sqlite:///x.db"]
        )
    with pytest.raises(ConfigError, match="unhealthy_after_s < dead_after_s"):
        load_config(
            SchedulerConfig,
            ["--pool-file", str(pool_file), "--lifecycle.dead-after-s", "5"],
        )
    with pytest.raises(ConfigError, match="Extra inputs"):
        load_config(SchedulerConfig, ["--pool-file", str(pool_file), "--no-such-key", "1"])
    thresholds = ["@", str(TINY_THRESHOLDS)]
    with pytest.raises(ConfigError, match="needs admission.allowlist"):
        load_config(
            PoolCreateConfig,
            [
                "--pool-id",
                "p",
                "--trainer",
                Identity.generate().node_id,
                "--admission.mode",
                "allowlist",
                *thresholds,
            ],
        )
    with pytest.raises(ConfigError, match="trainer must be a node id"):
        load_config(PoolCreateConfig, ["--pool-id", "p", "--trainer", "not-a-key", *thresholds])
    # Thresholds that do not say which engine mix they hold for make no pool.
    with pytest.raises(ConfigError, match="state no engine mix"):
        load_config(PoolCreateConfig, ["--pool-id", "p", "--trainer", Identity.generate().node_id])
    # `pool create` takes the audit rate like every verification field, checked in 0..1.
    pool_args = ["--pool-id", "p", "--trainer", Identity.generate().node_id, *thresholds]
    cfg = load_config(PoolCreateConfig, [*pool_args, "--verification.audit_rate", "0.25"])
    assert cfg.verification.audit_rate == 0.25
    with pytest.raises(ConfigError, match="audit_rate"):
        load_config(PoolCreateConfig, [*pool_args, "--verification.audit_rate", "1.5"])


def test_scheduler_never_imports_torch():
    import subprocess

    code = "import scheduler.server, scheduler.cli, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_large_pool_choice_is_sampled_but_balanced_and_never_ineligible():
    reg = Registry(ReputationPolicy())
    nodes = [node(i, capacity=1000) for i in range(1000)]
    for i, n in enumerate(nodes):
        n.outstanding_tokens = i  # n0 idlest ... n999 busiest
        if i % 3 == 0:
            n.weights_version = 1  # too old for min_version 2
        reg.add(n)
    picks = [reg.pick_generator(min_version=2) for _ in range(300)]
    assert all(p.weights_version >= 2 for p in picks)
    # Best of 16 random nodes: in the least loaded ~third of the pool almost always.
    median_rank = sorted(p.outstanding_tokens for p in picks)[150]
    assert median_rank < 150, median_rank
    # Dispatching with load updates spreads work evenly instead of piling onto one node.
    for n in nodes:
        n.outstanding_tokens = 0
    for _ in range(3000):
        reg.pick_generator(min_version=0).outstanding_tokens += 10
    loads = [n.outstanding_tokens // 10 for n in nodes]  # requests per node, 3 on average
    assert max(loads) <= 4, max(loads)
    # Only one eligible node among a thousand: the unlucky sample falls back to a scan.
    for n in nodes[1:]:
        n.state = "unhealthy"
    reg._healthy_at = -1.0
    assert reg.pick_generator(min_version=0) is nodes[0]
    assert reg.pick_verifier("h", [nodes[0]], set()) is None


def test_probation_limits_a_new_node_until_its_rollouts_are_accepted():
    reg = Registry(ReputationPolicy(), probation=4)
    n = node(0, capacity=100)
    reg.add(n)
    n.in_flight = 4
    assert reg.pick_generator(0) is None  # four in flight and no track record yet
    n.in_flight, n.unsettled = 1, 3
    assert reg.pick_generator(0) is None  # generated but unverified rollouts count too
    n.in_flight, n.unsettled = 4, 0
    n.accepted = 2
    assert reg.pick_generator(0) is n
    n.in_flight = 6
    assert reg.pick_generator(0) is None
    n.accepted = 500
    n.in_flight = 99
    assert reg.pick_generator(0) is n  # proven: up to its own capacity
    n.in_flight = 100
    assert reg.pick_generator(0) is None
    assert Registry(ReputationPolicy(), probation=0).probation == 0


# -- the published-weights check (the dispatch loop: test_dispatch_loop.py, and its node
# calls: test_dispatch_node_calls.py) -----------------------------------------------------


def test_rollout_weights_must_be_what_the_trainer_published():
    from scheduler.ledger import WeightsLedger

    ledger = WeightsLedger()
    ok = ledger.check
    assert ok(0, "base") and not ok(1, "x")  # nothing published: only the base model
    ledger.note(1, "h1")
    ledger.note(2, "")  # published without a hash (filesystem transport)
    assert ok(0, "base") and ok(1, "h1") and ok(2, "anything")
    assert not ok(1, "h2")  # version 1 with another hash
    assert not ok(3, "h3")  # a version never published
    ledger.note(0, "manifest-of-v0")  # a swarm trainer announces the base model too
    assert ok(0, "folder-hash-of-the-base")  # nodes hash the pool's folder: not a lie
    ledger.note(1, "h1b")  # republished under another manifest: both hold
    assert ok(1, "h1") and ok(1, "h1b")


async def test_scheduler_rebuilds_the_published_map_after_a_restart(tmp_path):
    from protocol.envelope import seal
    from protocol.messages import WeightUpdate
    from scheduler.ledger import PUBLISHED_PREFIX
    from scheduler.server import SchedulerServer

    trainer, owner = Identity.generate(), Identity.generate()
    config = PoolConfig(pool_id="p", model="tiny", trainer_public_key=trainer.public_key)
    (tmp_path / "p.pool").write_bytes(sign_pool(owner, config))
    url = f"sqlite+aiosqlite:///{tmp_path / 's.db'}"
    cfg = load_config(
        SchedulerConfig, ["--pool-file", str(tmp_path / "p.pool"), "--database.url", url]
    )
    server = SchedulerServer(cfg, Identity.generate())
    await db.migrate(server.engine, url)
    latest = seal(trainer, WeightUpdate(version=3, path="/w", weights_hash="h3"))
    async with server.engine.begin() as conn:
        await conn.execute(db.kv.insert(), [{"key": "weights", "value": latest}])
        await conn.execute(
            db.kv.insert(),
            [
                {"key": f"{PUBLISHED_PREFIX}1", "value": b"h1"},
                {"key": f"{PUBLISHED_PREFIX}2", "value": b"h2,h2b"},  # republished
            ],
        )
    await server._load_state()
    await server.engine.dispose()
    assert server.ledger.published == {1: {"h1"}, 2: {"h2", "h2b"}, 3: {"h3"}}


def test_a_rollout_answers_its_request_in_every_field_the_request_fixes():
    """One comparison (`protocol.answers.request_mismatches`) for the scheduler's own check
    and every verifier's: each field the request fixes, changed alone, is named, and the
    scheduler treats a signed contradiction as cheating."""
    from protocol.answers import request_mismatches
    from protocol.envelope import seal
    from protocol.messages import ProofParams, Rollout, RolloutRequest, SamplingParams
    from scheduler.checks import Cheated, open_rollout
    from scheduler.ledger import WeightsLedger

    me = Identity.generate()
    request = RolloutRequest(request_id="r", pool_id="p", prompt_ids=[1, 2], seed=5, min_version=2)
    honest = Rollout(
        request_id="r",
        pool_id="p",
        node_id=me.node_id,
        prompt_ids=[1, 2],
        completion_ids=[3],
        logprobs=[-0.5],
        finish_reason="length",
        sampling=request.sampling,
        seed=5,
        weights_version=2,
        weights_hash="h",
        proof=[b"p"],
    )
    gen = node(0, node_id=me.node_id, public_key=me.public_key)
    ledger = WeightsLedger()
    ledger.note(2, "h")
    assert request_mismatches(honest, request) == []
    assert open_rollout(seal(me, honest), gen, request, ledger) == honest
    changes = {
        "request_id": {"request_id": "other"},
        "pool_id": {"pool_id": "q"},
        "prompt": {"prompt_ids": [1, 3]},
        "sampling": {"sampling": SamplingParams(temperature=0.5)},
        "seed": {"seed": 6},
        "proof layout": {"proof_params": ProofParams(chunk_tokens=16)},
        "min_version": {"weights_version": 1},
    }
    for name, change in changes.items():
        lie = honest.model_copy(update=change)
        assert request_mismatches(lie, request) == [name]
        with pytest.raises(Cheated, match=name):
            open_rollout(seal(me, lie), gen, request, ledger)


def test_the_right_to_check_is_earned_from_a_founding_set():
    """In a pool that makes it earned, a newcomer never verifies until `earn_after` of its
    rollouts were accepted; a founder verifies from the start; an open pool that asks for
    earned rights must name its founders (fails fast), and invite or `earn_after` 0 pools
    let every node check."""
    founder, newcomer, gen = node(0), node(1), node(2)
    for n in (founder, newcomer, gen):
        n.weights_hash = "h"
    reg = Registry(
        ReputationPolicy(), checkers=CheckerPolicy(earn_after=2), founders=frozenset({"n0"})
    )
    for n in (founder, newcomer, gen):
        reg.add(n)
    picks = {reg.pick_verifier("h", [gen], set()).node_id for _ in range(50)}
    assert picks == {"n0"}
    assert not reg.earn(newcomer) and reg.earn(newcomer)  # the second one earns it
    picks = {reg.pick_verifier("h", [gen], set()).node_id for _ in range(50)}
    assert picks == {"n0", "n1"}
    base = {"pool_id": "p", "model": "tiny", "trainer_public_key": bytes(32)}
    with pytest.raises(ValueError, match="founders"):
        PoolConfig(**base, checkers=CheckerPolicy(earn_after=5))
    assert PoolConfig(**base).founding_checkers() is None  # rights not earned: everyone
    invite = PoolConfig(
        **base, admission=AdmissionPolicy(mode="invite"), checkers=CheckerPolicy(earn_after=5)
    )
    assert invite.founding_checkers() is None  # every node holds the owner's invite
    a, b = Identity.generate().node_id, Identity.generate().node_id
    listed = PoolConfig(
        **base,
        admission=AdmissionPolicy(mode="allowlist", allowlist=[a]),
        checkers=CheckerPolicy(earn_after=5, founders=[b]),
    )
    assert listed.founding_checkers() == {a, b}
    with pytest.raises(ValueError, match="not a node id|not an Ed25519 node id"):
        CheckerPolicy(earn_after=5, founders=["my-laptop"])


def test_the_checker_watch_spares_honest_noise_and_catches_a_checker_wrong_one_time_in_20():
    """At the default policy: 100,000 verdicts of a checker outvoted at the honest rate
    raise no alarm; one outvoted one time in 20 (which reputation alone would keep) raises
    it within the expected ~200 verdicts' order; a turn after a long honest run is caught
    as fast as from the start (credit is not banked)."""
    policy = CheckerPolicy()
    assert 150 < WrongRateTest.of(policy).verdicts_to_alarm(0.05) < 250
    assert WrongRateTest.of(policy).verdicts_to_alarm(policy.honest_wrong_rate) == float("inf")
    rng = random.Random(3)
    watch = CheckerWatch(policy)

    def verdicts_until_alarm(node: str, rate: float, limit: int) -> int | None:
        for i in range(1, limit + 1):
            if watch.observe(node, rng.random() < rate):
                return i
        return None

    assert verdicts_until_alarm("honest", policy.honest_wrong_rate, 100_000) is None
    assert verdicts_until_alarm("picky", 0.05, 1_000) is not None
    assert verdicts_until_alarm("turncoat", 0.0, 10_000) is None
    assert verdicts_until_alarm("turncoat", 0.05, 1_000) is not None
    with pytest.raises(ValueError, match="suspect_wrong_rate must be above"):
        CheckerPolicy(honest_wrong_rate=0.05, suspect_wrong_rate=0.05)


def test_recent_identities_cannot_dominate_the_checkers_of_a_rollout():
    """One founder, one established earner and twenty identities admitted a minute ago that
    earned their rights: drawn uniformly they would give nine verdicts in ten; together
    they are drawn about `recent_draw_share` of the time, a rollout that has a recent
    checker gets no second one (it waits instead), and with no established checker free
    a recent one still checks a first verdict (the pool goes on)."""
    now = time.time()
    founder = node(0, weights_hash="h", earned=0)
    old = node(1, weights_hash="h", earned=5)
    gen = node(2, weights_hash="h")
    recent = [node(10 + i, weights_hash="h", earned=5, registered_at=now - 60) for i in range(20)]
    reg = Registry(
        ReputationPolicy(), checkers=CheckerPolicy(earn_after=1), founders=frozenset({"n0"})
    )
    for n in (founder, old, gen, *recent):
        reg.add(n)
    draws = [reg.pick_verifier("h", [gen], set()) for _ in range(2000)]
    share = sum(reg.is_recent(n, now) for n in draws) / len(draws)
    assert 0.2 < share < 0.3, share  # 0.25, not 20/22
    second = [reg.pick_verifier("h", [gen, recent[0]], set(), [recent[0]]) for _ in range(200)]
    assert {n.node_id for n in second} == {founder.node_id, old.node_id}
    busy = {founder.node_id, old.node_id}
    assert reg.pick_verifier("h", [gen], busy) in recent
    assert reg.pick_verifier("h", [gen, recent[0]], busy, [recent[0]]) is None
    # Where every admitted node checks at once (no earned rights), nobody is recent.
    everyone = Registry(ReputationPolicy())
    for n in (gen, *recent):
        everyone.add(n)
    assert not any(everyone.is_recent(n, now) for n in recent)
