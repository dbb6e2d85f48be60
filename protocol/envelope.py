"""Signed envelopes: every message between processes travels inside one.

An envelope carries the sender's public key, a random nonce, an expiry time, the message
type and the encoded message, and the sender's Ed25519 signature over all of them.

Invariants:
- `open_envelope` accepts an envelope only if the signature is valid, it has not expired,
  its expiry is not further ahead than the receiver allows (so a nonce cannot be kept
  alive forever), and (with a `ReplayCache`) its (sender, nonce) was never seen before.
- A replay cache forgets a nonce only after the envelope carrying it has expired, so a
  replay is refused for as long as the original would have been accepted.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from pydantic import BaseModel

from protocol import PROTOCOL_VERSION
from protocol.codec import DEFAULT_MAX_BYTES, CodecError, decode, encode, pack, unpack
from protocol.identity import Identity, node_id_from_public_key, verify_signature

M = TypeVar("M", bound=BaseModel)
DEFAULT_TTL_S = 60.0
MAX_TTL_S = 3600.0


class EnvelopeError(ValueError):
    """A signed envelope that must be refused; `status` is the HTTP status to answer."""

    status = 401


class UntrustedSenderError(EnvelopeError):
    """Validly signed, but by a key not allowed to send this message."""

    status = 403


class ReplayError(EnvelopeError):
    """A (sender, nonce) pair seen before."""

    status = 409


class ReplayCacheFullError(EnvelopeError):
    """Too many live nonces to remember: the receiver is overloaded, try later."""

    status = 503


def signed_part(
    v: int, sender: bytes, nonce: bytes, expires: float, kind: str, body: bytes
) -> bytes:
    """The exact bytes an envelope's signature covers."""
    return pack([v, sender, nonce, expires, kind, body])


def seal(identity: Identity, message: BaseModel, ttl_s: float = DEFAULT_TTL_S) -> bytes:
    """Sign `message` with `identity` and return the envelope bytes."""
    return seal_body(identity, type(message).__name__, encode(message), ttl_s)


def seal_body(identity: Identity, kind: str, body: bytes, ttl_s: float = DEFAULT_TTL_S) -> bytes:
    """Sign an already encoded body of message type `kind` (tests use it to sign bad bodies)."""
    nonce = os.urandom(16)
    expires = time.time() + ttl_s
    sig = identity.sign(
        signed_part(PROTOCOL_VERSION, identity.public_key, nonce, expires, kind, body)
    )
    return pack(
        {
            "v": PROTOCOL_VERSION,
            "sender": identity.public_key,
            "nonce": nonce,
            "expires": expires,
            "kind": kind,
            "body": body,
            "sig": sig,
        }
    )


@dataclass(frozen=True)
class Opened(Generic[M]):
    """A verified envelope: who sent what, and until when it was valid."""

    message: M
    sender: bytes
    nonce: bytes
    expires: float

    @property
    def sender_id(self) -> str:
        return node_id_from_public_key(self.sender)


class ReplayCache:
    """Remembers (sender, nonce) pairs until their envelopes expire."""

    def __init__(self, clock: Callable[[], float] = time.time, max_entries: int = 1_000_000):
        self._seen: dict[tuple[bytes, bytes], float] = {}
        self._clock = clock
        self._max_entries = max_entries

    def check_and_add(self, sender: bytes, nonce: bytes, expires: float) -> None:
        now = self._clock()
        if len(self._seen) >= self._max_entries or len(self._seen) % 1024 == 0:
            self._seen = {k: e for k, e in self._seen.items() if e >= now}
        key = (sender, nonce)
        if key in self._seen:
            raise ReplayError("replayed message: this nonce was already used")
        if len(self._seen) >= self._max_entries:
            raise ReplayCacheFullError("replay cache is full; try again later")
        self._seen[key] = expires

    def __len__(self) -> int:
        return len(self._seen)


def open_envelope(
    data: bytes,
    model: type[M],
    *,
    replay_cache: ReplayCache | None = None,
    trusted_senders: set[bytes] | None = None,
    check_expiry: bool = True,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_ttl_s: float = MAX_TTL_S,
    clock: Callable[[], float] = time.time,
) -> Opened[M]:
    """Verify an envelope and decode its message, or raise `EnvelopeError`/`CodecError`.

    `check_expiry=False` is for re-checking a statement of authorship later (a rollout
    re-verified in a dispute); such a check must not use a replay cache.
    """
    env = unpack(data, max_bytes)
    if not isinstance(env, dict):
        raise CodecError("envelope must be a map")
    try:
        v, sender, nonce, expires = env["v"], env["sender"], env["nonce"], env["expires"]
        kind, body, sig = env["kind"], env["body"], env["sig"]
    except KeyError as exc:
        raise CodecError(f"envelope lacks field {exc.args[0]!r}") from exc
    if v != PROTOCOL_VERSION:
        raise CodecError(f"protocol version {v!r} is not supported (this is {PROTOCOL_VERSION})")
    if not (
        isinstance(sender, bytes)
        and len(sender) == 32
        and isinstance(nonce, bytes)
        and len(nonce) >= 8
        and isinstance(expires, int | float)
        and math.isfinite(expires)
        and isinstance(kind, str)
        and isinstance(body, bytes)
        and isinstance(sig, bytes)
    ):
        raise CodecError("envelope fields have wrong types")
    if kind != model.__name__:
        raise CodecError(f"expected a signed {model.__name__}, got {kind!r}")
    if not verify_signature(sender, sig, signed_part(v, sender, nonce, float(expires), kind, body)):
        raise EnvelopeError("bad signature")
    if trusted_senders is not None and sender not in trusted_senders:
        raise UntrustedSenderError(
            f"sender {node_id_from_public_key(sender)} is not trusted for {kind}"
        )
    now = clock()
    if check_expiry:
        if expires < now:
            raise EnvelopeError(f"expired {now - expires:.1f} s ago")
        if expires > now + max_ttl_s:
            raise EnvelopeError(f"expiry is more than {max_ttl_s:.0f} s ahead")
    if replay_cache is not None:
        replay_cache.check_and_add(sender, nonce, float(expires))
    return Opened(decode(body, model, max_bytes), sender, nonce, float(expires))
