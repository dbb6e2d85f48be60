"""Async HTTP client for the signed msgpack routes between processes.

Invariants: every request body is a fresh envelope (new nonce) signed by the caller's
identity; a non-2xx answer raises `RemoteError` carrying the status and the server's
error message; a response envelope is opened (signature checked) before it is returned.
"""

from __future__ import annotations

import contextlib
import json
from typing import TypeVar

import aiohttp
from pydantic import BaseModel

from protocol.envelope import Opened, open_envelope, seal
from protocol.identity import Identity

MSGPACK = "application/msgpack"
M = TypeVar("M", bound=BaseModel)


class RemoteError(RuntimeError):
    """The other side answered with an error status."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


async def _raise_for(resp: aiohttp.ClientResponse) -> None:
    if resp.status < 300:
        return
    text = await resp.text()
    with contextlib.suppress(ValueError, KeyError, TypeError):
        text = json.loads(text)["error"]["message"]
    raise RemoteError(resp.status, text)


async def post_raw(session: aiohttp.ClientSession, url: str, body: bytes) -> bytes:
    async with session.post(url, data=body, headers={"Content-Type": MSGPACK}) as resp:
        await _raise_for(resp)
        return await resp.read()


async def call(
    session: aiohttp.ClientSession,
    url: str,
    identity: Identity,
    message: BaseModel,
    response: type[M],
    ttl_s: float = 60.0,
) -> tuple[Opened[M], bytes]:
    """POST `message` signed by `identity`; return the opened response and its raw envelope."""
    raw = await post_raw(session, url, seal(identity, message, ttl_s))
    return open_envelope(raw, response, check_expiry=False), raw
