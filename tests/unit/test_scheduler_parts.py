"""Scheduler pieces in isolation: schema migrations (SQLite and PostgreSQL), the group
committing writer, node choice, reputation and bans, rate limits, pool files and invites,
config validation."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import sys

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import func, select

from protocol.config import ConfigError, load_config
from protocol.identity import Identity
from protocol.messages import PoolConfig, ReputationPolicy
from scheduler import db
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
    assert reg.pick_generator(min_version=2, exclude={"n0"}) is None
    assert reg.pick_generator(min_version=0, exclude={"n0"}) is b
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


# -- dispatch: audits, the published-weights check, timeouts ---------------------------


def _dispatcher(tmp_path, audit_rate: float = 1.0):
    """A `Dispatcher` that is never started: `_judge` and the release side are scripted."""
    from protocol.envelope import ReplayCache
    from protocol.messages import VerificationPolicy
    from scheduler.channel import NodeChannels
    from scheduler.config import ChannelConfig, DispatchConfig
    from scheduler.dispatch import Dispatcher
    from scheduler.metrics import SchedulerMetrics

    config = PoolConfig(
        pool_id="p",
        model="tiny",
        trainer_public_key=Identity.generate().public_key,
        verification=VerificationPolicy(audit_rate=audit_rate),
    )
    pool = open_pool(sign_pool(Identity.generate(), config))
    engine = db.create_engine(f"sqlite+aiosqlite:///{tmp_path / 'd.db'}")
    registry = Registry(ReputationPolicy(), probation=0)
    writer = db.Writer(engine, 0.01)
    channels = NodeChannels(
        registry, "p", ChannelConfig(), ReplayCache(), lambda n: None, lambda n: None
    )
    d = Dispatcher(
        pool,
        Identity.generate(),
        registry,
        engine,
        writer,
        DispatchConfig(),
        SchedulerMetrics(),
        channels,
    )
    d.released, d.requeued, d.asked = [], [], []

    async def release(job, status, detail, raw=b"", envelopes=None, *rest, **kw):
        d.released.append((status, list(envelopes or [])))

    d._release = release
    d._requeue = lambda job, why: d.requeued.append(why)
    d._spawn = lambda job, coro: asyncio.ensure_future(coro)
    return d, registry


def _script(d, registry, verdicts: list[bool]):
    """`_judge` answers from `verdicts` in turn, each from a new node (v1, v2, ...)."""
    from scheduler.jobs import Judged

    answers = iter(verdicts)

    async def judge(kind, rollout, raw, request, exclude):
        accepted = next(answers)
        n = node(len(d.asked) + 1)
        registry.add(n)
        assert all(e.node_id != n.node_id for e in exclude)
        d.asked.append((kind, n, accepted))
        verdict = type("V", (), {"accepted": accepted, "reasons": [] if accepted else ["bad"]})
        return Judged(n, verdict, f"env-{kind}-{n.node_id}".encode())

    d._judge = judge


def _job(source: str = "dispatch"):
    from protocol.messages import RolloutSpec, SamplingParams
    from scheduler.jobs import Job

    spec = RolloutSpec(request_id="r", prompt_ids=[1, 2], sampling=SamplingParams())
    return Job("r", source, spec, 1, 0.0)


async def test_audit_catches_a_verifier_that_accepted_a_bad_rollout(tmp_path):
    d, registry = _dispatcher(tmp_path)
    gen = node(0)
    registry.add(gen)
    d.jobs["r"] = job = _job()
    # first accepts (a liar), the audit rejects, the judge rejects: both liars punished.
    _script(d, registry, [True, False, False])
    await d._verify_and_release(job, gen, None, b"raw", None)
    kinds = [k for k, _, _ in d.asked]
    assert kinds == ["verify", "audit", "dispute"]
    first, auditor, judge = (n for _, n, _ in d.asked)
    assert gen.reputation == first.reputation == 0.75
    assert auditor.reputation == judge.reputation == 1.0
    assert d.released == [] and d.requeued and "two of three" in d.requeued[0]
    assert "n0" in job.tried
    # The same through the OpenAI endpoint: one path, so generated again elsewhere too.
    d.requeued.clear()
    d.jobs["r"] = job = _job("openai")
    _script(d, registry, [True, False, False])
    await d._verify_and_release(job, gen, None, b"raw", None)
    assert d.released == [] and d.requeued and "two of three" in d.requeued[0]


async def test_audit_overturned_punishes_the_auditor_and_releases(tmp_path):
    d, registry = _dispatcher(tmp_path)
    gen = node(0)
    registry.add(gen)
    d.jobs["r"] = job = _job()
    _script(d, registry, [True, False, True])
    await d._verify_and_release(job, gen, None, b"raw", None)
    first, auditor, judge = (n for _, n, _ in d.asked)
    assert auditor.reputation == 0.75 and first.reputation == gen.reputation == 1.0
    assert d.released == [("accepted", [b"env-verify-n1", b"env-audit-n2", b"env-dispute-n3"])]
    # An upheld acceptance is released with both verdicts; nobody punished.
    d.released.clear()
    d.asked.clear()
    d.jobs["r"] = job = _job()
    _script(d, registry, [True, True])
    await d._verify_and_release(job, gen, None, b"raw", None)
    assert [k for k, _, _ in d.asked] == ["verify", "audit"]
    assert d.released == [("accepted", [b"env-verify-n1", b"env-audit-n2"])]


async def test_an_overturned_rejection_is_audited_too(tmp_path):
    d, registry = _dispatcher(tmp_path)
    gen = node(0)
    registry.add(gen)
    d.jobs["r"] = job = _job()
    # first rejects, the judge accepts (a liar for an accomplice), the audit rejects.
    _script(d, registry, [False, True, False])
    await d._verify_and_release(job, gen, None, b"raw", None)
    assert [k for k, _, _ in d.asked] == ["verify", "dispute", "audit"]
    first, judge, auditor = (n for _, n, _ in d.asked)
    assert judge.reputation == gen.reputation == 0.75 and first.reputation == 1.0
    assert d.released == [] and d.requeued
    # first rejects (a liar), judge and audit accept: the first verifier loses.
    d.asked.clear()
    d.jobs["r"] = job = _job()
    _script(d, registry, [False, True, True])
    await d._verify_and_release(job, gen, None, b"raw", None)
    first, judge, auditor = (n for _, n, _ in d.asked)
    assert first.reputation == 0.75 and judge.reputation == auditor.reputation == 1.0
    assert d.released == [("accepted", [b"env-verify-n1", b"env-dispute-n2", b"env-audit-n3"])]


async def test_no_audit_at_rate_zero_and_no_release_without_an_auditor(tmp_path):
    d, registry = _dispatcher(tmp_path, audit_rate=0.0)
    gen = node(0)
    registry.add(gen)
    d.jobs["r"] = job = _job()
    _script(d, registry, [True])
    await d._verify_and_release(job, gen, None, b"raw", None)
    assert [k for k, _, _ in d.asked] == ["verify"] and d.released[0][0] == "accepted"
    # Audit drawn but nobody to audit: nothing is released, the job goes elsewhere.
    d, registry = _dispatcher(tmp_path / "b")
    registry.add(gen)
    d.jobs["r"] = job = _job()
    first = iter([True])

    async def judge(kind, *args, **kw):
        from scheduler.jobs import Judged

        if kind == "verify" and next(first, False):
            return Judged(node(1), type("V", (), {"accepted": True}), b"v")
        return None

    d._judge = judge
    await d._verify_and_release(job, gen, None, b"raw", None)
    assert d.released == [] and d.requeued == ["accepted, but no eligible auditor"]


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


async def test_a_node_whose_calls_time_out_is_benched_despite_heartbeats(tmp_path):
    import time

    from scheduler.dispatch import BENCH_S, TIMEOUTS_BEFORE_BENCH

    d, registry = _dispatcher(tmp_path)
    n = node(0)
    registry.add(n)
    for _ in range(TIMEOUTS_BEFORE_BENCH - 1):
        d.note_timeout(n)
    assert n.state == "healthy"
    d.note_timeout(n)
    assert n.state == "unhealthy" and n.benched_until > time.time() + BENCH_S - 5
    registry.seen(n)  # it heartbeats, but its calls still time out: no work
    assert n.state == "unhealthy" and registry.pick_generator(0) is None
    registry.seen(n, now=n.benched_until + 1)  # the bench is over: one more chance
    assert n.state == "healthy"
    d.note_timeout(n)  # and it failed again: benched twice as long
    assert n.benched_until > time.time() + 2 * BENCH_S - 5


async def test_a_verifier_overturned_about_a_node_banned_later_gets_its_reputation_back(tmp_path):
    """An honest verifier rejects a borderline cheat's rollout and the judge accepts it: the
    verifier loses the dispute. When that generator is banned later (evidence, disputes),
    the verifier was right and its reputation comes back; about an honest generator it
    does not."""
    d, registry = _dispatcher(tmp_path, audit_rate=0.0)
    cheat, honest = node(0), node(9)
    registry.add(cheat)
    registry.add(honest)
    d.jobs["r"] = job = _job()
    _script(d, registry, [False, True])
    await d._verify_and_release(job, cheat, None, b"raw", None)
    first = d.asked[0][1]
    assert first.reputation == 0.75 and d.released[0][0] == "accepted"
    d.jobs["r"] = job = _job()
    _script(d, registry, [False, True])  # new verifiers: n3, n4
    await d._verify_and_release(job, honest, None, b"raw", None)
    wrong = d.asked[2][1]
    d._ban(cheat, "per-node evidence: confirmed")
    assert first.reputation == 1.0
    assert wrong.reputation == 0.75  # the node it rejected is not banned
    assert cheat.state == "banned" and cheat.node_id not in d.overturned
