"""Pool configs and invites: what the pool owner signs.

A pool file is the owner-signed envelope of a `PoolConfig` (msgpack); the scheduler
serves it untouched at GET /v1/pool so every node can check the owner's signature
itself. An invite is the owner-signed envelope of an `Invite`, base64url-encoded so it
can be pasted on a command line; its envelope expiry is the invite's expiry. An API key
to the pool's OpenAI endpoint is the owner-signed envelope of an `ApiKey`, encoded the
same way behind the prefix `psk-`.

Invariants: a pool file whose signature does not verify is never loaded; an invite is
admitted only if signed by the pool's owner, for this pool, unexpired, bound to the
presenting node (when bound), and never used before (the caller records its use); an
API key opens the endpoint only if signed by the pool's owner, for this pool, unexpired.
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass
from pathlib import Path

from protocol.codec import CodecError
from protocol.envelope import EnvelopeError, open_envelope, seal
from protocol.identity import Identity
from protocol.messages import ApiKey, Invite, PoolConfig

# A pool config is a long-lived statement: its envelope never expires in practice.
POOL_TTL_S = 100 * 365 * 24 * 3600.0


class PoolError(ValueError):
    """A pool file or invite that cannot be used; the message says why."""


@dataclass(frozen=True)
class SignedPool:
    config: PoolConfig
    owner_key: bytes
    envelope: bytes


def sign_pool(owner: Identity, config: PoolConfig) -> bytes:
    return seal(owner, config, ttl_s=POOL_TTL_S)


def open_pool(envelope: bytes) -> SignedPool:
    try:
        opened = open_envelope(envelope, PoolConfig, check_expiry=False)
    except (EnvelopeError, CodecError) as exc:
        raise PoolError(f"pool config is not a valid owner-signed PoolConfig: {exc}") from exc
    return SignedPool(opened.message, opened.sender, envelope)


def write_pool(path: Path, owner: Identity, config: PoolConfig) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(sign_pool(owner, config))
    return path


def read_pool(path: Path) -> SignedPool:
    return open_pool(Path(path).read_bytes())


def make_invite(owner: Identity, pool_id: str, ttl_s: float, node_id: str = "") -> str:
    invite = Invite(pool_id=pool_id, invite_id=secrets.token_hex(12), node_id=node_id)
    return base64.urlsafe_b64encode(seal(owner, invite, ttl_s=ttl_s)).decode()


def check_invite(envelope: bytes, pool: SignedPool, node_id: str) -> Invite:
    """The invite inside `envelope` if it admits `node_id` to `pool` (use is not recorded here)."""
    try:
        opened = open_envelope(
            envelope, Invite, trusted_senders={pool.owner_key}, max_ttl_s=POOL_TTL_S
        )
    except (EnvelopeError, CodecError) as exc:
        raise PoolError(f"invite refused: {exc}") from exc
    invite = opened.message
    if invite.pool_id != pool.config.pool_id:
        raise PoolError(f"invite is for pool {invite.pool_id!r}, not {pool.config.pool_id!r}")
    if invite.node_id and invite.node_id != node_id:
        raise PoolError("invite is bound to another node id")
    return invite


API_KEY_PREFIX = "psk-"


def make_api_key(
    owner: Identity, pool_id: str, name: str, ttl_s: float, rate_per_s: float, burst: int
) -> str:
    key = ApiKey(
        pool_id=pool_id,
        key_id=secrets.token_hex(8),
        name=name,
        rate_per_s=rate_per_s,
        burst=burst,
    )
    return API_KEY_PREFIX + base64.urlsafe_b64encode(seal(owner, key, ttl_s=ttl_s)).decode()


def check_api_key(token: str, pool: SignedPool) -> ApiKey:
    """The `ApiKey` inside a bearer token if it opens `pool`'s endpoint now."""
    if not token.startswith(API_KEY_PREFIX):
        raise PoolError("not a pool API key (they start with 'psk-')")
    try:
        envelope = base64.urlsafe_b64decode(token.removeprefix(API_KEY_PREFIX))
        opened = open_envelope(
            envelope, ApiKey, trusted_senders={pool.owner_key}, max_ttl_s=POOL_TTL_S
        )
    except (EnvelopeError, CodecError, ValueError) as exc:
        raise PoolError(f"API key refused: {exc}") from exc
    if opened.message.pool_id != pool.config.pool_id:
        raise PoolError(f"API key is for pool {opened.message.pool_id!r}")
    return opened.message
