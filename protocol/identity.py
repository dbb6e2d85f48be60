"""Node identity: one Ed25519 key pair per node, kept in a key file.

Invariants:
- The key file is created on first use with mode 0600 and never rewritten; a key file
  readable by group or others is refused.
- A node id is derived from the public key alone and is the libp2p peer id of the same
  key (base58 of the identity multihash of the protobuf-encoded public key, "12D3KooW..."),
  so a node has one id on HTTP and on libp2p.
"""

from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import base58
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from nacl.bindings import crypto_sign_open
from nacl.exceptions import BadSignatureError

# protobuf PublicKey{Type: Ed25519 (1), Data: <32 bytes>} then multihash "identity" (0x00, len).
_PROTO_ED25519_PREFIX = b"\x08\x01\x12\x20"
_MULTIHASH_IDENTITY_PREFIX = b"\x00\x24"


class IdentityError(ValueError):
    """A key file or public key that cannot be used."""


@functools.lru_cache(maxsize=65536)
def node_id_from_public_key(public_key: bytes) -> str:
    """The node id (libp2p peer id) of a raw 32-byte Ed25519 public key."""
    if len(public_key) != 32:
        raise IdentityError(f"an Ed25519 public key is 32 bytes, got {len(public_key)}")
    return base58.b58encode(
        _MULTIHASH_IDENTITY_PREFIX + _PROTO_ED25519_PREFIX + public_key
    ).decode()


def public_key_from_node_id(node_id: str) -> bytes:
    """Inverse of `node_id_from_public_key`."""
    try:
        raw = base58.b58decode(node_id)
    except ValueError as exc:
        raise IdentityError(f"not a node id: {node_id!r}") from exc
    prefix = _MULTIHASH_IDENTITY_PREFIX + _PROTO_ED25519_PREFIX
    if len(raw) != len(prefix) + 32 or not raw.startswith(prefix):
        raise IdentityError(f"not an Ed25519 node id: {node_id!r}")
    return raw[len(prefix) :]


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True when `signature` is `public_key`'s Ed25519 signature of `data`.

    libsodium (PyNaCl) verifies about twice as fast as OpenSSL here, and verification is
    the scheduler's largest CPU cost per message; signatures are the same Ed25519 either way.
    """
    if len(public_key) != 32 or len(signature) != 64:
        return False
    try:
        crypto_sign_open(signature + data, public_key)
    except (BadSignatureError, ValueError, TypeError):
        return False
    return True


@dataclass(frozen=True)
class Identity:
    """An Ed25519 key pair and the node id derived from it."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """A deterministic identity from 32 raw private-key bytes (tests, libp2p bridging)."""
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def load_or_create(cls, path: str | Path) -> Identity:
        """Load the key file at `path`, creating it (mode 0600) on first use."""
        path = Path(path).expanduser()
        if path.exists():
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode & 0o077:
                raise IdentityError(
                    f"key file {path} has mode {mode:o}; it must be private: chmod 600 {path}"
                )
            raw = path.read_bytes()
            if len(raw) != 32:
                raise IdentityError(f"key file {path} must hold 32 raw bytes, has {len(raw)}")
            return cls.from_seed(raw)
        path.parent.mkdir(parents=True, exist_ok=True)
        identity = cls.generate()
        # O_EXCL: two processes racing on first start must not both write a key.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.seed)
        return identity

    @property
    def seed(self) -> bytes:
        return self.private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    @functools.cached_property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @functools.cached_property
    def node_id(self) -> str:
        return node_id_from_public_key(self.public_key)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)
