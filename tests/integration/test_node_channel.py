"""Node channels on loopback: every call from the scheduler to a node travels over the
WebSocket the node opened (`protocol.channel`). What an operator would notice: only the
registered key opens a node's channel; a link that goes silent costs seconds, not a
timeout; a worker killed mid-call has its work done elsewhere at once; a scheduler killed
with SIGKILL and restarted gets every node back by itself.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from protocol.channel import CLOSE_REFUSED, CLOSE_UNKNOWN_NODE
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import ChannelHello, Heartbeat, RegisterRequest, RolloutSpec, SamplingParams
from tests.channel_fakes import FakeChannel
from tests.pools import collect, make_pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SLOW_DEATH = (  # nodes are declared dead only after a minute: what happens sooner is the channel's
    "--lifecycle.heartbeat-interval-s", "1",
    "--lifecycle.unhealthy-after-s", "30",
    "--lifecycle.dead-after-s", "60",
    "--channel.ping-interval-s", "1",
)  # fmt: skip


def _register(pool, me: Identity) -> None:
    reg = RegisterRequest(pool_id=pool.pool_id, model="tiny", operator=me.node_id[-6:])
    r = httpx.post(f"{pool.url}/v1/nodes/register", content=seal(me, reg), timeout=10)
    assert r.status_code == 200, r.text
    hb = seal(me, Heartbeat(node_id=me.node_id, weights_version=0))
    assert httpx.post(f"{pool.url}/v1/nodes/heartbeat", content=hb, timeout=10).is_success


def test_only_the_registered_key_opens_a_nodes_channel(tmp_path):
    pool = make_pool(tmp_path)
    try:
        pool.start_scheduler()
        me, stranger = Identity.generate(), Identity.generate()
        # Not registered: told to register first.
        with FakeChannel(pool.url, me, pool.pool_id) as ch:
            assert ch.wait_closed() == CLOSE_UNKNOWN_NODE
        _register(pool, me)
        assert pool.node_state(me.node_id) == "registered"  # heartbeats, but no channel yet

        def signed_by(who: Identity, **fields):
            def hello(challenge: bytes) -> bytes:
                msg = {"node_id": me.node_id, "pool_id": pool.pool_id, "challenge": challenge}
                return seal(who, ChannelHello(**{**msg, **fields}))

            return hello

        recorded: list[bytes] = []

        def replay(challenge: bytes) -> bytes:
            return recorded[0]

        for what, hello in {
            "a stranger naming the node": signed_by(stranger),
            "another connection's challenge": signed_by(me, challenge=bytes(32)),
            "another pool": signed_by(me, pool_id="elsewhere"),
        }.items():
            with FakeChannel(pool.url, me, pool.pool_id, hello=hello) as ch:
                assert ch.wait_closed() == CLOSE_REFUSED, what
            assert pool.node_state(me.node_id) == "registered", what

        def record(challenge: bytes) -> bytes:
            recorded.append(signed_by(me)(challenge))
            return recorded[0]

        with FakeChannel(pool.url, me, pool.pool_id, hello=record) as ch:
            pool.wait_node_state(me.node_id, "healthy", 10)  # the real hello is taken
        # A recorded hello (its nonce seen, its challenge old) opens nothing.
        with FakeChannel(pool.url, me, pool.pool_id, hello=replay) as ch:
            assert ch.wait_closed() == CLOSE_REFUSED
        assert pool.node_state(me.node_id) == "unhealthy"  # no channel: no work for it
    finally:
        pool.close()


def test_a_silent_link_is_dropped_within_seconds_and_comes_back(tmp_path):
    """SIGSTOP freezes a worker (no pongs, no heartbeats): its channel is closed within
    1.5 ping intervals, long before its heartbeats are missed; after SIGCONT the node
    reopens it by itself and is healthy again."""
    pool = make_pool(tmp_path)
    try:
        pool.start_scheduler(*SLOW_DEATH)
        pool.join("w0")
        w0 = pool.node_id("w0")
        pool.nodes["w0"].proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        pool.wait_node_state(w0, "unhealthy", 10)
        dropped_after = time.monotonic() - t0
        pool.nodes["w0"].proc.send_signal(signal.SIGCONT)
        pool.wait_node_state(w0, "healthy", 15)
        back_after = time.monotonic() - t0 - dropped_after
        print(f"\nsilent link dropped after {dropped_after:.1f} s, back {back_after:.1f} s later")
        assert dropped_after < 5, "the dead link was not noticed by pings"
    finally:
        pool.close()


def test_work_of_a_worker_killed_mid_call_is_done_elsewhere_at_once(tmp_path):
    """kill -9 of a worker with calls in flight: its channel closes with it, the calls fail
    there and then and go to the other workers; nobody waits for a timeout (300 s) or for
    the node to be declared dead (60 s)."""
    pool = make_pool(tmp_path)
    try:
        pool.start_scheduler(*SLOW_DEATH)
        pool.join_many(["w0", "w1", "w2"])
        sampling = SamplingParams(max_tokens=48)
        specs = [RolloutSpec(request_id=f"k{i}", prompt_ids=[5, 6 + i % 30], sampling=sampling)
                 for i in range(36)]  # fmt: skip

        async def run() -> list:
            async with pool.client() as client:
                await client.submit(specs)
                first = await collect(client, 1, 60)
                pool.nodes["w0"].kill9()
                t0 = time.monotonic()
                rest = await collect(client, len(specs) - len(first), 60, after=first[-1].seq)
                return [*first, *rest], time.monotonic() - t0

        results, took = asyncio.run(run())
        assert sorted(r.request_id for r in results) == sorted(s.request_id for s in specs)
        assert all(r.status == "accepted" for r in results), [r.status for r in results]
        print(f"\nthe rest of the work done {took:.1f} s after the kill")
        assert took < 30
    finally:
        pool.close()


def test_a_scheduler_killed_and_restarted_gets_every_node_back(tmp_path):
    pool = make_pool(tmp_path)
    try:
        pool.start_scheduler(*SLOW_DEATH)
        pool.join_many(["w0", "w1"])
        pool.scheduler.kill9()
        t0 = time.monotonic()
        pool.start_scheduler(*SLOW_DEATH, port=pool.port)
        for name in ("w0", "w1"):
            pool.wait_node_state(pool.node_id(name), "healthy", 30)
        print(f"\nboth nodes healthy {time.monotonic() - t0:.1f} s after the restart began")
        for name in ("w0", "w1"):
            log = (tmp_path / f"{name}.log").read_text()
            assert log.count("channel open to") >= 2, f"{name} did not reopen its channel"
    finally:
        pool.close()


def test_connections_that_never_say_hello_are_capped_and_closed_at_their_deadline(tmp_path):
    """Connections to the node-channel route that only ping and never sign a hello: at most
    `max_unauthenticated_per_address` are let in at once (one more is answered 503 with
    Retry-After, before any upgrade), and each is closed at its hello deadline, which its
    pings do not push back; then the route takes new connections again."""
    import aiohttp

    from protocol.channel import CONNECT_ROUTE

    pool = make_pool(tmp_path)
    try:
        pool.start_scheduler(
            "--channel.hello-timeout-s", "1", "--channel.max-unauthenticated-per-address", "3"
        )
        url = pool.url.replace("http://", "ws://") + CONNECT_ROUTE

        async def held_open(ws: aiohttp.ClientWebSocketResponse) -> float:
            t0 = time.monotonic()
            async for _ in ws:  # the challenge, then nothing: the client only pings
                pass
            return time.monotonic() - t0

        async def run() -> tuple[list[float], int, str, bool]:
            async with aiohttp.ClientSession() as session:
                # heartbeat: the client pings every 0.2 s, which restarted a per-frame timeout
                socks = [await session.ws_connect(url, heartbeat=0.2) for _ in range(3)]
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await session.ws_connect(url)
                async with asyncio.timeout(10):
                    open_for = await asyncio.gather(*map(held_open, socks))
                again = await session.ws_connect(url)
                await again.close()
                retry = (refused.value.headers or {}).get("Retry-After", "")
                return list(open_for), refused.value.status, retry, again.closed

        open_for, status, retry, reopened = asyncio.run(run())
        assert status == 503 and retry, (status, retry)
        assert max(open_for) < 3.0, open_for  # the 1 s deadline, not extended by pings
        assert reopened
    finally:
        pool.close()
