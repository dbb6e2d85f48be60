"""The peer wire protocol: message kinds and length-prefixed framing on a libp2p stream.

One bidirectional stream per (peer, version) carries frames of a 4-byte big-endian length
and a msgpack array `[kind, index, data, peers]`. Kinds follow BitTorrent: a handshake
naming the manifest hash, the bitfield of pieces held, `have` news, request / piece /
cancel, choke / unchoke, interested / not interested, plus peer exchange (`peers`).

Invariants: a frame longer than the receiver's cap is refused before it is read (so a peer
cannot make another buffer gigabytes); every byte read or written passes through the
node's rate limiter when it has one; a peer that dies mid-frame shows as `WireError`
(never as a short piece: pieces are also hash-checked).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum

import msgpack

from protocol.swarm.ratelimit import TokenBucket

PROTOCOL_ID = "/prime-swarm/weights/1.0.0"
CONTROL_FRAME_MAX = 1 << 20  # every frame but a piece fits in this
CHUNK = 64 * 1024  # write/read granularity (and rate-limiter grain)


class WireError(IOError):
    """The peer broke the protocol or the stream ended."""


class Kind(IntEnum):
    HANDSHAKE = 0  # data: manifest hash (32 bytes)
    BITFIELD = 1  # data: one bit per piece, piece 0 in the high bit of byte 0
    HAVE = 2  # index
    REQUEST = 3  # index
    PIECE = 4  # index, data
    CANCEL = 5  # index
    CHOKE = 6
    UNCHOKE = 7
    INTERESTED = 8
    NOT_INTERESTED = 9
    PEERS = 10  # peers: [[peer_id, [multiaddr, ...]], ...]


@dataclass(frozen=True)
class Msg:
    kind: Kind
    index: int = -1
    data: bytes = b""
    peers: list[tuple[str, list[str]]] = field(default_factory=list)


def pack_bits(bits: list[bool]) -> bytes:
    out = bytearray((len(bits) + 7) // 8)
    for i, b in enumerate(bits):
        if b:
            out[i >> 3] |= 0x80 >> (i & 7)
    return bytes(out)


def unpack_bits(data: bytes, n: int) -> list[bool]:
    if len(data) != (n + 7) // 8:
        raise WireError(f"bitfield of {len(data)} bytes for {n} pieces")
    return [bool(data[i >> 3] & (0x80 >> (i & 7))) for i in range(n)]


def encode(msg: Msg) -> bytes:
    body = msgpack.packb([int(msg.kind), msg.index, msg.data, msg.peers], use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def decode(body: bytes) -> Msg:
    try:
        kind, index, data, peers = msgpack.unpackb(body, raw=False)
        msg = Msg(Kind(kind), int(index), bytes(data), [(str(p), list(a)) for p, a in peers])
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise WireError(f"malformed frame: {exc}") from exc
    return msg


async def write(stream, msg: Msg, limiter: TokenBucket | None = None) -> None:
    frame = encode(msg)
    try:
        for pos in range(0, len(frame), CHUNK):
            chunk = frame[pos : pos + CHUNK]
            if limiter is not None:
                await limiter.take(len(chunk))
            await stream.write(chunk)
    except Exception as exc:  # libp2p raises its own stream errors
        raise WireError(f"write failed: {exc!r}") from exc


class FrameReader:
    """Reads whole frames from a stream that returns arbitrary slices."""

    def __init__(self, stream, limiter: TokenBucket | None = None):
        self.stream = stream
        self.limiter = limiter
        self.buf = bytearray()

    async def _fill(self, n: int) -> None:
        while len(self.buf) < n:
            want = min(CHUNK, n - len(self.buf))
            if self.limiter is not None:
                await self.limiter.take(want)
            try:
                data = await self.stream.read(want)
            except Exception as exc:
                raise WireError(f"stream ended: {exc!r}") from exc
            if not data:
                raise WireError("stream ended")
            self.buf += data

    async def read(self, max_frame: int) -> Msg:
        await self._fill(4)
        (n,) = struct.unpack(">I", self.buf[:4])
        if n > max_frame:
            raise WireError(f"frame of {n} bytes exceeds the {max_frame}-byte cap")
        await self._fill(4 + n)
        body = bytes(self.buf[4 : 4 + n])
        del self.buf[: 4 + n]
        return decode(body)
