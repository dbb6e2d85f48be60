"""The node channel's wire form: the one WebSocket a node opens to its scheduler, over
which the scheduler makes every call to that node (the scheduler never dials a node).

Frames are binary msgpack maps, in this order on a connection:
1. scheduler -> node: ``{"challenge": <32 random bytes>}``;
2. node -> scheduler: ``{"hello": <ChannelHello envelope signed by the node>}``, naming that
   challenge, so a recorded hello cannot open another connection;
3. then any number of calls, each a POST of a body to one of the node's routes:
   scheduler -> node ``{"id": n, "route": "/v1/...", "body": <bytes>}``, answered by
   node -> scheduler ``{"id": n, "status": <HTTP status>, "body": <bytes>}``, in any order.

Invariants:
- Every parse failure is a `CodecError`; a frame is refused before it is parsed when it
  is over the receiver's cap (aiohttp's `max_msg_size` on both ends).
- A route is an absolute path of the node's API (no scheme, host or `..`): the node
  answers it from its own server, so a frame can reach nothing else on the node's host.
"""

from __future__ import annotations

from protocol.codec import CodecError, pack, unpack

CONNECT_ROUTE = "/v1/nodes/connect"
CHALLENGE_BYTES = 32
# WebSocket close codes (4000-4999 are the application's own).
CLOSE_UNKNOWN_NODE = 4404  # not registered (or forgotten): register, then reconnect
CLOSE_REFUSED = 4403  # banned, left, wrong pool or a bad hello: do not come back as is
CLOSE_REPLACED = 4409  # the node opened a newer channel


def ws_url(http_url: str) -> str:
    """The channel's WebSocket URL at a scheduler's base URL (http -> ws, https -> wss)."""
    base = http_url.rstrip("/")
    if base.startswith("https://"):
        return "wss://" + base.removeprefix("https://") + CONNECT_ROUTE
    return "ws://" + base.removeprefix("http://") + CONNECT_ROUTE


def challenge_frame(challenge: bytes) -> bytes:
    return pack({"challenge": challenge})


def hello_frame(envelope: bytes) -> bytes:
    return pack({"hello": envelope})


def call_frame(call_id: int, route: str, body: bytes) -> bytes:
    return pack({"id": call_id, "route": route, "body": body})


def answer_frame(call_id: int, status: int, body: bytes) -> bytes:
    return pack({"id": call_id, "status": status, "body": body})


def _map(data: bytes, max_bytes: int, keys: dict[str, type]) -> dict:
    obj = unpack(data, max_bytes)
    if not isinstance(obj, dict) or obj.keys() != keys.keys():
        raise CodecError(f"channel frame must be a map with keys {sorted(keys)}")
    for key, kind in keys.items():
        # bool is an int subclass: refuse it where a number is meant.
        if not isinstance(obj[key], kind) or isinstance(obj[key], bool):
            raise CodecError(f"channel frame field {key!r} must be {kind.__name__}")
    return obj


def read_challenge(data: bytes, max_bytes: int) -> bytes:
    challenge = _map(data, max_bytes, {"challenge": bytes})["challenge"]
    if len(challenge) != CHALLENGE_BYTES:
        raise CodecError(f"a channel challenge is {CHALLENGE_BYTES} bytes, not {len(challenge)}")
    return challenge


def read_hello(data: bytes, max_bytes: int) -> bytes:
    return _map(data, max_bytes, {"hello": bytes})["hello"]


def read_call(data: bytes, max_bytes: int) -> tuple[int, str, bytes]:
    obj = _map(data, max_bytes, {"id": int, "route": str, "body": bytes})
    route = obj["route"]
    if not route.startswith("/") or route.startswith("//") or ".." in route or "?" in route:
        raise CodecError(f"channel route {route[:80]!r} is not a plain absolute path")
    return obj["id"], route, obj["body"]


def read_answer(data: bytes, max_bytes: int) -> tuple[int, int, bytes]:
    obj = _map(data, max_bytes, {"id": int, "status": int, "body": bytes})
    return obj["id"], obj["status"], obj["body"]
