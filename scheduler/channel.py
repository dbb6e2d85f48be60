"""Node channels, the scheduler's end: every call to a node goes over the WebSocket that
node opened (`protocol.channel` has the frames). The scheduler never dials a node, so a
worker behind NAT or a firewall serves as well as one with a public address.

Invariants:
- A channel belongs to the registered node whose key signed its hello, which answers the
  challenge sent on that very connection; an unknown node is told to register
  (`CLOSE_UNKNOWN_NODE`), a banned or departed one is refused (`CLOSE_REFUSED`).
- One channel per node: a newer one replaces the older, whose calls fail at once.
- When a channel closes (the node went away, missed pongs, sent a bad frame or a frame
  over the cap), every call waiting on it fails with `ChannelClosed` there and then, and
  `on_close` runs once; nothing waits for a timeout to learn that a link is gone.
- At most `max_in_flight` calls are outstanding on one channel; more wait for a slot.
- A connection proves its node within `hello_timeout_s` of its upgrade, whatever frames it
  sends meanwhile, or is closed; at most `max_unauthenticated` connections (and
  `max_unauthenticated_per_address` from one address) are in that phase at once: more
  are answered 503 with Retry-After before any upgrade.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections import Counter
from collections.abc import Callable

import aiohttp
from aiohttp import web

from protocol.channel import (
    CHALLENGE_BYTES,
    CLOSE_REFUSED,
    CLOSE_REPLACED,
    CLOSE_UNKNOWN_NODE,
    call_frame,
    challenge_frame,
    read_answer,
    read_hello,
)
from protocol.client import RemoteError
from protocol.codec import CodecError
from protocol.envelope import EnvelopeError, ReplayCache, open_envelope
from protocol.messages import ChannelHello
from scheduler.config import ChannelConfig
from scheduler.registry import NodeRecord, Registry

log = logging.getLogger("prime.scheduler.channel")
# Channels of nodes in these states are refused: they get no work, ever or any more.
REFUSED_STATES = frozenset({"banned", "left"})


class ChannelClosed(ConnectionError):
    """The node has no open channel, or it closed while a call waited on it."""


class Channel:
    """One node's open WebSocket: calls out, answers matched back by id."""

    def __init__(self, node: NodeRecord, ws: web.WebSocketResponse, max_in_flight: int):
        self.node = node
        self.ws = ws
        self.pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self.ids = itertools.count(1)
        self.slots = asyncio.Semaphore(max_in_flight)
        self.closed = ""  # why, once closed

    async def post(self, route: str, body: bytes) -> bytes:
        """POST `body` to `route` on the node; its answer's body, or `RemoteError` for a
        non-2xx status, or `ChannelClosed`."""
        async with self.slots:
            if self.closed:
                raise ChannelClosed(f"{self.node.label}'s channel closed: {self.closed}")
            call_id = next(self.ids)
            answer = asyncio.get_running_loop().create_future()
            self.pending[call_id] = answer
            try:
                await self.ws.send_bytes(call_frame(call_id, route, body))
                status, data = await answer
            except ConnectionError as exc:  # aiohttp's closing-transport error included
                raise ChannelClosed(f"{self.node.label}'s channel failed: {exc}") from exc
            finally:
                self.pending.pop(call_id, None)
        if status >= 300:
            raise RemoteError(status, data[:500].decode(errors="replace"))
        return data

    def answered(self, frame: bytes, max_bytes: int) -> None:
        call_id, status, body = read_answer(frame, max_bytes)
        answer = self.pending.get(call_id)
        if answer is not None and not answer.done():
            answer.set_result((status, body))  # an answer to a call given up on is dropped

    def fail_all(self, why: str) -> None:
        self.closed = self.closed or why
        for answer in self.pending.values():
            if not answer.done():
                answer.set_exception(ChannelClosed(f"{self.node.label}'s channel closed: {why}"))


class NodeChannels:
    """The open channels by node id, and the route nodes open them on."""

    def __init__(
        self,
        registry: Registry,
        pool_id: str,
        cfg: ChannelConfig,
        replay: ReplayCache,
        on_open: Callable[[NodeRecord], None],
        on_close: Callable[[NodeRecord], None],
    ):
        self.registry = registry
        self.pool_id = pool_id
        self.cfg = cfg
        self.replay = replay
        self.on_open = on_open
        self.on_close = on_close
        self.open: dict[str, Channel] = {}
        self.in_hello: Counter[str] = Counter()  # connections in their hello, by address

    async def post(self, node: NodeRecord, route: str, body: bytes) -> bytes:
        channel = self.open.get(node.node_id)
        if channel is None:
            raise ChannelClosed(f"{node.label} has no open channel")
        return await channel.post(route, body)

    def close(self, node_id: str, why: str) -> None:
        """Fail every call on `node_id`'s channel and close it (a ban, a leave)."""
        channel = self.open.get(node_id)
        if channel is not None:
            channel.fail_all(why)
            asyncio.ensure_future(channel.ws.close(code=CLOSE_REFUSED, message=why.encode()[:120]))

    async def close_all(self) -> None:
        for channel in list(self.open.values()):
            channel.fail_all("scheduler stopping")
            with contextlib.suppress(Exception):
                await channel.ws.close(code=aiohttp.WSCloseCode.GOING_AWAY)

    # -- the route ---------------------------------------------------------------------
    async def handler(self, request: web.Request) -> web.WebSocketResponse:
        address = request.remote or ""
        if (
            sum(self.in_hello.values()) >= self.cfg.max_unauthenticated
            or self.in_hello[address] >= self.cfg.max_unauthenticated_per_address
        ):
            raise web.HTTPServiceUnavailable(
                text="too many node channels waiting for their hello; retry later",
                headers={"Retry-After": str(max(1, round(self.cfg.hello_timeout_s)))},
            )
        ws = web.WebSocketResponse(
            heartbeat=self.cfg.ping_interval_s, max_msg_size=self.cfg.max_frame_bytes
        )
        self.in_hello[address] += 1
        try:
            await ws.prepare(request)
            node = await self._hello(ws)
        finally:
            self.in_hello[address] -= 1
            if not self.in_hello[address]:
                del self.in_hello[address]
        if node is None:
            return ws
        channel = Channel(node, ws, self.cfg.max_in_flight)
        older = self.open.get(node.node_id)
        self.open[node.node_id] = channel
        if older is not None:
            older.fail_all("replaced by a newer channel")
            await older.ws.close(code=CLOSE_REPLACED, message=b"replaced by a newer channel")
        log.info("%s connected its channel from %s", node.label, request.remote)
        self.on_open(node)
        why = "the node closed it"
        try:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    why = f"unexpected {msg.type.name} frame"
                    break
                try:
                    channel.answered(msg.data, self.cfg.max_frame_bytes)
                except CodecError as exc:
                    why = f"bad frame: {exc}"
                    break
            else:
                if ws.exception() is not None:
                    why = f"{ws.exception()}"
        finally:
            channel.fail_all(why)
            if not ws.closed:
                await ws.close(code=CLOSE_REFUSED, message=why.encode()[:120])
            if self.open.get(node.node_id) is channel:
                del self.open[node.node_id]
                log.info("%s's channel closed: %s", node.label, why)
                # The current record: a re-registration replaced the one the hello found.
                self.on_close(self.registry.get(node.node_id) or node)
        return ws

    async def _hello(self, ws: web.WebSocketResponse) -> NodeRecord | None:
        """The node behind `ws`, proven by a signed hello answering a fresh challenge;
        None (and `ws` closed with the reason) if it is not one that may connect."""
        challenge = os.urandom(CHALLENGE_BYTES)
        await ws.send_bytes(challenge_frame(challenge))
        try:
            # One deadline for the whole hello: receive(timeout=) would restart on every
            # ping or pong, and a connection that only pings would stay open for ever.
            async with asyncio.timeout(self.cfg.hello_timeout_s):
                msg = await ws.receive()
        except TimeoutError:
            await ws.close(code=CLOSE_REFUSED, message=b"no hello in time")
            return None
        if msg.type != aiohttp.WSMsgType.BINARY:
            await ws.close(code=CLOSE_REFUSED, message=b"expected a binary hello frame")
            return None
        try:
            opened = open_envelope(
                read_hello(msg.data, self.cfg.max_frame_bytes),
                ChannelHello,
                replay_cache=self.replay,
            )
        except (CodecError, EnvelopeError) as exc:
            await ws.close(code=CLOSE_REFUSED, message=f"bad hello: {exc}".encode()[:120])
            return None
        hello = opened.message
        node = self.registry.get(opened.sender_id)
        if hello.challenge != challenge or hello.node_id != opened.sender_id:
            why, code = "the hello answers another connection or names another node", None
        elif hello.pool_id != self.pool_id:
            why, code = f"this scheduler runs pool {self.pool_id!r}", None
        elif node is None or node.state == "dead":
            why, code = "not registered: register first", CLOSE_UNKNOWN_NODE
        elif node.state in REFUSED_STATES:
            why, code = f"this node is {node.state}", None
        else:
            return node
        await ws.close(code=code or CLOSE_REFUSED, message=why.encode()[:120])
        return None
