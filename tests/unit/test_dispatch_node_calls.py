"""The node-call layer for real (`scheduler.node_calls.NodeCalls`): the dispatch loop calls
one node over a real channel (`scheduler.channel`, a WebSocket on loopback), and the node's
end is a FAKE node (`tests.channel_fakes.FakeChannel`) that answers every call the same
way. What must hold: a node whose calls answer 500, or never answer, becomes unhealthy and
gets no more work, whatever its heartbeats say, until its bench ends; then one call at a
time (the probe), which benches it again, longer, if it fails too; a node that refuses a
request (400) is not counted against.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from protocol.channel import CONNECT_ROUTE, answer_frame
from protocol.envelope import ReplayCache
from protocol.identity import Identity
from protocol.messages import Heartbeat, PoolConfig, RolloutSpec, SamplingParams
from scheduler import db
from scheduler.channel import NodeChannels
from scheduler.config import ChannelConfig, DispatchConfig
from scheduler.dispatch import Dispatcher
from scheduler.metrics import SchedulerMetrics
from scheduler.node_calls import BENCH_S, STRIKES_BEFORE_BENCH, NodeCalls
from scheduler.pool import open_pool, sign_pool
from scheduler.registry import NodeRecord, Registry
from scheduler.store import Store
from tests.channel_fakes import FakeChannel, OnCall
from tests.pools import node_record

pytestmark = pytest.mark.timeout(60)
CAPACITY = 4


def answering(status: int) -> OnCall:
    async def on_call(call_id: int, _route: str, _body: bytes) -> bytes | None:
        return answer_frame(call_id, status, b"the node says no")

    return on_call


@dataclass
class OneNode:
    dispatcher: Dispatcher
    registry: Registry
    node: NodeRecord
    channel: FakeChannel

    async def submit(self, first: int, n: int) -> None:
        sampling = SamplingParams(max_tokens=4)
        await self.dispatcher.submit(
            [
                RolloutSpec(request_id=f"r{i}", prompt_ids=[1, 2], sampling=sampling)
                for i in range(first, first + n)
            ]
        )

    def heartbeat(self) -> None:
        self.registry.heard(self.node, Heartbeat(node_id=self.node.node_id, weights_version=3))
        self.dispatcher.kick()


@contextlib.asynccontextmanager
async def one_node(tmp_path, on_call: OnCall, **dispatch) -> AsyncIterator[OneNode]:
    """A dispatcher whose one node answers every call with `on_call`, over its channel."""
    config = PoolConfig(pool_id="p", model="tiny", trainer_public_key=bytes(32))
    pool = open_pool(sign_pool(Identity.generate(), config))
    registry = Registry(config.reputation, probation=0)
    me = Identity.generate()
    node = node_record(
        1, node_id=me.node_id, public_key=me.public_key, state="registered", connected=False
    )
    registry.add(node)
    channels = NodeChannels(
        registry, "p", ChannelConfig(), ReplayCache(), registry.channel_opened, _closed(registry)
    )
    app = web.Application()
    app.add_routes([web.get(CONNECT_ROUTE, channels.handler)])
    server = TestServer(app)
    await server.start_server()
    url = f"sqlite+aiosqlite:///{tmp_path / 'd.db'}"
    engine = db.create_engine(url)
    await db.migrate(engine, url)
    writer = db.Writer(engine, 0.005)
    writer.start()
    store = Store(engine, writer, "p")
    dispatcher = Dispatcher(
        pool,
        Identity.generate(),
        registry,
        store,
        NodeCalls(channels, store.persist_node),
        DispatchConfig(**dispatch),
        SchedulerMetrics(),
    )
    await dispatcher.start()
    try:
        with FakeChannel(str(server.make_url("")), me, "p", on_call) as channel:
            await until(lambda: node.state == "healthy")
            yield OneNode(dispatcher, registry, node, channel)
            await channels.close_all()
    finally:
        await dispatcher.stop()
        await server.close()
        await writer.stop()
        await engine.dispose()


def _closed(registry: Registry) -> Callable[[NodeRecord], None]:
    def on_close(node: NodeRecord) -> None:
        registry.channel_closed(node)

    return on_close


async def until(cond: Callable[[], object], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


async def test_a_node_whose_every_call_answers_500_becomes_unhealthy_and_gets_no_more_work(
    tmp_path,
):
    async with one_node(tmp_path, answering(500)) as pool:
        n = pool.node
        await pool.submit(0, CAPACITY)
        await until(lambda: n.state == "unhealthy")
        assert n.failures >= STRIKES_BEFORE_BENCH and n.benched_until > time.time()
        await until(lambda: n.in_flight == 0)
        calls = len(pool.channel.calls)
        assert calls == CAPACITY  # each call failed once; nothing more was sent
        # More work, and heartbeats: the run of 500s is not forgotten, no work goes to it.
        await pool.submit(CAPACITY, CAPACITY)
        for _ in range(3):
            pool.heartbeat()
            await asyncio.sleep(0.1)
        assert n.state == "unhealthy" and n.failures == calls
        assert len(pool.channel.calls) == calls
        assert pool.dispatcher.queued == 2 * CAPACITY
        # The bench is over: the next heartbeat makes it healthy, and it gets one call (the
        # probe); that 500 benches it again, for twice as long.
        bench_before = n.benched_until - time.time()
        pool.registry.seen(n, now=n.benched_until + 1)
        assert n.state == "healthy"
        pool.dispatcher.kick()
        await until(lambda: n.state == "unhealthy")
        await asyncio.sleep(0.2)
        assert len(pool.channel.calls) == calls + 1
        assert n.benched_until - time.time() > 1.9 * bench_before


async def test_a_node_whose_calls_time_out_is_benched_despite_heartbeats(tmp_path):
    async with one_node(tmp_path, _never_answer, generate_timeout_s=0.2) as pool:
        n = pool.node
        await pool.submit(0, STRIKES_BEFORE_BENCH)
        await until(lambda: n.state == "unhealthy")
        assert n.timeouts == STRIKES_BEFORE_BENCH
        assert n.benched_until > time.time() + BENCH_S - 5
        pool.heartbeat()  # it heartbeats, but its calls still time out: no work
        assert n.state == "unhealthy" and pool.registry.pick_generator(0) is None
        pool.registry.seen(n, now=n.benched_until + 1)  # the bench is over: one more chance
        assert n.state == "healthy" and n.call_slots == 1  # one call at a time: the probe


async def _never_answer(_id: int, _route: str, _body: bytes) -> bytes | None:
    return None


async def test_a_node_that_refuses_requests_is_not_counted_against(tmp_path):
    """400 is the node finding the request itself invalid (too long for it, say): an
    honest node is never punished for what a client asked of it. Refused by the only node
    able to serve them, the requests fail at once with its reason: not asked of it again,
    not left waiting for a node that may never come."""
    async with one_node(tmp_path, answering(400)) as pool:
        n, d = pool.node, pool.dispatcher
        await pool.submit(0, CAPACITY)
        await until(lambda: d.status()["totals"].get("failed") == CAPACITY)
        assert not d.open_requests and len(pool.channel.calls) == CAPACITY
        (first, *_) = await d.results_after(0, 10, 0)
        assert first.detail.startswith("refused by 1 node(s): ")
        assert n.state == "healthy" and n.failures == n.timeouts == 0
        assert n.call_slots == CAPACITY


async def test_a_node_whose_refusals_others_disprove_is_benched(tmp_path):
    """Refusals that other nodes disproved (they served those requests) count as failed
    calls: a run of them benches the node; an answered call in between ends the run (an
    honest node that refuses the odd request too long for it keeps working)."""
    async with one_node(tmp_path, answering(200)) as pool:
        n, calls = pool.node, pool.dispatcher.calls
        for _ in range(STRIKES_BEFORE_BENCH - 1):
            calls.refused_what_others_serve(n)
        assert await calls.post(n, "/v1/verify", b"", 10) == b"the node says no"  # answered
        assert n.failures == 0 and n.state == "healthy"  # the run is over
        for _ in range(STRIKES_BEFORE_BENCH):
            calls.refused_what_others_serve(n)
        assert n.state == "unhealthy" and n.benched_until > time.time() + BENCH_S - 5
