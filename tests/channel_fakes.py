"""FAKE node channels, for tests only: the node's end of a channel (`protocol.channel`)
opened by hand, doing what a real `prime-node` never does (answer nothing, send what it
likes), so tests can see what the scheduler makes of it.

`FakeChannel` runs its own event loop in a thread, so synchronous tests (httpx) can hold
a channel open while they poke the scheduler. Invariant: on exit the connection is
closed and the thread joined, whatever the test did.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable

import aiohttp

from protocol.channel import hello_frame, read_call, read_challenge, ws_url
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import ChannelHello

MAX = 64 * 1024 * 1024
# What a fake does with each call frame: (id, route, body) -> an answer frame, or None.
OnCall = Callable[[int, str, bytes], Awaitable[bytes | None]]


async def _ignore(_id: int, _route: str, _body: bytes) -> bytes | None:
    return None


class FakeChannel:
    """Opens `identity`'s channel to the scheduler at `url`, answers the challenge (or sends
    `hello` instead, when given), then hands every call to `on_call` (default: never
    answer: a node whose link is up but whose work hangs)."""

    def __init__(
        self,
        url: str,
        identity: Identity,
        pool_id: str,
        on_call: OnCall = _ignore,
        hello: Callable[[bytes], bytes] | None = None,
    ):
        self.url, self.identity, self.pool_id = url, identity, pool_id
        self.on_call, self.hello = on_call, hello
        self.calls: list[str] = []  # routes called, in order
        self.close_code: int | None = None
        self.opened = threading.Event()
        self.ended = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeChannel:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        if self._task is not None and not self.ended.is_set():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)

    def wait_hello_sent(self, timeout_s: float = 10) -> None:
        if not self.opened.wait(timeout_s):
            raise TimeoutError(f"no hello sent (close code {self.close_code})")

    def wait_closed(self, timeout_s: float = 10) -> int | None:
        if not self.ended.wait(timeout_s):
            raise TimeoutError("the scheduler did not close the channel")
        return self.close_code

    def _run(self) -> None:
        self._task = self._loop.create_task(self._main())
        try:
            self._loop.run_until_complete(self._task)
        except (asyncio.CancelledError, aiohttp.ClientError, OSError):
            pass
        finally:
            self.ended.set()
            self._loop.close()

    async def _main(self) -> None:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(ws_url(self.url), max_msg_size=MAX) as ws,
        ):
            first = await ws.receive(timeout=10)
            challenge = read_challenge(first.data, MAX)
            hello = ChannelHello(
                node_id=self.identity.node_id, pool_id=self.pool_id, challenge=challenge
            )
            frame = self.hello(challenge) if self.hello else seal(self.identity, hello)
            await ws.send_bytes(hello_frame(frame))
            self.opened.set()  # sent: whether the scheduler took it, its state tells
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    break
                call_id, route, body = read_call(msg.data, MAX)
                self.calls.append(route)
                answer = await self.on_call(call_id, route, body)
                if answer is not None:
                    await ws.send_bytes(answer)
            self.close_code = ws.close_code
