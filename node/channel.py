"""Node channels, the node's end: the one WebSocket a pool node opens to its scheduler and
keeps open, over which the scheduler makes every call to it (`protocol.channel`).

Invariants:
- The node needs no inbound reachability: it dials out, and every call that arrives is
  handed to its own server on loopback, route for route, so the same handlers, size caps
  and signature checks apply as to any caller; the answer goes back with its status.
- The hello is signed by the node's key and answers the challenge of that connection.
- The link comes back by itself: a closed, refused or silent link (pongs missing) is
  reopened with backoff (0.25 s doubling to `reconnect_max_s`), on the next scheduler
  replica when opening fails; a registration wakes it at once.
- A call's answer is never lost silently: a call the server could not take is answered
  502 with the reason, so the scheduler re-dispatches at once instead of timing out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp

from node.config import NodeChannelConfig
from protocol.channel import (
    CLOSE_REFUSED,
    CLOSE_UNKNOWN_NODE,
    answer_frame,
    hello_frame,
    read_call,
    read_challenge,
    ws_url,
)
from protocol.codec import CodecError
from protocol.envelope import seal
from protocol.http import MSGPACK
from protocol.identity import Identity
from protocol.messages import ChannelHello

log = logging.getLogger("prime.node.channel")
FIRST_BACKOFF_S = 0.25
# A link that stayed up this long was healthy: the next failure starts the backoff over.
STABLE_S = 30.0


class SchedulerLink:
    """Keeps the node's channel to the scheduler at `scheduler_url()` open."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        identity: Identity,
        pool_id: str,
        local_url: str,
        scheduler_url: Callable[[], str],
        next_scheduler: Callable[[], None],
        cfg: NodeChannelConfig,
    ):
        self.session = session
        self.identity = identity
        self.pool_id = pool_id
        self.local_url = local_url
        self.scheduler_url = scheduler_url
        self.next_scheduler = next_scheduler
        self.cfg = cfg
        self.up = asyncio.Event()  # set while the channel is open (tests and `doctor` wait on it)
        self.wake = asyncio.Event()  # set to retry now (the node just registered)
        self.connections = 0  # channels opened so far

    async def run_forever(self) -> None:
        failures = 0
        while True:
            self.wake.clear()
            loop = asyncio.get_running_loop()
            started = loop.time()
            try:
                code = await self._session_once()
                why = f"closed by the scheduler (code {code})"
            except (aiohttp.ClientError, OSError, TimeoutError, CodecError) as exc:
                code, why = None, str(exc) or type(exc).__name__
            finally:
                self.up.clear()
            if loop.time() - started > STABLE_S:
                failures = 0
            failures += 1
            if code is None or code == CLOSE_REFUSED:
                self.next_scheduler()  # unreachable, standby (503), or refused: try another
            delay = min(self.cfg.reconnect_max_s, FIRST_BACKOFF_S * 2 ** (failures - 1))
            if code == CLOSE_UNKNOWN_NODE:
                delay = self.cfg.reconnect_max_s  # the heartbeat re-registers, then wakes us
            log.info("scheduler channel down (%s); reopening in %.2f s", why, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), delay)

    async def _session_once(self) -> int | None:
        """Open the channel, serve calls until it closes; its close code."""
        url = ws_url(self.scheduler_url())
        async with self.session.ws_connect(
            url,
            heartbeat=self.cfg.ping_interval_s,
            max_msg_size=self.cfg.max_frame_bytes,
            timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=5.0),
        ) as ws:
            first = await ws.receive(timeout=self.cfg.ping_interval_s * 2)
            if first.type != aiohttp.WSMsgType.BINARY:
                return ws.close_code
            challenge = read_challenge(first.data, self.cfg.max_frame_bytes)
            hello = ChannelHello(
                node_id=self.identity.node_id, pool_id=self.pool_id, challenge=challenge
            )
            await ws.send_bytes(hello_frame(seal(self.identity, hello)))
            self.connections += 1
            self.up.set()
            log.info("channel open to %s", url)
            calls: set[asyncio.Task] = set()
            try:
                async for msg in ws:
                    if msg.type != aiohttp.WSMsgType.BINARY:
                        break
                    call_id, route, body = read_call(msg.data, self.cfg.max_frame_bytes)
                    task = asyncio.create_task(self._answer(ws, call_id, route, body))
                    calls.add(task)
                    task.add_done_callback(calls.discard)
            finally:
                for task in calls:
                    task.cancel()
            return ws.close_code

    async def _answer(
        self, ws: aiohttp.ClientWebSocketResponse, call_id: int, route: str, body: bytes
    ) -> None:
        try:
            # No timeout here: the scheduler times its calls out and gives up on them.
            async with self.session.post(
                self.local_url + route,
                data=body,
                headers={"Content-Type": MSGPACK},
                timeout=aiohttp.ClientTimeout(total=None),
            ) as resp:
                status, data = resp.status, await resp.read()
        except aiohttp.ClientError as exc:
            status, data = 502, f"the node's server did not answer: {exc}".encode()
        with contextlib.suppress(ConnectionError):
            await ws.send_bytes(answer_frame(call_id, status, data))
