"""Versioned msgpack codec for internal bodies, with a size cap.

Wire form: a msgpack map ``{"v": <protocol version>, "t": <message type>, "b": <fields>}``.

Invariants:
- `decode` refuses bodies over the cap *before* parsing them, refuses an unknown version
  or an unexpected message type, and turns every parse or validation failure into one
  exception type, `CodecError`, whose message is fit for a 4xx answer.
- Encoding is canonical for a given model (same fields, same order), so a digest of the
  encoded bytes identifies a message.
"""

from __future__ import annotations

from typing import TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

from protocol import PROTOCOL_VERSION

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
M = TypeVar("M", bound=BaseModel)


class CodecError(ValueError):
    """A body that cannot be decoded into the expected message."""


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> object:
    if len(data) > max_bytes:
        raise CodecError(f"body of {len(data)} bytes exceeds the cap of {max_bytes} bytes")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=max_bytes)
    except Exception as exc:  # msgpack raises several unrelated types
        raise CodecError(f"malformed msgpack: {exc}") from exc


def encode(message: BaseModel) -> bytes:
    """Encode a message model into the versioned wire form."""
    return pack(
        {"v": PROTOCOL_VERSION, "t": type(message).__name__, "b": message.model_dump(mode="python")}
    )


def decode(data: bytes, model: type[M], max_bytes: int = DEFAULT_MAX_BYTES) -> M:
    """Decode `data` as a `model` message, or raise `CodecError`."""
    obj = unpack(data, max_bytes)
    if not isinstance(obj, dict) or not {"v", "t", "b"} <= obj.keys():
        raise CodecError("body must be a map with keys 'v', 't' and 'b'")
    if obj["v"] != PROTOCOL_VERSION:
        raise CodecError(
            f"protocol version {obj['v']!r} is not supported (this is {PROTOCOL_VERSION})"
        )
    if obj["t"] != model.__name__:
        raise CodecError(f"expected a {model.__name__} message, got {obj['t']!r}")
    try:
        return model.model_validate(obj["b"])
    except ValidationError as exc:
        raise CodecError(f"invalid {model.__name__}: {_brief(exc)}") from exc


def _brief(exc: ValidationError) -> str:
    parts = [f"{'.'.join(map(str, e['loc'])) or '<body>'}: {e['msg']}" for e in exc.errors()[:5]]
    return "; ".join(parts)
