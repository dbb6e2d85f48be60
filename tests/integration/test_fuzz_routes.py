"""Fuzz every HTTP route of a real node and of a real pool's scheduler with generated input.

What this proves (DESIGN.md section 3, "Bad input"): whatever arrives on any route of
`prime-node serve` or `prime-scheduler serve` (garbage bytes, JSON of any shape, OpenAI
bodies with out-of-range or odd-typed fields, deep nesting, huge integers, lone
surrogates, wrong content types, garbage and truncated msgpack envelopes, envelopes
validly signed around bad messages, odd path parameters, wrong methods), the process
answers with a JSON 4xx carrying `error` (or a success), never with a 5xx other than a
JSON 503 that says the pool is saturated / has no node / asks to retry, never drops the
connection without an answer, and keeps serving: after the run both processes are alive
and answer a valid request (a real chat completion on the node, `GET /health` and a real
chat completion on the scheduler).

Processes: a standalone tiny-model node (`tests.nodes.start_node`) and a pool
(`tests.pools.make_pool`): a scheduler and two `prime-node join` workers (the scheduler's
OpenAI front answers only once a second node verified the rollout). Every route is listed
in `ROUTES`; `test_route_table_covers_every_route` checks that against the routes the two
aiohttp apps register. The quick variant sends a few hundred inputs; the `slow` one over
10,000. Per-route status counts, input counts, time and RSS growth of every process go to
the `report` fixture. A partial body (slow loris) must be cut off by the body-read timeout
(`protocol.http.body_timeout_middleware`), in-process and in the real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gzip
import json
import re
import socket
import time
import uuid
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote_from_bytes

import httpx
import msgpack
import psutil
import pytest
from aiohttp import web
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from protocol import PROTOCOL_VERSION
from protocol.codec import CodecError, pack
from protocol.envelope import seal, seal_body
from protocol.http import (
    JSON_INT_MAX,
    MAX_JSON_DEPTH,
    body_timeout_middleware,
    error_middleware,
    parse_json,
    read_json,
)
from protocol.identity import Identity
from protocol.messages import (
    Deregister,
    Heartbeat,
    RegisterRequest,
    ResultsQuery,
    RolloutRequest,
    RolloutSpec,
    SamplingParams,
    SubmitRollouts,
    SwarmAnnounce,
    VerifyRequest,
    WeightReload,
    WeightUpdate,
)
from protocol.processes import ManagedProcess, free_port
from tests.channel_fakes import FakeChannel
from tests.nodes import NodeProcess, start_node
from tests.pools import Pool, make_pool
from verifier.models import resolve_model

BodyKind = Literal["json", "openai-json", "msgpack-envelope", "none"]
OpenAIKind = Literal["chat", "completion", "tokenize", ""]
BODY_READ_TIMEOUT_S = 2.0
"""Body-read timeout the processes get when their config has the field (see below)."""


@dataclass(frozen=True)
class Route:
    target: Literal["node", "scheduler"]
    method: str
    path: str
    """aiohttp's template, e.g. /v1/rollouts/{rollout_id}."""
    body: BodyKind
    message: str = ""
    """The signed message type of a msgpack-envelope route."""
    openai: OpenAIKind = ""

    @property
    def key(self) -> str:
        return f"{self.target} {self.method} {self.path}"


ROUTES: tuple[Route, ...] = (
    # node/server.py NodeServer.app()
    Route("node", "GET", "/health", "none"),
    Route("node", "GET", "/v1/models", "none"),
    Route("node", "POST", "/v1/completions", "openai-json", openai="completion"),
    Route("node", "POST", "/v1/chat/completions", "openai-json", openai="chat"),
    Route("node", "POST", "/tokenize", "openai-json", openai="tokenize"),
    Route("node", "POST", "/v1/rollouts", "msgpack-envelope", "RolloutRequest"),
    Route("node", "GET", "/v1/rollouts/{rollout_id}", "none"),
    Route("node", "POST", "/v1/verify", "msgpack-envelope", "VerifyRequest"),
    Route("node", "POST", "/v1/weights/update", "msgpack-envelope", "WeightUpdate"),
    Route("node", "POST", "/v1/weights/reload", "msgpack-envelope", "WeightReload"),
    # scheduler/server.py SchedulerServer.app()
    Route("scheduler", "GET", "/health", "none"),
    Route("scheduler", "GET", "/v1/pool", "none"),
    Route("scheduler", "POST", "/v1/nodes/register", "msgpack-envelope", "RegisterRequest"),
    Route("scheduler", "POST", "/v1/nodes/heartbeat", "msgpack-envelope", "Heartbeat"),
    Route("scheduler", "POST", "/v1/nodes/deregister", "msgpack-envelope", "Deregister"),
    # The node channel's WebSocket (tests/integration/test_node_channel.py speaks it); a
    # plain request, whatever it carries, gets a 4xx.
    Route("scheduler", "GET", "/v1/nodes/connect", "none"),
    Route("scheduler", "POST", "/v1/rollouts/submit", "msgpack-envelope", "SubmitRollouts"),
    Route("scheduler", "POST", "/v1/rollouts/results", "msgpack-envelope", "ResultsQuery"),
    Route("scheduler", "POST", "/v1/weights", "msgpack-envelope", "WeightUpdate"),
    Route("scheduler", "POST", "/v1/swarm/announce", "msgpack-envelope", "SwarmAnnounce"),
    # scheduler OpenAI routes (scheduler/openai_front.py, formerly openai_proxy.py)
    Route("scheduler", "GET", "/v1/models", "none"),
    Route("scheduler", "POST", "/v1/chat/completions", "openai-json", openai="chat"),
    Route("scheduler", "POST", "/v1/completions", "openai-json", openai="completion"),
    Route("scheduler", "POST", "/tokenize", "openai-json", openai="tokenize"),
    # scheduler/dashboard.py and scheduler/metrics.py
    Route("scheduler", "GET", "/dashboard", "none"),
    Route("scheduler", "GET", "/v1/dashboard/state", "none"),
    Route("scheduler", "GET", "/metrics", "none"),
)

MSGPACK = "application/msgpack"
OTHER_METHODS = ("PUT", "DELETE", "PATCH", "OPTIONS", "POST", "GET", "HEAD")
# A 503 is legitimate (saturation, no node, standby) when its JSON says so or asks to retry.
LEGIT_503 = re.compile(r"saturat|no node|standby|retry|busy|full|capacity", re.I)


# -- the route table against the apps --------------------------------------------------------
def registered_routes(tmp_path: Path) -> set[tuple[str, str, str]]:
    """(target, method, path template) of every route the two aiohttp apps register (HEAD
    twins of GET routes left out), from the real classes, without starting anything."""
    from node.server import NodeServer
    from scheduler.config import SchedulerConfig
    from scheduler.server import SchedulerServer

    node = NodeServer(
        None,  # type: ignore[arg-type]  # app() only registers handlers
        model_name="tiny",
        trusted_keys=[],
        max_body_bytes=1 << 20,
        max_concurrent=1,
        rollout_cache_size=1,
    )
    pool = make_pool(tmp_path)
    cfg = SchedulerConfig(
        pool_file=pool.pool_file,
        key_file=tmp_path / "scheduler.key",
        database={"url": f"sqlite+aiosqlite:///{tmp_path / 'routes.db'}"},
        log_dir=tmp_path / "logs",
    )
    scheduler = SchedulerServer(cfg, Identity.load_or_create(tmp_path / "scheduler.key"))
    found = set()
    for target, app in (("node", node.app()), ("scheduler", scheduler.app())):
        for r in app.router.routes():
            if r.method != "HEAD":
                found.add((target, r.method, r.resource.canonical))
    return found


def test_route_table_covers_every_route(tmp_path: Path) -> None:
    table = {(r.target, r.method, r.path) for r in ROUTES}
    registered = registered_routes(tmp_path)
    assert not registered - table, f"routes missing from ROUTES: {sorted(registered - table)}"
    assert not table - registered, (
        f"ROUTES lists routes nobody serves: {sorted(table - registered)}"
    )


# -- protocol.http in-process ----------------------------------------------------------------
def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


READ_JSON_REFUSED: dict[str, bytes] = {
    "nested 100,000 deep": b"[" * 100_000,
    "nested 100,000 deep, closed": _deep(100_000),
    "nested within the parser's limit, over ours": _deep(900),
    "object nested over our limit": b'{"a":' * (MAX_JSON_DEPTH + 1)
    + b"1"
    + b"}" * (MAX_JSON_DEPTH + 1),
    "int of 4,301 digits": b'{"max_tokens": ' + b"9" * 4301 + b"}",
    "int of 100,000 digits": b'{"top_k": -' + b"1" * 100_000 + b"}",
    "top_k above 2**64-1": b'{"top_k": %d}' % (JSON_INT_MAX + 1),
    "int below -2**63": b'{"seed": %d}' % (-(2**63) - 1),
    "id over 2**64-1 in a prompt": b'{"prompt": [1, 2, %d]}' % (JSON_INT_MAX + 1),
    "infinity in a list of ids": b'{"prompt": [1, 2, 1e999]}',
    "lone surrogate after ids": b'{"prompt": [1, 2, "\\ud800"]}',
    "lone surrogate escape in a prompt": b'{"prompt": "ab\\ud800cd"}',
    "lone low surrogate in a message": b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
    "lone surrogate in stop": b'{"stop": ["\\ud83d"]}',
    "lone surrogate in a key": b'{"\\ud800": 1}',
    "lone surrogate deep in a list": b'{"a": [[[["x", "\\udc00"]]]]}',
    "surrogate as raw UTF-8 bytes": b'{"prompt": "\xed\xa0\x80"}',
    "invalid UTF-8": b'{"prompt": "\xff\xfe\x80"}',
    "NaN": b'{"temperature": NaN}',
    "Infinity": b'{"top_p": -Infinity}',
    "float overflow": b'{"temperature": 1e999}',
    "empty": b"",
    "not JSON": b"\x00\x01garbage",
    "truncated": b'{"messages": [{"role": "us',
    "not an object": b"[1, 2, 3]",
}


@pytest.mark.parametrize("case", list(READ_JSON_REFUSED))
def test_read_json_refuses_what_no_handler_may_see(case: str) -> None:
    with pytest.raises(CodecError):
        body = parse_json(READ_JSON_REFUSED[case])
        if not isinstance(body, dict):
            raise CodecError("not an object")  # read_json's own rule, checked below


def test_read_json_keeps_what_is_valid() -> None:
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "héllo 🙂 中文"}]}],
        "top_k": JSON_INT_MAX,
        "seed": -(2**63),
        "top_p": 1e-300,
        "stop": ["\ud83d\ude42"],  # a *pair* of surrogates is one character
    }
    raw = json.dumps(body).encode()
    assert parse_json(raw) == {**body, "stop": ["🙂"]}
    assert parse_json(b"\xef\xbb\xbf{}") == {}  # a UTF-8 BOM
    assert parse_json('{"a": "ü"}'.encode("utf-16")) == {"a": "ü"}  # RFC 8259 detection
    assert parse_json(b'{"p": [1, true, 2.5, 1e300, null]}') == {"p": [1, True, 2.5, 1e300, None]}
    nested = b'{"a":' * (MAX_JSON_DEPTH - 1) + b"1" + b"}" * (MAX_JSON_DEPTH - 1)
    assert isinstance(parse_json(nested), dict)


@contextlib.asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield port
    finally:
        await runner.cleanup()


def _partial_body_request(path: str, content_type: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
        "Content-Length: 1000\r\n\r\n"
    ).encode() + b'{"prompt":'


def slow_loris(port: int, path: str, content_type: str, wait_s: float) -> tuple[float, bytes]:
    """Send headers announcing 1000 body bytes and only 10 of them; return (seconds until the
    server answered or closed, what it sent) or raise TimeoutError after `wait_s`."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(_partial_body_request(path, content_type))
        got = b""
        s.settimeout(wait_s)
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
                if b"\r\n\r\n" in got and got.startswith(b"HTTP/1.1 408"):
                    break
        except TimeoutError:
            if not got:
                raise
    return time.monotonic() - start, got


async def test_body_timeout_middleware_answers_408_and_read_json_400() -> None:
    import logging

    log = logging.getLogger("test.fuzz")

    async def echo(request: web.Request) -> web.Response:
        return web.json_response(await read_json(request))

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(0.8)  # past the body-read timeout: only the body is timed
        return web.json_response(await read_json(request))

    async def times_out(_request: web.Request) -> web.Response:
        async with asyncio.timeout(0.01):
            await asyncio.sleep(1)
        return web.json_response({})

    async def crash(_request: web.Request) -> web.Response:
        raise KeyError("boom")

    app = web.Application(middlewares=[error_middleware(log), body_timeout_middleware(0.5, log)])
    app.add_routes(
        [
            web.post("/echo", echo),
            web.post("/slow", slow),
            web.get("/timeout", times_out),
            web.get("/crash", crash),
        ]
    )
    async with serve_app(app) as port:
        took, got = await asyncio.to_thread(slow_loris, port, "/echo", "application/json", 5.0)
        assert got.startswith(b"HTTP/1.1 408"), got
        assert took < 2.0, took
        body = json.loads(got.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == 408
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for raw in READ_JSON_REFUSED.values():
                resp = await client.post("/echo", content=raw)
                assert resp.status_code == 400, (raw[:60], resp.text)
                assert resp.json()["error"]["message"]
            ok = await client.post("/echo", json={"a": [1, "é"]})
            assert ok.status_code == 200 and ok.json() == {"a": [1, "é"]}
            slow_ok = await client.post("/slow", json={"b": 2})
            assert slow_ok.status_code == 200 and slow_ok.json() == {"b": 2}
            resp = await client.get("/timeout")
            assert resp.status_code == 504 and resp.json()["error"]["type"] == "timeout"
            resp = await client.get("/crash")
            assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"


# -- the processes -------------------------------------------------------------------------
# Short, so the slow-loris checks finish quickly.
SERVER_FLAGS = ("--server.body-read-timeout-s", str(BODY_READ_TIMEOUT_S))


@dataclass
class Target:
    name: Literal["node", "scheduler"]
    url: str
    child: ManagedProcess

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@dataclass
class Context:
    """What the strategies need from the running processes."""

    node_pool_id: str
    pool_id: str
    prompt_ids: list[int]
    rollout_id: str
    rollout_envelope: bytes
    trainer: Identity
    fuzz_node: Identity
    api_key: str
    bad_api_keys: list[str]
    vocab: int = 100


@dataclass
class Processes:
    node: Target
    scheduler: Target
    workers: dict[str, ManagedProcess]
    ctx: Context
    logs: list[Path] = field(default_factory=list)

    def targets(self) -> dict[str, Target]:
        return {"node": self.node, "scheduler": self.scheduler}


def _chat(max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        **extra,
    }


def _api_keys(pool: Pool) -> tuple[str, list[str]]:
    from scheduler.pool import make_api_key

    good = make_api_key(pool.owner, pool.pool_id, "fuzz", 3600, 100_000, 1_000_000)
    bad = [
        "",
        "Bearer",
        "Bearer psk-",
        "Bearer psk-!!!notbase64",
        "Bearer sk-openai-style",
        "Bearer " + make_api_key(pool.owner, "other-pool", "x", 3600, 10, 10),
        "Bearer " + make_api_key(Identity.generate(), pool.pool_id, "forged", 3600, 10, 10),
        "Basic dXNlcjpwYXNz",
        "Bearer " + good[:-7],
    ]
    return good, bad


@pytest.fixture(scope="module")
def processes(tmp_path_factory) -> Iterator[Processes]:
    work = tmp_path_factory.mktemp("fuzz")
    trainer = Identity.load_or_create(work / "pool" / "trainer.key")
    tiny = resolve_model("tiny")
    node: NodeProcess | None = None
    pool = make_pool(work / "pool")
    try:
        pool.start_scheduler(
            "--openai.tokenizer",
            str(tiny),
            "--dispatch.generate-timeout-s",
            "10",
            "--dispatch.openai-timeout-s",
            "20",
            *SERVER_FLAGS,
        )
        pool.join("w0", wait=False)  # start-up is mostly imports: overlap them
        pool.join("w1", wait=False)
        node = start_node(
            work / "node",
            "node",
            "--engine.model",
            "tiny",
            "--trusted-keys",
            f'["{trainer.node_id}"]',
            *SERVER_FLAGS,
        )
        pool.wait_joined("w0")
        pool.wait_joined("w1")
        assert pool.scheduler is not None
        good_key, bad_keys = _api_keys(pool)
        first = httpx.post(f"{node.url}/v1/chat/completions", json=_chat(), timeout=60)
        assert first.status_code == 200, first.text
        rollout_id = first.json()["rollout_id"]
        envelope = httpx.get(f"{node.url}/v1/rollouts/{rollout_id}", timeout=10)
        assert envelope.status_code == 200
        tokens = httpx.post(f"{node.url}/tokenize", json={"prompt": "hello world"}, timeout=10)
        assert tokens.status_code == 200, tokens.text
        ctx = Context(
            node_pool_id="local",
            pool_id=pool.pool_id,
            prompt_ids=tokens.json()["tokens"],
            rollout_id=rollout_id,
            rollout_envelope=envelope.content,
            trainer=trainer,
            fuzz_node=Identity.generate(),
            api_key=good_key,
            bad_api_keys=bad_keys,
        )
        procs = Processes(
            Target("node", node.url, node.child),
            Target("scheduler", pool.url, pool.scheduler),
            pool.nodes,
            ctx,
            logs=[
                node.log_path,
                pool.scheduler.log_path,
                *(c.log_path for c in pool.nodes.values()),
            ],
        )
        yield procs
    finally:
        if node is not None:
            node.stop()
        pool.close()


# -- strategies ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Raw:
    """JSON text sent verbatim (numbers json.dumps cannot write: 5,000 digits, NaN)."""

    text: str


def dumps(obj: object, ascii_only: bool) -> str:
    if isinstance(obj, Raw):
        return obj.text
    if isinstance(obj, dict):
        items = (
            f"{json.dumps(str(k), ensure_ascii=ascii_only)}:{dumps(v, ascii_only)}"
            for k, v in obj.items()
        )
        return "{" + ",".join(items) + "}"
    if isinstance(obj, list | tuple):
        return "[" + ",".join(dumps(v, ascii_only) for v in obj) + "]"
    return json.dumps(obj, ensure_ascii=ascii_only, allow_nan=True)


def to_body(obj: object, ascii_only: bool) -> bytes:
    # Lone surrogates: escaped (\ud800) with ascii_only, else raw (invalid UTF-8 bytes).
    return dumps(obj, ascii_only).encode("utf-8", "surrogatepass")


def mostly(common: st.SearchStrategy, rare: st.SearchStrategy, rare_in_10: int = 2):
    """`common`, except `rare` about `rare_in_10` times in ten (one_of weighs branches
    evenly, sampled_from weighs by repetition)."""
    flips = [False] * (10 - rare_in_10) + [True] * rare_in_10
    return st.sampled_from(flips).flatmap(lambda rare_one: rare if rare_one else common)


def lone_surrogate_text() -> st.SearchStrategy[str]:
    return st.builds(
        lambda a, c, b: a + chr(c) + b,
        st.text(max_size=4),
        st.integers(0xD800, 0xDFFF),
        st.text(max_size=4),
    )


TEXT = st.one_of(
    st.text(max_size=24),
    st.sampled_from(
        ["", "hello", " ", "\x00", "é中文🙂", "<|im_start|>", "<|im_end|>", "{{ 7*7 }}", "{% if %}"]
    ),
    st.sampled_from(["a" * 5000, "\u202e" * 50, "\ufeff", "\U0010ffff"]),
    lone_surrogate_text(),
)
HUGE = st.sampled_from(
    [
        2**31,
        2**53 + 1,
        2**63 - 1,
        2**63,
        2**64 - 1,
        2**64,
        10**30,
        -(2**63) - 1,
        Raw("9" * 4301),
        Raw("-" + "9" * 5000),
        Raw("1" * 400),
        Raw("1e999"),
        Raw("-1e999"),
        Raw("NaN"),
        Raw("Infinity"),
        Raw("-0"),
        Raw("1E+2"),
    ]
)
JSON_ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    HUGE,
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e-300, 5e-324, -0.0, 1e308, 0.5]),
    TEXT,
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    JSON_ANY,
)


def field_of(*valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a valid-looking value, sometimes an out-of-range or odd-typed one."""
    return mostly(st.one_of(*valid), ODD, 3)


SMALL_MAX_TOKENS = st.integers(1, 6)
MAX_TOKENS = mostly(
    SMALL_MAX_TOKENS,
    st.sampled_from(
        [0, -1, 65537, 2**31, 2**63, 2**64 - 1, 2**64, 10**30, Raw("9" * 5000)]
        + ["4", 4.0, 4.5, True, [], {}, Raw("NaN"), Raw("1e999")]
    ),
    3,
)
SAMPLING_FIELDS: dict[str, st.SearchStrategy] = {
    "temperature": field_of(
        st.sampled_from([0, 0.0, 0.5, 1, 1.0, 2, 10]),
        st.floats(0, 10),
        st.sampled_from([-1, 10.0001, 11, 1e-300, 5e-324, Raw("NaN"), Raw("-Infinity"), "1"]),
    ),
    "top_p": field_of(
        st.sampled_from([1, 1.0, 0.9, 1e-300, 5e-324]),
        st.floats(1e-300, 1),
        st.sampled_from([0, -0.0, -0.1, 1.0000001, 2, Raw("NaN")]),
    ),
    "top_k": field_of(
        st.sampled_from([-1, 0, 1, 2, 5, 50, 2**31 - 1]),
        st.sampled_from([-2, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, Raw("9" * 4400)]),
    ),
    "max_tokens": MAX_TOKENS,
    "stop": field_of(
        st.none(),
        TEXT,
        st.lists(TEXT, max_size=9),
        st.lists(lone_surrogate_text(), min_size=1, max_size=2),
        st.sampled_from([[1, 2], ["a"] * 100, ["x" * 200], [""], [None]]),
    ),
    "n": field_of(st.sampled_from([1, 1, 1, 2, 3]), st.sampled_from([0, -1, 17, 2**64, "1", 1.0])),
    "stream": field_of(st.booleans()),
    "stream_options": field_of(
        st.sampled_from([None, {"include_usage": True}, {"include_usage": "x"}, {"other": 1}, []])
    ),
    "seed": field_of(
        st.sampled_from([None, 0, 1, 2**63 - 1]),
        st.sampled_from([-1, 2**63, 2**64 - 1, 2**64, "1", 1.5]),
    ),
    "ignore_eos": field_of(st.booleans()),
    "model": field_of(st.sampled_from(["tiny", "", "gpt-4"]), st.text(max_size=300)),
    "request_id": field_of(
        st.text(alphabet="abcdef0123456789-", min_size=1, max_size=24),
        st.sampled_from(["", "x" * 129, "a/b", "../x", "%00"]),
        lone_surrogate_text(),
    ),
    "min_version": field_of(st.sampled_from([0, 1, -1, 2**64, "0"])),
    "presence_penalty": st.sampled_from([0, 0.5, -2, "x"]),
    "frequency_penalty": st.sampled_from([0, 1]),
    "min_p": st.sampled_from([0, 0.1]),
    "echo": st.sampled_from([False, True, "no"]),
    "logit_bias": st.sampled_from([None, {"1": 100}, {}]),
    "tools": st.sampled_from([None, [], [{"type": "function"}]]),
    "response_format": st.sampled_from([None, {"type": "json_object"}]),
    "user": TEXT,
}
OPTIONAL_SAMPLING = {k: v for k, v in SAMPLING_FIELDS.items() if k != "max_tokens"}

ROLE = st.one_of(
    st.sampled_from(["user", "user", "system", "assistant"]),
    st.sampled_from(["tool", "developer", "function", "", "USER", "root"]),
    ODD,
)
CONTENT_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.just("text"), "text": ODD}),
    st.sampled_from(
        [
            {"type": "image_url", "image_url": {"url": "http://x"}},
            {"type": "input_audio"},
            {"text": "no type"},
            {},
        ]
    ),
    ODD,
)
CONTENT = st.one_of(TEXT, TEXT, st.lists(CONTENT_PART, max_size=3), ODD)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": TEXT}),
    st.fixed_dictionaries(
        {"role": ROLE, "content": CONTENT},
        optional={"name": TEXT, "tool_calls": ODD, "extra": ODD},
    ),
    ODD,
)
MESSAGES = st.one_of(
    st.lists(MESSAGE, min_size=1, max_size=4),
    st.lists(MESSAGE, min_size=1, max_size=4),
    st.just([]),
    st.lists(st.just({"role": "user", "content": "a"}), min_size=30, max_size=40),
    ODD,
)


def prompt_ids(vocab: int) -> st.SearchStrategy:
    valid = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=30)
    return st.one_of(
        valid,
        valid,
        st.just([]),
        st.lists(st.integers(-(2**63), 2**64 - 1), min_size=1, max_size=5),
        st.lists(
            st.sampled_from([-1, vocab, 2**31, 2**64 - 1, 2**64, 10**30]), min_size=1, max_size=3
        ),
        st.just(list(range(vocab)) * 50),  # over max_model_len
        st.lists(valid, min_size=1, max_size=2),  # a batch of prompts
        st.lists(TEXT, min_size=1, max_size=2),
        st.lists(st.one_of(st.integers(0, 9), TEXT, st.none()), min_size=1, max_size=3),
    )


def openai_body(kind: OpenAIKind, vocab: int) -> st.SearchStrategy[dict]:
    if kind == "tokenize":
        return st.fixed_dictionaries(
            {},
            optional={
                "prompt": field_of(TEXT),
                "messages": MESSAGES,
                "add_generation_prompt": field_of(st.booleans()),
                "add_special_tokens": field_of(st.booleans()),
                "model": TEXT,
            },
        )
    specific: dict[str, st.SearchStrategy]
    if kind == "chat":
        specific = {"messages": MESSAGES}
        optional = {
            **OPTIONAL_SAMPLING,
            "logprobs": field_of(st.booleans(), st.sampled_from([0, 1, 5])),
            "top_logprobs": field_of(st.integers(0, 20), st.sampled_from([None, 21, -1, 2**64])),
            "max_completion_tokens": MAX_TOKENS,
        }
    else:
        specific = {"prompt": field_of(TEXT, prompt_ids(vocab))}
        optional = {
            **OPTIONAL_SAMPLING,
            "logprobs": field_of(
                st.sampled_from([None, 0, 1, 5, 20]), st.sampled_from([21, -1, True])
            ),
            "suffix": st.sampled_from([None, "x"]),
            "best_of": st.sampled_from([None, 1, 2]),
        }
    # max_tokens is always there: a missing one means 256 tokens, and time (not a fuzz target).
    return st.fixed_dictionaries({**specific, "max_tokens": MAX_TOKENS}, optional=optional).flatmap(
        lambda body: st.dictionaries(st.text(max_size=12), ODD, max_size=2).map(
            lambda unknown: {**unknown, **body}
        )
    )


def _nasty_json() -> list[tuple[str, bytes]]:
    huge = b"9" * 5000
    return [
        ("empty", b""),
        ("json-null", b"null"),
        ("json-array", b"[]"),
        ("json-string", b'"x"'),
        ("json-number", b"1"),
        ("deep-100k-open", b"[" * 100_000),
        ("deep-100k-closed", _deep(100_000)),
        ("deep-object-50k", b'{"a":' * 50_000),
        ("deep-900", _deep(900)),
        ("deep-messages-200", b'{"messages":' + _deep(200) + b', "max_tokens": 2}'),
        ("huge-int-body", b"1" * 5000),
        ("huge-int-top_k", b'{"top_k": ' + huge + b', "prompt": "a", "max_tokens": 2}'),
        ("huge-int-max_tokens", b'{"max_tokens": -' + huge + b', "messages": []}'),
        ("top_k-2**64", b'{"top_k": %d, "prompt": "a", "max_tokens": 2}' % 2**64),
        ("float-overflow", b'{"temperature": 1e999, "prompt": "a", "max_tokens": 2}'),
        ("nan", b'{"temperature": NaN, "prompt": "a", "max_tokens": 2}'),
        ("surrogate-escape", b'{"prompt": "\\ud800", "max_tokens": 2}'),
        ("surrogate-raw", b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}'),
        ("invalid-utf8", b'{"prompt": "\xff\xfe", "max_tokens": 2}'),
        ("utf16", '{"prompt": "a", "max_tokens": 2}'.encode("utf-16")),
        ("bom", b'\xef\xbb\xbf{"prompt": "a", "max_tokens": 2}'),
        ("duplicate-keys", b'{"prompt": "a", "prompt": [1], "max_tokens": 2, "max_tokens": 0}'),
        ("nul-bytes", b"\x00" * 64),
        ("one-mib-string", b'{"prompt": "' + b"a" * (1 << 20) + b'", "max_tokens": 1}'),
        ("msgpack-to-json", msgpack.packb({"prompt": "a"})),
    ]


NASTY_JSON = dict(_nasty_json())


def nasty(table: dict[str, bytes], labels: list[str] | None = None) -> st.SearchStrategy:
    """(label, body) from `table`, drawn by label: big bodies stay out of reprs."""
    return st.sampled_from(labels or list(table)).map(lambda k: (k, table[k]))


PLAIN_TEXT = st.text(alphabet="abcdefghij .,!?", min_size=1, max_size=20)


def near_valid_body(kind: OpenAIKind, vocab: int) -> st.SearchStrategy[dict]:
    """A valid body with at most one field drawn from the odd ones: most are served, so
    generation, rendering and streaming meet the fuzz too."""
    if kind == "tokenize":
        base = st.one_of(
            st.fixed_dictionaries({"prompt": PLAIN_TEXT}),
            st.fixed_dictionaries({"messages": st.just([{"role": "user", "content": "hi"}])}),
        )
        fields = {
            "add_generation_prompt": field_of(st.booleans()),
            "add_special_tokens": field_of(st.booleans()),
            "model": TEXT,
        }
    else:
        if kind == "chat":
            first = st.fixed_dictionaries(
                {
                    "messages": st.lists(
                        st.fixed_dictionaries(
                            {"role": st.sampled_from(["user", "system"]), "content": PLAIN_TEXT}
                        ),
                        min_size=1,
                        max_size=3,
                    )
                }
            )
        else:
            first = st.fixed_dictionaries(
                {
                    "prompt": st.one_of(
                        PLAIN_TEXT, st.lists(st.integers(0, vocab - 1), min_size=1, max_size=20)
                    )
                }
            )
        base = st.tuples(first, SMALL_MAX_TOKENS).map(lambda t: {**t[0], "max_tokens": t[1]})
        fields = dict(SAMPLING_FIELDS)
        if kind == "chat":
            fields |= {"logprobs": st.booleans(), "top_logprobs": st.integers(0, 5)}
    one = st.sampled_from(sorted(fields)).flatmap(lambda k: fields[k].map(lambda v: {k: v}))
    return st.tuples(base, mostly(st.just({}), one, 7)).map(lambda t: {**t[0], **t[1]})


def json_bodies(kind: OpenAIKind, vocab: int) -> st.SearchStrategy[tuple[str, bytes]]:
    shaped = st.tuples(openai_body(kind, vocab), st.booleans()).map(
        lambda t: (f"openai-{kind}", to_body(*t))
    )
    near = st.tuples(near_valid_body(kind, vocab), st.booleans()).map(
        lambda t: (f"near-valid-{kind}", to_body(*t))
    )
    other = "completion" if kind == "chat" else "chat"
    return mostly(
        st.one_of(shaped, near),
        st.one_of(
            st.tuples(openai_body(other, vocab), st.booleans()).map(
                lambda t: (f"openai-{other}-shaped", to_body(*t))
            ),
            st.tuples(JSON_ANY, st.booleans()).map(lambda t: ("random-json", to_body(*t))),
            nasty(NASTY_JSON),
            st.binary(max_size=200).map(lambda b: ("garbage-bytes", b)),
            st.tuples(openai_body(kind, vocab), st.floats(0, 1)).map(
                lambda t: ("truncated-json", _truncate(to_body(t[0], True), t[1]))
            ),
        ),
        4,
    )


def _truncate(raw: bytes, at: float) -> bytes:
    return raw[: int(len(raw) * at)]


# msgpack values: what the wire can carry (ints within 64 bits, no lone surrogates).
MSGPACK_ANY = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=16),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
MSGPACK_ODD = st.one_of(
    MSGPACK_ANY,
    st.sampled_from([-(2**63), 2**64 - 1, -1, 0, float("nan"), float("inf"), -0.0, 1e-300]),
    st.sampled_from(["", "x" * 5000, b"", b"\x00" * 64, [], {}, [None], {"": None}]),
)
SAMPLING_ODD: dict[str, st.SearchStrategy] = {
    "temperature": st.sampled_from(
        [0.0, 1e-300, 5e-324, -1.0, 10.0, 10.5, float("nan"), float("inf"), "1", None]
    ),
    "top_p": st.sampled_from([1e-300, 5e-324, 0.0, -0.0, 1.0, 1.5, float("nan")]),
    "top_k": st.sampled_from([-1, 0, 1, 2**31 - 1, 2**31, 2**63, 2**64 - 1, -(2**63)]),
    "max_tokens": st.sampled_from([0, -1, 1, 4, 65537, 2**63, 2**64 - 1, 1.5, "4"]),
    "stop": st.sampled_from([(), ("",), ("a",) * 9, ("x" * 65,), ("x" * 64,), (1,), "abc", None]),
    "ignore_eos": st.sampled_from([True, False, 2, "yes"]),
}


def _msgpack_nasty() -> list[tuple[str, bytes]]:
    return [
        ("msgpack-empty", b""),
        ("msgpack-deep-array", b"\x91" * 100_000 + b"\xc0"),
        ("msgpack-deep-map", b"\x81\xa1a" * 50_000 + b"\xc0"),
        ("msgpack-str32-4GiB", b"\xdb\xff\xff\xff\xff"),
        ("msgpack-bin32-4GiB", b"\xc6\xff\xff\xff\xff" + b"x" * 16),
        ("msgpack-array32-4G", b"\xdd\xff\xff\xff\xff"),
        ("msgpack-map32-4G", b"\xdf\xff\xff\xff\xff"),
        ("msgpack-never-used", b"\xc1"),
        ("msgpack-ext", b"\xd4\x01\x00"),
        ("msgpack-timestamp", b"\xd6\xff\xff\xff\xff\xff"),
        ("msgpack-invalid-utf8-str", b"\xa3\xed\xa0\x80"),
        ("msgpack-int-key-map", b"\x81\x01\x02"),
        ("msgpack-nil-key-map", b"\x81\xc0\x02"),
        ("msgpack-trailing", pack({"v": 1}) + b"\x00garbage"),
        ("json-to-msgpack", b'{"v": 1, "kind": "x"}'),
        ("one-mib-garbage", b"\xff" * (1 << 20)),
    ]


MSGPACK_NASTY = dict(_msgpack_nasty())


def sample_message(name: str, ctx: Context, sender: Identity):
    """A valid message of type `name`, cheap to serve (tiny generations, no waits)."""
    sampling = SamplingParams(max_tokens=4)
    samples: dict[str, Callable[[], Any]] = {
        "RolloutRequest": lambda: RolloutRequest(
            request_id=uuid.uuid4().hex,
            pool_id=ctx.node_pool_id,
            prompt_ids=ctx.prompt_ids,
            sampling=sampling,
            seed=1,
        ),
        "VerifyRequest": lambda: VerifyRequest(rollout_envelope=ctx.rollout_envelope),
        "WeightUpdate": lambda: WeightUpdate(version=0, path="/nonexistent/prime-fuzz"),
        "WeightReload": lambda: WeightReload(version=0),
        "RegisterRequest": lambda: RegisterRequest(
            pool_id=ctx.pool_id, model="tiny", operator="fuzz"
        ),
        "Heartbeat": lambda: Heartbeat(node_id=sender.node_id, weights_version=0),
        "Deregister": lambda: Deregister(node_id=sender.node_id, stage="drain"),
        "SubmitRollouts": lambda: SubmitRollouts(
            pool_id=ctx.pool_id,
            requests=[
                RolloutSpec(
                    request_id="fz-" + uuid.uuid4().hex,
                    prompt_ids=ctx.prompt_ids,
                    sampling=SamplingParams(max_tokens=2),
                )
            ],
        ),
        "ResultsQuery": lambda: ResultsQuery(after=0, limit=5, wait_s=0),
        "SwarmAnnounce": lambda: SwarmAnnounce(manifest_hash="ab" * 32),
    }
    return samples[name]()


def _tame(fields: dict) -> dict:
    """Keep a mutated message cheap: no long generations, no long polls."""
    sampling = fields.get("sampling")
    if isinstance(sampling, dict) and type(sampling.get("max_tokens")) is int:
        sampling["max_tokens"] = min(sampling["max_tokens"], 8)
    specs = fields.get("requests")
    for spec in specs if isinstance(specs, list) else []:
        if isinstance(spec, dict):
            _tame(spec)
    wait = fields.get("wait_s")
    if isinstance(wait, int | float) and not isinstance(wait, bool) and wait > 0.2:
        fields["wait_s"] = 0.2
    return fields


@dataclass(frozen=True)
class Mutation:
    op: Literal["replace", "drop", "add", "sampling", "ints"]
    key: int
    value: Any


MUTATION = st.one_of(
    st.builds(Mutation, st.just("replace"), st.integers(0, 50), MSGPACK_ODD),
    st.builds(Mutation, st.just("drop"), st.integers(0, 50), st.none()),
    st.builds(Mutation, st.just("add"), st.integers(0, 50), MSGPACK_ODD),
    st.sampled_from(list(SAMPLING_ODD)).flatmap(
        lambda k: SAMPLING_ODD[k].map(lambda v: Mutation("sampling", 0, (k, v)))
    ),
    st.builds(
        Mutation,
        st.just("ints"),
        st.integers(0, 50),
        st.one_of(
            st.lists(st.integers(-(2**63), 2**64 - 1), max_size=4),
            st.lists(st.sampled_from([-1, 100, 2**31, 2**64 - 1]), min_size=1, max_size=3),
            st.just([]),
            st.just([1] * 70_000),
        ),
    ),
)


def mutate(fields: dict, m: Mutation) -> dict:
    keys = list(fields)
    out = dict(fields)
    if m.op == "replace" and keys:
        out[keys[m.key % len(keys)]] = m.value
    elif m.op == "drop" and keys:
        del out[keys[m.key % len(keys)]]
    elif m.op == "add":
        out[f"unknown_{m.key}"] = m.value
    elif m.op == "sampling":
        key, value = m.value
        target = out.get("sampling")
        if isinstance(out.get("requests"), list) and out["requests"]:
            target = out["requests"][0].get("sampling")
        if isinstance(target, dict):
            target[key] = value
    elif m.op == "ints":
        lists = [k for k, v in out.items() if isinstance(v, list)] or keys
        if lists:
            out[lists[m.key % len(lists)]] = m.value
    return _tame(out)


Signer = Literal["fresh", "fuzz", "trainer"]
SIGNER = st.sampled_from(["fresh", "fuzz", "fuzz", "trainer"])


def _identity(who: Signer, ctx: Context) -> Identity:
    if who == "trainer":
        return ctx.trainer
    return ctx.fuzz_node if who == "fuzz" else Identity.generate()


def _safe_signer(route: Route, who: Signer) -> Signer:
    # The trainer's valid WeightUpdate would change the pool's weights: not a fuzz target.
    return "fuzz" if route.message == "WeightUpdate" and route.target == "scheduler" else who


def envelope_bodies(route: Route, ctx: Context) -> st.SearchStrategy[tuple[str, bytes]]:
    name = route.message

    def mutated(who: Signer, m: Mutation, ttl: float) -> tuple[str, bytes]:
        who = _safe_signer(route, who)
        sender = _identity(who, ctx)
        fields = mutate(sample_message(name, ctx, sender).model_dump(mode="python"), m)
        body = pack({"v": PROTOCOL_VERSION, "t": name, "b": fields})
        return f"envelope-mutated-{m.op}-{who}", seal_body(sender, name, body, ttl)

    def valid(who: Signer) -> tuple[str, bytes]:
        who = _safe_signer(route, who)
        sender = _identity(who, ctx)
        return f"envelope-valid-{who}", seal(sender, sample_message(name, ctx, sender))

    def damaged(who: Signer, how: str, at: float, byte: int) -> tuple[str, bytes]:
        raw = bytearray(valid(_safe_signer(route, who))[1])
        i = int(at * (len(raw) - 1))
        if how == "truncate":
            return "envelope-truncated", bytes(raw[:i])
        if how == "flip":
            raw[i] ^= 1 << (byte % 8)
            return "envelope-bitflip", bytes(raw)
        return "envelope-trailing", bytes(raw) + bytes([byte]) * 3

    def signed_body(who: Signer, kind: str, body: bytes, label: str) -> tuple[str, bytes]:
        sender = _identity(_safe_signer(route, who), ctx)
        return f"envelope-signed-{label}", seal_body(sender, kind, body)

    def shaped(fields: dict) -> tuple[str, bytes]:
        return "envelope-shaped-random", pack(fields)

    envelope_fields = st.fixed_dictionaries(
        {},
        optional={
            "v": st.one_of(st.just(PROTOCOL_VERSION), MSGPACK_ODD),
            "sender": st.one_of(st.binary(min_size=32, max_size=32), MSGPACK_ODD),
            "nonce": st.one_of(st.binary(min_size=8, max_size=16), MSGPACK_ODD),
            "expires": st.one_of(
                st.sampled_from(
                    [time.time() + 60, float("nan"), float("inf"), -1.0, 1e300, 2**64 - 1]
                ),
                MSGPACK_ODD,
            ),
            "kind": st.one_of(st.just(name), MSGPACK_ODD),
            "body": st.one_of(st.binary(max_size=64), MSGPACK_ODD),
            "sig": st.one_of(st.binary(min_size=64, max_size=64), MSGPACK_ODD),
        },
    )
    inner_body = st.one_of(
        st.binary(max_size=64).map(lambda b: (b, "garbage")),
        MSGPACK_ANY.map(lambda v: (pack(v), "random")),
        st.tuples(st.one_of(st.just(PROTOCOL_VERSION), MSGPACK_ODD), MSGPACK_ANY).map(
            lambda t: (pack({"v": t[0], "t": name, "b": t[1]}), "random-fields")
        ),
        nasty(MSGPACK_NASTY).map(lambda t: (t[1], t[0])),
    )
    common = st.one_of(
        st.builds(mutated, SIGNER, MUTATION, st.just(60.0)),
        st.builds(valid, SIGNER),
    )
    return mostly(
        common,
        st.one_of(
            st.builds(mutated, SIGNER, MUTATION, st.sampled_from([-5.0, 1e6, 0.0])),
            st.builds(
                damaged,
                SIGNER,
                st.sampled_from(["truncate", "flip", "trail"]),
                st.floats(0, 1),
                st.integers(0, 255),
            ),
            st.builds(
                lambda who, body, kind: signed_body(who, kind, body[0], body[1]),
                SIGNER,
                inner_body,
                st.one_of(st.just(name), st.sampled_from(["Rollout", "Verdict", "", "x" * 300])),
            ),
            envelope_fields.map(shaped),
            st.binary(max_size=256).map(lambda b: ("msgpack-garbage", b)),
            MSGPACK_ANY.map(lambda v: ("msgpack-random", pack(v))),
            nasty(MSGPACK_NASTY),
            nasty(NASTY_JSON, list(NASTY_JSON)[:8]),
        ),
        6,
    )


@dataclass(frozen=True)
class Req:
    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes | None
    label: str
    repeat: int = 1


def _content_types(default: str) -> st.SearchStrategy[str | None]:
    return mostly(
        st.just(default),
        st.sampled_from(
            [
                None,
                "",
                "text/plain",
                "application/json; charset=latin-1",
                "application/x-www-form-urlencoded",
                "multipart/form-data; boundary=xyz",
                MSGPACK,
                "application/json",
                "application/json; charset=utf-16",
                "*/*",
            ]
        ),
    )


EXTRA_HEADERS = mostly(
    st.just(()),
    st.sampled_from(
        [
            (("Content-Encoding", "bogus"),),
            (("Accept", "application/openmetrics-text; version=1.0.0"),),
            (("Accept", "text/plain;q=x, */*;;"),),
            (("Accept-Encoding", "gzip, br, zstd"),),
            (("X-Forwarded-For", "1.2.3.4"),),
            (("Expect", "100-continue"),),
            (("Content-Encoding", "identity"),),
        ]
    ),
)


def _method(route: Route) -> st.SearchStrategy[str]:
    others = [m for m in OTHER_METHODS if m != route.method]
    return mostly(st.just(route.method), st.sampled_from(others), 1)


def _auth(route: Route, ctx: Context) -> st.SearchStrategy[tuple[tuple[str, str], ...]]:
    if route.target != "scheduler" or not (route.openai or route.path == "/v1/models"):
        return st.just(())
    good = (("Authorization", f"Bearer {ctx.api_key}"),)
    bad = st.sampled_from(ctx.bad_api_keys).map(lambda v: (("Authorization", v),) if v else ())
    return mostly(st.just(good), bad)


def _path(route: Route, ctx: Context) -> st.SearchStrategy[str]:
    if "{rollout_id}" not in route.path:
        queries = mostly(
            st.just(""),
            st.text(max_size=40).map(lambda q: "?" + quote_from_bytes(q.encode(), safe="=&")),
        )
        return queries.map(lambda q: route.path + q)
    ids = st.one_of(
        st.just(ctx.rollout_id.encode()),
        st.text(max_size=40).map(str.encode),
        lone_surrogate_text().map(lambda s: s.encode("utf-8", "surrogatepass")),
        st.binary(max_size=24),
        st.sampled_from([b"..", b"%2e%2e", b"\x00", b"a" * 2000, b" ", b"\xff", b"a/b"]),
    )
    return ids.map(lambda raw: "/v1/rollouts/" + quote_from_bytes(raw, safe=""))


def requests_for(route: Route, ctx: Context) -> st.SearchStrategy[Req]:
    if route.body == "none":
        bodies = mostly(
            st.just(("no-body", None)),
            st.one_of(
                st.binary(max_size=64).map(lambda b: ("get-with-body", b)),
                nasty(NASTY_JSON, list(NASTY_JSON)[:8]),
            ),
        )
        default_ct = "application/json"
    elif route.body == "msgpack-envelope":
        bodies = envelope_bodies(route, ctx)
        default_ct = MSGPACK
    else:
        bodies = json_bodies(route.openai, ctx.vocab)
        default_ct = "application/json"

    def build(method, path, ct, extra, auth, label_body, repeat, encoding) -> Req:
        label, body = label_body
        headers = dict(extra) | dict(auth)
        if ct is not None:
            headers["Content-Type"] = ct
        if encoding and body is not None:  # validly compressed (corrupt ones: see below)
            body = gzip.compress(body) if encoding == "gzip" else zlib.compress(body)
            headers["Content-Encoding"] = encoding
            label += f"+{encoding}"
        return Req(method, path, tuple(headers.items()), body, label, repeat)

    repeat = st.sampled_from([1] * 19 + [2]) if route.body == "msgpack-envelope" else st.just(1)
    return st.builds(
        build,
        _method(route),
        _path(route, ctx),
        _content_types(default_ct),
        EXTRA_HEADERS,
        _auth(route, ctx),
        bodies,
        repeat,
        mostly(st.just(""), st.sampled_from(["gzip", "deflate"]), 1),
    )


def reviewer_cases(route: Route, ctx: Context) -> list[Req]:
    """The inputs a reviewer found answering 500, sent to every route they fit, every run."""
    if route.body == "none" or route.method != "POST":
        return []
    auth: tuple[tuple[str, str], ...] = ()
    if route.target == "scheduler" and route.openai:
        auth = (("Authorization", f"Bearer {ctx.api_key}"),)
    ct = MSGPACK if route.body == "msgpack-envelope" else "application/json"
    headers = (*auth, ("Content-Type", ct))
    cases: list[tuple[str, bytes]] = [
        ("deep-100k", b"[" * 100_000),
        ("huge-int-4301-digits", b'{"max_tokens": ' + b"9" * 4301 + b"}"),
    ]
    if route.openai:
        big = 2**64
        cases += [
            ("prompt-lone-surrogate", b'{"prompt": "a\\ud800", "max_tokens": 2}'),
            (
                "message-lone-surrogate",
                b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
            ),
            ("stop-lone-surrogate", to_body(_chat(2, stop=["\ud800"], prompt="a"), True)),
            ("top_k-over-2**64-1", to_body(_chat(2, top_k=big, prompt="a"), True)),
            ("top_k-2**63", to_body(_chat(2, top_k=2**63, prompt="a"), True)),
            ("messages-empty", to_body({"messages": [], "max_tokens": 2}, True)),
            ("prompt-huge-id", to_body({"prompt": [2**64 - 1], "max_tokens": 2}, True)),
            ("prompt-negative-id", to_body({"prompt": [-1], "max_tokens": 2}, True)),
            ("top_p-1e-300", to_body(_chat(2, top_p=1e-300, prompt="a"), True)),
            (
                "content-part-int-text",
                to_body(
                    {
                        "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                        "max_tokens": 2,
                    },
                    True,
                ),
            ),
        ]
    else:
        cases += [
            ("msgpack-deep", b"\x91" * 100_000 + b"\xc0"),
            ("truncated", seal(ctx.trainer, WeightReload(version=0))[:40]),
        ]
    reqs = [Req("POST", route.path, headers, body, label) for label, body in cases]
    bomb = (*headers, ("Content-Encoding", "gzip"))
    return [*reqs, Req("POST", route.path, bomb, gzip_bomb(), "gzip-bomb-80MiB")]


@functools.cache
def gzip_bomb() -> bytes:
    """80 MiB of zeros in about 80 KB: over every process's max body once decompressed."""
    return gzip.compress(b"\0" * (80 << 20), compresslevel=9)


# -- running and judging ---------------------------------------------------------------------
@dataclass
class Tally:
    counts: dict[str, Counter] = field(default_factory=dict)
    labels: dict[str, Counter] = field(default_factory=dict)
    violations: list[dict[str, Any]] = field(default_factory=list)
    sent: int = 0

    def add(self, route: Route, status: int | str, label: str) -> None:
        self.counts.setdefault(route.key, Counter())[str(status)] += 1
        self.labels.setdefault(route.key, Counter())[label] += 1
        self.sent += 1


def _error_json(resp: httpx.Response) -> dict | None:
    try:
        body = resp.json()
    except (ValueError, UnicodeDecodeError):
        return None
    err = body.get("error") if isinstance(body, dict) else None
    return err if isinstance(err, dict) and isinstance(err.get("message"), str) else None


def judge(req: Req, resp: httpx.Response, route: Route | None = None) -> str | None:
    """Why this answer breaks the invariant, or None."""
    status = resp.status_code
    if status == 200 and route is not None and route.openai and req.method == "POST":
        return _bad_answer(resp)
    if status >= 500:
        err = _error_json(resp)
        legit = err is not None and (
            resp.headers.get("Retry-After") or LEGIT_503.search(err["message"])
        )
        if status == 503 and legit:
            return None
        return f"{status} {'JSON' if err else 'not JSON'}"
    if status >= 400 and req.method != "HEAD" and _error_json(resp) is None:
        return f"{status} without a JSON error body"
    return None


def _bad_answer(resp: httpx.Response) -> str | None:
    """A served OpenAI call must be one JSON object or server-sent events ending [DONE]."""
    if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
        events = [e for e in resp.text.split("\n\n") if e.strip()]
        if not events or events[-1].strip() != "data: [DONE]":
            return "200 stream without data: [DONE]"
        try:
            for e in events[:-1]:
                json.loads(e.removeprefix("data: "))
        except ValueError:
            return "200 stream with a non-JSON event"
        return None
    try:
        body = resp.json()
    except ValueError:
        return "200 not JSON"
    return None if isinstance(body, dict) else "200 JSON not an object"


def _summary(body: bytes | None, limit: int = 240) -> str:
    if body is None:
        return "<no body>"
    head = body[:limit]
    return f"{head!r}{'...' if len(body) > limit else ''} ({len(body)} bytes)"


def send(client: httpx.Client, target: Target, route: Route, req: Req, tally: Tally) -> None:
    for _ in range(req.repeat):
        try:
            resp = client.request(
                req.method, target.url + req.path, content=req.body, headers=dict(req.headers)
            )
        except httpx.HTTPError as exc:
            tally.add(route, type(exc).__name__, req.label)
            why = f"no answer: {type(exc).__name__}: {exc}"
            resp = None
        else:
            tally.add(route, resp.status_code, req.label)
            why = judge(req, resp, route)
        if why is not None:
            tally.violations.append(
                {
                    "headers": {k: v[:40] for k, v in req.headers},
                    "route": route.key,
                    "why": why,
                    "label": req.label,
                    "method": req.method,
                    "path": req.path[:200],
                    "body": _summary(req.body),
                    "response": resp.text[:300] if resp is not None else "",
                }
            )


def fuzz_route(
    client: httpx.Client, target: Target, route: Route, ctx: Context, n: int, tally: Tally
) -> None:
    for req in reviewer_cases(route, ctx):
        send(client, target, route, req, tally)

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(requests_for(route, ctx))
    def one(req: Req) -> None:
        send(client, target, route, req, tally)

    one()


def log_errors(paths: list[Path], offsets: dict[Path, int]) -> list[str]:
    """Log entries with a traceback (or at ERROR) written since `offsets`."""
    found = []
    for path in paths:
        with path.open("rb") as f:
            f.seek(offsets.get(path, 0))
            text = f.read().decode(errors="replace")
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                if "Traceback" in line or "Error" in line:
                    found.append(f"{path.name}: {line[:500]}")
                continue
            if isinstance(entry, dict) and (
                entry.get("exc") or entry.get("level") in ("ERROR", "CRITICAL")
            ):
                found.append(
                    f"{path.name}: {entry.get('msg', '')[:200]}\n{str(entry.get('exc', ''))[-1500:]}"
                )
    return found


def still_serving(procs: Processes) -> None:
    node, sched = procs.node, procs.scheduler
    for t in (node, sched, *[Target("node", "", c) for c in procs.workers.values()]):
        assert t.child.alive(), f"{t.child.name} died:\n{t.child.log_tail()}"
    chat = httpx.post(f"{node.url}/v1/chat/completions", json=_chat(), timeout=60)
    assert chat.status_code == 200 and chat.json()["choices"], chat.text
    health = httpx.get(f"{sched.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    pooled = httpx.post(
        f"{sched.url}/v1/chat/completions",
        json=_chat(),
        headers={"Authorization": f"Bearer {procs.ctx.api_key}"},
        timeout=60,
    )
    assert pooled.status_code == 200 and pooled.json()["choices"], pooled.text


def run_fuzz(procs: Processes, per_route: int, report, name: str) -> Tally:
    still_serving(procs)
    everyone = {"node": procs.node.child, "scheduler": procs.scheduler.child, **procs.workers}
    rss_before = {k: psutil.Process(c.proc.pid).memory_info().rss for k, c in everyone.items()}
    offsets = {p: p.stat().st_size for p in procs.logs}
    tally = Tally()
    start = time.monotonic()
    targets = procs.targets()
    with httpx.Client(timeout=httpx.Timeout(60.0)) as client:
        for route in ROUTES:
            target = targets[route.target]
            fuzz_route(client, target, route, procs.ctx, per_route, tally)
            assert target.child.alive(), f"{route.key} killed it:\n{target.child.log_tail()}"
    seconds = time.monotonic() - start
    still_serving(procs)
    rss_after = {k: psutil.Process(c.proc.pid).memory_info().rss for k, c in everyone.items()}
    report(
        name,
        {
            "inputs": tally.sent,
            "seconds": round(seconds, 1),
            "violations": len(tally.violations),
            "rss_mib": {
                k: {
                    "before": round(rss_before[k] / 2**20, 1),
                    "after": round(rss_after[k] / 2**20, 1),
                    "growth": round((rss_after[k] - rss_before[k]) / 2**20, 1),
                }
                for k in everyone
            },
            "status_counts": {k: dict(sorted(v.items())) for k, v in tally.counts.items()},
        },
    )
    if tally.violations:
        seen: dict[tuple[str, str, str], dict] = {}
        for v in tally.violations:
            seen.setdefault((v["route"], v["why"], v["label"]), v)
        lines = [
            f"- {r} [{label}] -> {why}: {v['method']} {v['path']} {v['headers']} {v['body']}"
            f" => {v['response']!r}"
            for (r, why, label), v in seen.items()
        ]
        errors = log_errors(procs.logs, offsets)
        pytest.fail(
            f"{len(tally.violations)} answers break the bad-input invariant "
            f"({len(seen)} distinct):\n"
            + "\n".join(lines[:60])
            + "\n\nprocess log errors (first 15):\n"
            + "\n".join(errors[:15])
        )
    return tally


def test_fuzz_every_route_quick(processes: Processes, report) -> None:
    tally = run_fuzz(processes, 14, report, "fuzz_routes_quick")
    assert tally.sent >= 300


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fuzz_every_route_slow(processes: Processes, report) -> None:
    per_route = -(-10_500 // len(ROUTES))
    tally = run_fuzz(processes, per_route, report, "fuzz_routes_slow")
    assert tally.sent >= 10_000, tally.sent


@pytest.mark.parametrize("which", ["node", "scheduler"])
def test_partial_body_is_cut_off(processes: Processes, which: str) -> None:
    """Headers announce 1000 body bytes, 10 come: the server answers 408 (or closes) within
    its body-read timeout instead of holding the connection."""
    target = processes.targets()[which]
    wait_s = BODY_READ_TIMEOUT_S + 15
    # Routes whose handler reads the body first (the scheduler's OpenAI routes check the
    # API key before reading: they answer 401 at once, which proves nothing here).
    path, ct = (
        ("/tokenize", "application/json")
        if which == "node"
        else (
            "/v1/nodes/register",
            MSGPACK,
        )
    )
    try:
        took, got = slow_loris(target.port, path, ct, wait_s)
    except TimeoutError:
        pytest.fail(f"{which} held a partial body open for over {wait_s:.0f} s")
    assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:200]
    assert took <= wait_s
    assert target.child.alive()


HANG_UPS = 20


@pytest.mark.parametrize("which", ["node", "scheduler"])
def test_a_client_hanging_up_mid_body_costs_one_short_log_line(
    processes: Processes, which: str
) -> None:
    """Clients that announce 1000 body bytes, send 10 and hang up: each is one short line
    in the log (no ERROR, no traceback), so hanging up cannot flood the log for free."""
    target = processes.targets()[which]
    path, ct = (
        ("/tokenize", "application/json") if which == "node" else ("/v1/nodes/register", MSGPACK)
    )
    log_path = target.child.log_path
    before = log_path.stat().st_size
    for _ in range(HANG_UPS):
        with socket.create_connection(("127.0.0.1", target.port), timeout=10) as s:
            s.sendall(_partial_body_request(path, ct))
    deadline = time.monotonic() + 20
    while log_path.read_text(errors="replace").count("hung up mid-request") < HANG_UPS:
        assert time.monotonic() < deadline, log_path.read_text(errors="replace")[before:][-3000:]
        time.sleep(0.2)
    assert log_errors([log_path], {log_path: before}) == []
    grown = log_path.stat().st_size - before
    assert grown < HANG_UPS * 400, grown  # a line each (and the access log, if any)
    assert target.child.alive()


PARSER_REFUSED: dict[str, bytes] = {
    "control char in a header": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: \x7f/\x01\r\n"
    b"Content-Length: 2\r\n\r\n{}",
    "unsupported Content-Encoding (br)": b"POST /tokenize HTTP/1.1\r\nHost: x\r\n"
    b"Content-Encoding: br\r\nContent-Length: 2\r\n\r\n{}",
    "bad request line": b"POST /tokenize HTTP/9\r\n\r\n",
    "header line over 8 KiB": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: "
    + b"a" * 9000
    + b"\r\n\r\n",
    "two Content-Length headers": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
    b"Content-Length: 3\r\n\r\n{}",
    "bad chunked framing": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\n{}\r\n0\r\n\r\n",
}


def raw_exchange(port: int, data: bytes, timeout_s: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(data)
        got = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := s.recv(65536):
                got += chunk
                if b"\r\n\r\n" in got:
                    break
        return got


def test_requests_the_http_parser_refuses_get_a_400(processes: Processes, report) -> None:
    """Malformed HTTP (not a malformed body) is refused by aiohttp's parser before any
    middleware runs: a 400, but plain text (aiohttp writes it); the process keeps serving."""
    bodies: dict[str, str] = {}
    for which, target in processes.targets().items():
        for case, data in PARSER_REFUSED.items():
            got = raw_exchange(target.port, data)
            assert re.match(rb"HTTP/1\.[01] 400 ", got), (which, case, got[:200])
            bodies[f"{which}: {case}"] = got.split(b"\r\n\r\n", 1)[-1][:60].decode(errors="replace")
        assert target.child.alive()
    report("fuzz_parser_level_400_bodies", bodies)
    still_serving(processes)


@pytest.fixture
def lonely_pool(tmp_path: Path) -> Iterator[tuple[Pool, str]]:
    """A scheduler whose only nodes are registered fakes that heartbeat: one that never
    opens its channel (so it never turns healthy), one whose channel is open and never
    answers a call (tests.channel_fakes)."""
    pool = make_pool(tmp_path)
    try:
        pool.start_scheduler(
            "--openai.tokenizer",
            str(resolve_model("tiny")),
            "--dispatch.generate-timeout-s",
            "2",
            "--dispatch.openai-timeout-s",
            "5",
        )
        fakes = {"dead": Identity.generate(), "silent": Identity.generate()}
        for operator, me in fakes.items():
            reg = RegisterRequest(pool_id=pool.pool_id, model="tiny", operator=operator)
            r = httpx.post(f"{pool.url}/v1/nodes/register", content=seal(me, reg), timeout=10)
            assert r.status_code == 200, r.text
        with FakeChannel(pool.url, fakes["silent"], pool.pool_id) as silent:
            silent.wait_hello_sent()
            for me in fakes.values():
                hb = seal(me, Heartbeat(node_id=me.node_id, weights_version=0))
                r = httpx.post(f"{pool.url}/v1/nodes/heartbeat", content=hb, timeout=10)
                assert r.status_code == 200, r.text
            pool.wait_node_state(fakes["silent"].node_id, "healthy", 10)
            assert pool.node_state(fakes["dead"].node_id) == "registered"
            key, _ = _api_keys(pool)
            yield pool, key
    finally:
        pool.close()


def test_scheduler_openai_routes_with_nodes_that_do_not_answer(lonely_pool) -> None:
    pool, key = lonely_pool
    auth = {"Authorization": f"Bearer {key}"}
    calls = {
        "/tokenize": {"prompt": "hello"},
        "/v1/chat/completions": _chat(),
        "/v1/completions": {"prompt": "hello", "max_tokens": 2},
    }
    for path, body in calls.items():
        resp = httpx.post(f"{pool.url}{path}", json=body, headers=auth, timeout=60)
        req = Req("POST", path, (), json.dumps(body).encode(), "dead-node")
        assert judge(req, resp) is None, (path, resp.status_code, resp.text[:300])
    assert httpx.get(f"{pool.url}/health", timeout=10).status_code == 200


CORRUPT_ENCODINGS: list[tuple[str, str, bytes]] = [
    ("deflate of nothing valid", "deflate", b"{}"),
    ("deflate garbage", "deflate", b'{"prompt": "=", "messages": true}'),
    ("gzip garbage", "gzip", b'{"prompt": "a"}'),
    ("gzip truncated", "gzip", gzip.compress(b'{"prompt": "' + b"a" * 5000 + b'"}')[:-8]),
    ("deflate truncated", "deflate", zlib.compress(b'{"prompt": "' + b"a" * 5000 + b'"}')[:40]),
    ("deflate of nothing valid, again", "deflate", b"{}"),
]


@pytest.mark.parametrize("which", ["node", "scheduler"])
def test_corrupt_content_encoding_is_answered_in_time(processes: Processes, which: str) -> None:
    """A body whose Content-Encoding does not decode gets a JSON 400 (read in a handler), a
    plain-text 400 (aiohttp's parser) or a JSON 408 (a decoder left waiting), in time;
    never a connection held open."""
    target = processes.targets()[which]
    wait_s = BODY_READ_TIMEOUT_S + 10
    headers = {"Content-Type": "application/json", "Connection": "close"}
    if which == "scheduler":
        headers["Authorization"] = f"Bearer {processes.ctx.api_key}"
    for case, encoding, body in CORRUPT_ENCODINGS:
        try:
            resp = httpx.post(
                f"{target.url}/tokenize",
                content=body,
                headers=headers | {"Content-Encoding": encoding},
                timeout=wait_s,
            )
        except httpx.TimeoutException:
            pytest.fail(f"{which}: {case}: no answer within {wait_s:.0f} s")
        plain_400 = resp.status_code == 400 and resp.headers["Content-Type"].startswith("text/")
        json_4xx = 400 <= resp.status_code < 500 and _error_json(resp) is not None
        # aiohttp decodes a gzip stream cut before its trailer: then the call succeeds.
        assert plain_400 or json_4xx or resp.status_code == 200, (
            case,
            resp.status_code,
            resp.text[:200],
        )
    assert target.child.alive()
