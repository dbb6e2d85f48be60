#!/usr/bin/env python
"""LOAD-TEST NODES: N fake worker nodes in one process, for scheduler benchmarks ONLY.

!!! This is a load-test engine. It generates nothing and VERIFIES NOTHING: every
!!! rollout is a few fixed token ids with made-up logprobs and an all-zero proof, and
!!! every verdict it signs is "accepted" without looking at the rollout. Never join it
!!! to a pool whose rollouts anyone trains on. It registers with engine="loadtest" so
!!! that a scheduler (and its dashboard) can tell it apart from a real worker.

What it owns: one asyncio process hosting `--nodes` virtual workers, each with its own
Ed25519 identity and replay cache. Towards the scheduler each one behaves like a real
`prime-node join` (node/join.py, node/channel.py, node/server.py):

- it registers (a `RegisterRequest` signed by the node, no URL: the scheduler never dials
  a node), with bounded concurrency and retries on 429/503 and connection errors;
- it opens its own node channel, the WebSocket at ``ws://<scheduler>/v1/nodes/connect``
  (`protocol.channel`), pinging every ``--channel-ping-s``, and answers the scheduler's
  challenge with a `ChannelHello` sealed by its own key;
- it answers every call frame that arrives on that channel IN PROCESS (no HTTP hop, unlike
  a real node's `SchedulerLink`, which forwards each call to its own server on loopback),
  with the status and body its HTTP routes would answer:
  ``/v1/rollouts``: opens the signed `RolloutRequest` (signature, expiry, replay, trusted
  sender: the scheduler that admitted it, plus any ``--trusted-key``) and answers a
  `Rollout` signed by the node: ``--completion-tokens`` fixed ids (capped at max_tokens),
  logprob -0.5 each, one 258-byte zero chunk per proof chunk, the node's weights version
  and hash; ``/v1/verify``: opens the `VerifyRequest` and the generator's `Rollout`
  envelope inside it and answers an accepting `Verdict` signed by the node (a rollout whose
  signer is not the node it names is rejected, as a real worker does, since that costs
  nothing and keeps the wire semantics); ``/v1/weights/update``: opens the trainer-signed
  `WeightUpdate` (trusted sender: the pool's trainer) and "loads" it at once, answering 200
  and JSON ``{"weights_version", "weights_hash"}`` as node/server.py does (an update by
  swarm manifest is refused with 400: there is no swarm peer here, as on a node without
  one); any other route: 404. Refusals are JSON ``{"error": {...}}`` bodies with the
  status a node gives (401/403/409 for bad signatures and replays, 400 for bad bodies);
- a channel that closes (a scheduler restart, a dead link: missing pongs) is reopened with
  the real node's backoff (`node.channel`: 0.25 s doubling to ``--reconnect-max-s``, reset
  after a link that stayed up 30 s; no jitter, so after a restart every node retries in
  step, as identical real nodes would); a registration wakes it at once. A channel closed
  with `CLOSE_UNKNOWN_NODE` (the scheduler does not know the node) re-registers the node,
  then reconnects at once; so does a heartbeat answered 404;
- it heartbeats every ``--heartbeat-s``, spread evenly over the interval (1,000 nodes every
  10 s = 100 heartbeats/s). A heartbeat answered "banned" stops that node (heartbeats and
  channel). A heartbeat response carrying newer trainer-signed weights is adopted at once.

All nodes share ONE aiohttp ClientSession with an unlimited connector: 1,000 channels are
1,000 long-lived TCP connections of one process, plus the pooled ones of the heartbeats.

The process also serves HTTP on ``--port`` (the benchmark's "direct" baseline and its
probes), with a path prefix per node (node i is ``http://HOST:PORT/n/i``):
``POST /n/{i}/v1/rollouts``, ``/n/{i}/v1/verify``, ``/n/{i}/v1/weights/update`` (the very
same answers as over the channel: a direct call measures a node's own cost, not the
scheduler's path), ``GET /n/{i}/health`` like a node's; ``GET /health`` (always 200);
``GET /ready`` (200 while every node that is not banned is registered AND has its channel
open, 503 otherwise: it goes back to 503 while a restarted scheduler is away); ``GET
/stats``: counters, open channels, heartbeat latencies as JSON. It prints ``ready`` on
stdout the first time all are registered and connected.

``--standalone`` skips the scheduler (serve HTTP only; send work signed by a
``--trusted-key``); it is ready at once.

    python tests/bench/loadtest_nodes.py --scheduler http://127.0.0.1:8300 --nodes 1000 --port 9100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import resource
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
if str(REPO_ROOT) not in sys.path:  # runs from a checkout, installed or not
    sys.path.insert(0, str(REPO_ROOT))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from node.channel import FIRST_BACKOFF_S, STABLE_S  # noqa: E402
from node.config import NodeChannelConfig  # noqa: E402
from protocol.channel import (  # noqa: E402
    CLOSE_UNKNOWN_NODE,
    answer_frame,
    hello_frame,
    read_call,
    read_challenge,
    ws_url,
)
from protocol.client import RemoteError, call  # noqa: E402
from protocol.codec import CodecError  # noqa: E402
from protocol.envelope import EnvelopeError, ReplayCache, open_envelope, seal  # noqa: E402
from protocol.identity import Identity, public_key_from_node_id  # noqa: E402
from protocol.messages import (  # noqa: E402
    ChannelHello,
    CheckResult,
    Heartbeat,
    HeartbeatResponse,
    PoolConfig,
    RegisterRequest,
    RegisterResponse,
    Rollout,
    RolloutRequest,
    Verdict,
    VerifyRequest,
    WeightUpdate,
)

MSGPACK = "application/msgpack"
JSON = "application/json"
PROOF_CHUNK_BYTES = 258  # TOPLOC chunk size at top-k 128 (DESIGN.md section 2)
FAKE_LOGPROB = -0.5
ENGINE = "loadtest"
STOPPED_STATES = ("banned", "left", "stopped")
NODE_CHANNEL = NodeChannelConfig()  # a real node's channel defaults

Answer = tuple[int, bytes, str]  # status, body, content type


@dataclass
class VirtualNode:
    """One fake worker: identity, weights it claims, lifecycle as the scheduler says."""

    index: int
    identity: Identity
    weights_version: int = 0
    weights_hash: str = ""
    state: str = "new"  # new | registered | <NodeState from heartbeats> | stopped
    registered: bool = False  # the scheduler admitted it (and has not forgotten it since)
    channel_open: bool = False  # hello sent on a channel that is still open
    in_flight: int = 0
    outstanding_tokens: int = 0
    replay: ReplayCache = field(default_factory=ReplayCache)
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # reconnect now
    registering: asyncio.Task | None = None
    channel_task: asyncio.Task | None = None
    stats: dict[str, int] = field(
        default_factory=lambda: {"generated": 0, "generated_tokens": 0, "verified": 0}
    )

    @property
    def node_id(self) -> str:
        return self.identity.node_id


def _error(status: int, message: str, kind: str = "invalid_request_error") -> Answer:
    """The JSON error body of `protocol.http.error_response`."""
    body = {"error": {"message": message, "type": kind, "code": status}}
    return status, json.dumps(body).encode(), JSON


class LoadTestNodes:
    """The process: N virtual nodes, their channels, HTTP routes, registration, heartbeats."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.scheduler = args.scheduler.rstrip("/")
        self.ws_url = ws_url(self.scheduler) if self.scheduler else ""
        self.nodes = [
            VirtualNode(i, Identity.generate(), 0, args.weights_hash) for i in range(args.nodes)
        ]
        self.completion = [(args.first_token + k) for k in range(args.completion_tokens)]
        self.trusted: set[bytes] = {public_key_from_node_id(k) for k in args.trusted_key}
        self.max_body = args_max_body(args)
        self.pool: PoolConfig | None = None
        self.trainer_key: bytes = b""
        self.session: aiohttp.ClientSession | None = None
        self.ready = asyncio.Event()  # set the first time every node is in and connected
        self.registered = 0
        self.channels_open = 0
        self.counters: dict[str, int] = {
            "rollouts": 0,
            "verifies": 0,
            "weights_updates": 0,
            "refused": 0,
            "register_ok": 0,
            "register_retries": 0,
            "register_failed": 0,
            "reregistered": 0,
            "heartbeats_ok": 0,
            "heartbeats_failed": 0,
            "heartbeats_late": 0,
            "banned": 0,
            "weights_adopted": 0,
            "channel_opens": 0,
            "channel_open_failures": 0,
            "channel_calls": 0,
            "channel_bad_frames": 0,
        }
        self.channel_closes: dict[str, int] = {}  # close code (or "error") -> count
        self.hb_latencies: list[float] = []  # seconds, a bounded window (last 20,000)
        self.register_s = 0.0
        self.connect_s = 0.0
        self.started = time.time()
        self.t0 = time.perf_counter()

    # -- the node's answers (the channel and the HTTP routes alike) --------------------
    def answer(self, node: VirtualNode, route: str, raw: bytes) -> Answer:
        handler = {
            "/v1/rollouts": self._rollout,
            "/v1/verify": self._verify,
            "/v1/weights/update": self._weights_update,
        }.get(route)
        if handler is None:
            return _error(404, f"no route {route[:80]} on a load-test node", "not_found_error")
        try:
            status, body, kind = handler(node, raw)
        except EnvelopeError as exc:
            status, body, kind = _error(exc.status, str(exc), "authentication_error")
        except CodecError as exc:
            status, body, kind = _error(400, str(exc))
        except Exception as exc:  # noqa: BLE001 - a node's server answers 500, keeps serving
            print(f"node {node.index}: {route} failed: {exc!r}", file=sys.stderr)
            status, body, kind = _error(500, f"{type(exc).__name__}: {exc}", "server_error")
        if status >= 300:
            self.counters["refused"] += 1
        return status, body, kind

    def _open(self, node: VirtualNode, raw: bytes, model, trusted: set[bytes] | None):
        return open_envelope(
            raw,
            model,
            replay_cache=node.replay,
            trusted_senders=trusted or None,
            max_bytes=self.max_body,
        )

    def _rollout(self, node: VirtualNode, raw: bytes) -> Answer:
        req = self._open(node, raw, RolloutRequest, self.trusted).message
        n = min(len(self.completion), req.sampling.max_tokens)
        completion = self.completion[:n]
        chunks = math.ceil(n / req.proof.chunk_tokens)
        rollout = Rollout(
            request_id=req.request_id,
            pool_id=req.pool_id,
            node_id=node.node_id,
            prompt_ids=req.prompt_ids,
            completion_ids=completion,
            logprobs=[FAKE_LOGPROB] * n,
            finish_reason="length" if n == req.sampling.max_tokens else "stop",
            sampling=req.sampling,
            seed=req.seed,
            weights_version=node.weights_version,
            weights_hash=node.weights_hash,
            proof_params=req.proof,
            proof=[bytes(PROOF_CHUNK_BYTES)] * chunks,
        )
        node.stats["generated"] += 1
        node.stats["generated_tokens"] += n
        self.counters["rollouts"] += 1
        return 200, seal(node.identity, rollout, ttl_s=3600), MSGPACK

    def _verify(self, node: VirtualNode, raw: bytes) -> Answer:
        vreq = self._open(node, raw, VerifyRequest, self.trusted).message
        inner = open_envelope(vreq.rollout_envelope, Rollout, check_expiry=False)
        rollout = inner.message
        if vreq.expected_weights_hash and vreq.expected_weights_hash != node.weights_hash:
            return _error(
                400,
                f"this node holds weights {node.weights_hash[:12]}, "
                f"not {vreq.expected_weights_hash[:12]}",
            )
        if inner.sender_id != rollout.node_id:
            checks = [
                CheckResult(
                    name="signature",
                    passed=False,
                    detail=f"signed by {inner.sender_id}, claims to be from {rollout.node_id}",
                )
            ]
        else:
            checks = [
                CheckResult(name="loadtest", passed=True, detail="load-test engine: not verified")
            ]
        verdict = Verdict(
            request_id=rollout.request_id,
            rollout_digest=rollout.digest(),
            generator_id=rollout.node_id,
            verifier_id=node.node_id,
            weights_hash=node.weights_hash,
            accepted=all(c.passed for c in checks),
            checks=checks,
        )
        node.stats["verified"] += 1
        self.counters["verifies"] += 1
        return 200, seal(node.identity, verdict, ttl_s=3600), MSGPACK

    def _weights_update(self, node: VirtualNode, raw: bytes) -> Answer:
        """node/server.py's `weights_update`: a trainer-signed update, loaded at once (the
        instant engine loads nothing); the weights now held, as JSON."""
        trusted = {self.trainer_key} if self.trainer_key else self.trusted
        update = self._open(node, raw, WeightUpdate, trusted).message
        if update.manifest:
            return _error(400, "this node runs no swarm peer: it cannot fetch by manifest")
        node.weights_version = update.version
        node.weights_hash = update.weights_hash or f"loadtest-v{update.version}"
        self.counters["weights_updates"] += 1
        held = {"weights_version": node.weights_version, "weights_hash": node.weights_hash}
        return 200, json.dumps(held).encode(), JSON

    # -- HTTP server -------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body)
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/ready", self.ready_route),
                web.get("/stats", self.stats_route),
                web.get("/n/{i}/health", self.node_health),
                web.post("/n/{i}/v1/{route:rollouts|verify|weights/update}", self.direct),
            ]
        )
        return app

    def _node(self, request: web.Request) -> VirtualNode:
        try:
            i = int(request.match_info["i"])
            return self.nodes[i]
        except (ValueError, IndexError):
            raise web.HTTPNotFound(text="no such load-test node") from None

    async def direct(self, request: web.Request) -> web.Response:
        """A call straight to node i (the benchmark's baseline): the channel's answer."""
        node = self._node(request)
        raw = await request.read()
        status, body, kind = self.answer(node, "/v1/" + request.match_info["route"], raw)
        return web.Response(status=status, body=body, content_type=kind)

    def _active(self) -> int:
        return sum(n.state not in STOPPED_STATES for n in self.nodes)

    def is_ready(self) -> bool:
        if self.args.standalone:
            return True
        active = self._active()
        return active > 0 and self.registered >= active and self.channels_open >= active

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "engine": ENGINE,
                "nodes": len(self.nodes),
                "registered": self.registered,
                "channels_open": self.channels_open,
                "ready": self.is_ready(),
            }
        )

    async def ready_route(self, _request: web.Request) -> web.Response:
        ready = self.is_ready()
        return web.json_response(
            {
                "ready": ready,
                "registered": self.registered,
                "channels_open": self.channels_open,
                "nodes": len(self.nodes),
            },
            status=200 if ready else 503,
        )

    async def stats_route(self, _request: web.Request) -> web.Response:
        lat = sorted(self.hb_latencies)
        states: dict[str, int] = {}
        for n in self.nodes:
            states[n.state] = states.get(n.state, 0) + 1
        return web.json_response(
            {
                "engine": ENGINE,
                "nodes": len(self.nodes),
                "states": states,
                "registered": self.registered,
                "channels_open": self.channels_open,
                "ready": self.is_ready(),
                "uptime_s": time.time() - self.started,
                "register_s": self.register_s,
                "connect_s": self.connect_s,
                **self.counters,
                "channel_closes": dict(self.channel_closes),
                "heartbeat_latency_s": {
                    "n": len(lat),
                    "p50": _pct(lat, 50),
                    "p99": _pct(lat, 99),
                    "max": lat[-1] if lat else None,
                },
            }
        )

    async def node_health(self, request: web.Request) -> web.Response:
        node = self._node(request)
        return web.json_response(
            {
                "status": "ok",
                "engine": ENGINE,
                "node_id": node.node_id,
                "weights_version": node.weights_version,
                "weights_hash": node.weights_hash,
                "outstanding": node.in_flight,
                "stats": node.stats,
                "channel_open": node.channel_open,
            }
        )

    # -- Scheduler side: pool, registration --------------------------------------------
    async def fetch_pool(self) -> None:
        assert self.session is not None
        deadline = time.monotonic() + self.args.connect_timeout_s
        while True:
            try:
                async with self.session.get(f"{self.scheduler}/v1/pool") as resp:
                    resp.raise_for_status()
                    raw = await resp.read()
                break
            except (aiohttp.ClientError, OSError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        self.pool = open_envelope(raw, PoolConfig, check_expiry=False).message
        self.trainer_key = self.pool.trainer_public_key

    def _adopt_weights(self, node: VirtualNode, envelope: bytes) -> None:
        """Take a trainer-signed WeightUpdate at once (the instant engine loads nothing)."""
        if not envelope:
            return
        try:
            update = open_envelope(
                envelope, WeightUpdate, trusted_senders={self.trainer_key}, check_expiry=False
            ).message
        except (EnvelopeError, CodecError) as exc:
            print(f"node {node.index}: refusing weights envelope: {exc}", file=sys.stderr)
            return
        if update.version >= node.weights_version:
            node.weights_version = update.version
            node.weights_hash = update.weights_hash or f"loadtest-v{update.version}"
            self.counters["weights_adopted"] += 1

    def _set_registered(self, node: VirtualNode, registered: bool) -> None:
        if node.registered != registered:
            node.registered = registered
            self.registered += 1 if registered else -1
            self._check_ready()

    def _set_open(self, node: VirtualNode, is_open: bool) -> None:
        if node.channel_open != is_open:
            node.channel_open = is_open
            self.channels_open += 1 if is_open else -1
            self._check_ready()

    def _check_ready(self) -> None:
        if not self.ready.is_set() and self.is_ready():
            self.connect_s = time.perf_counter() - self.t0
            self.ready.set()

    async def register(self, node: VirtualNode) -> None:
        """Register `node`, retrying on 429/503 and connection errors with back-off."""
        assert self.session is not None and self.pool is not None
        msg = RegisterRequest(
            pool_id=self.pool.pool_id,
            operator=f"{self.args.operator_prefix}{node.index}",
            engine=ENGINE,
            model=self.pool.model,
            weights_version=node.weights_version,
            weights_hash=node.weights_hash,
            capacity=self.args.capacity,
        )
        delay = 0.2
        for attempt in range(self.args.register_attempts):
            try:
                opened, _ = await call(
                    self.session,
                    f"{self.scheduler}/v1/nodes/register",
                    node.identity,
                    msg,
                    RegisterResponse,
                )
                break
            except RemoteError as exc:
                if exc.status not in (429, 503) or attempt + 1 == self.args.register_attempts:
                    raise
            except (TimeoutError, aiohttp.ClientError, OSError):
                if attempt + 1 == self.args.register_attempts:
                    raise
            self.counters["register_retries"] += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        resp = opened.message
        self.trusted.add(public_key_from_node_id(resp.scheduler_id))
        self._adopt_weights(node, resp.weights_envelope)
        if node.state not in STOPPED_STATES:
            node.state = "registered"
        self.counters["register_ok"] += 1
        self._set_registered(node, True)
        node.wake.set()  # a (re-)registration closed any older channel: reopen now

    async def ensure_registered(self, node: VirtualNode) -> None:
        """Register `node` again (one registration at a time per node); raises if it failed."""
        if node.registering is None or node.registering.done():
            self._set_registered(node, False)
            node.registering = asyncio.create_task(self.register(node))
        await asyncio.shield(node.registering)

    def start_channel(self, node: VirtualNode) -> None:
        if node.channel_task is None or node.channel_task.done():
            node.channel_task = asyncio.create_task(self.channel_loop(node))

    async def register_all(self) -> None:
        sem = asyncio.Semaphore(self.args.register_concurrency)
        t0 = time.perf_counter()

        async def one(node: VirtualNode) -> None:
            async with sem:
                await self.ensure_registered(node)
            self.start_channel(node)

        await asyncio.gather(*(one(n) for n in self.nodes))
        self.register_s = time.perf_counter() - t0

    # -- The node channels -------------------------------------------------------------
    async def channel_loop(self, node: VirtualNode) -> None:
        """Keep `node`'s channel open: `node.channel.SchedulerLink.run_forever`'s backoff,
        with calls answered here; re-register when the scheduler does not know the node."""
        loop = asyncio.get_running_loop()
        failures = 0
        while node.state not in STOPPED_STATES:
            started = loop.time()
            try:
                code = await self._channel_once(node)
                why = str(code)
            except (aiohttp.ClientError, OSError, TimeoutError, CodecError) as exc:
                code, why = None, "error"
                if not isinstance(exc, CodecError):
                    self.counters["channel_open_failures"] += 1
                else:
                    self.counters["channel_bad_frames"] += 1
            finally:
                self._set_open(node, False)
            self.channel_closes[why] = self.channel_closes.get(why, 0) + 1
            if loop.time() - started > STABLE_S:
                failures = 0
            failures += 1
            delay = min(self.args.reconnect_max_s, FIRST_BACKOFF_S * 2 ** (failures - 1))
            if code == CLOSE_UNKNOWN_NODE:
                self.counters["reregistered"] += 1
                try:
                    await self.ensure_registered(node)  # sets `wake`: reconnect at once
                except (RemoteError, TimeoutError, aiohttp.ClientError, OSError) as exc:
                    self.counters["register_failed"] += 1
                    print(f"node {node.index}: registering again failed: {exc}", file=sys.stderr)
            if node.wake.is_set():
                delay = 0.0
            node.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(node.wake.wait(), delay)

    async def _channel_once(self, node: VirtualNode) -> int | None:
        """Open the channel, answer calls until it closes; its close code."""
        assert self.session is not None and self.pool is not None
        ping_s = self.args.channel_ping_s
        async with self.session.ws_connect(
            self.ws_url,
            heartbeat=ping_s,
            max_msg_size=self.max_body,
            timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=5.0),
        ) as ws:
            first = await ws.receive(timeout=ping_s * 2)
            if first.type != aiohttp.WSMsgType.BINARY:
                return ws.close_code
            challenge = read_challenge(first.data, self.max_body)
            hello = ChannelHello(
                node_id=node.node_id, pool_id=self.pool.pool_id, challenge=challenge
            )
            await ws.send_bytes(hello_frame(seal(node.identity, hello)))
            node.wake.clear()  # a registration from now on is one this channel predates
            self.counters["channel_opens"] += 1
            self._set_open(node, True)
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    break
                call_id, route, body = read_call(msg.data, self.max_body)
                self.counters["channel_calls"] += 1
                node.in_flight += 1
                try:
                    status, data, _ = self.answer(node, route, body)
                finally:
                    node.in_flight -= 1
                try:
                    await ws.send_bytes(answer_frame(call_id, status, data))
                except ConnectionError:
                    break
            return ws.close_code

    # -- Heartbeats --------------------------------------------------------------------
    async def heartbeat(self, node: VirtualNode) -> None:
        assert self.session is not None
        msg = Heartbeat(
            node_id=node.node_id,
            weights_version=node.weights_version,
            weights_hash=node.weights_hash,
            outstanding_tokens=node.outstanding_tokens,
            stats=node.stats,
        )
        t0 = time.perf_counter()
        try:
            opened, _ = await call(
                self.session,
                f"{self.scheduler}/v1/nodes/heartbeat",
                node.identity,
                msg,
                HeartbeatResponse,
            )
        except RemoteError as exc:
            self.counters["heartbeats_failed"] += 1
            if exc.status == 404:  # the scheduler forgot us (or declared us dead): register
                self.counters["reregistered"] += 1
                try:
                    await self.ensure_registered(node)
                except (RemoteError, TimeoutError, aiohttp.ClientError, OSError):
                    self.counters["register_failed"] += 1
                self.start_channel(node)
            return
        except (TimeoutError, aiohttp.ClientError, OSError, EnvelopeError, CodecError):
            self.counters["heartbeats_failed"] += 1
            return
        self.hb_latencies.append(time.perf_counter() - t0)
        if len(self.hb_latencies) > 40_000:
            del self.hb_latencies[:20_000]
        self.counters["heartbeats_ok"] += 1
        resp = opened.message
        node.state = resp.state
        if resp.state == "banned":
            self.counters["banned"] += 1
            node.wake.set()  # its channel loop sees the state and ends
            self._check_ready()
        self._adopt_weights(node, resp.weights_envelope)

    async def heartbeat_loop(self) -> None:
        """Each registered node every `heartbeat_s`, node k at offset k * heartbeat_s / N."""
        n = len(self.nodes)
        gap = self.args.heartbeat_s / n
        sem = asyncio.Semaphore(self.args.heartbeat_concurrency)
        tasks: set[asyncio.Task] = set()
        t0 = time.monotonic()
        k = 0

        async def one(node: VirtualNode) -> None:
            async with sem:
                await self.heartbeat(node)

        while True:
            now = time.monotonic()
            due = int((now - t0) / gap) + 1  # heartbeats whose slot has started
            if due - k > n:  # more than a whole cycle behind: skip, and count it
                self.counters["heartbeats_late"] += due - k - n
                k = due - n
            while k < due:
                node = self.nodes[k % n]
                k += 1
                if node.state in STOPPED_STATES or node.state == "new":
                    continue  # not registered yet (or never again)
                task = asyncio.create_task(one(node))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.sleep(max(0.0, t0 + k * gap - time.monotonic()))

    # -- Lifecycle ---------------------------------------------------------------------
    async def run(self) -> None:
        a = self.args
        # Unlimited: every channel holds one connection for good.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=None)
        timeout = aiohttp.ClientTimeout(total=a.request_timeout_s)
        runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, a.host, a.port, backlog=4096, reuse_address=True)
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        hb: asyncio.Task | None = None
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                self.session = session
                if a.standalone:
                    self.ready.set()
                else:
                    await self.fetch_pool()
                    if a.heartbeat_s > 0:
                        hb = asyncio.create_task(self.heartbeat_loop())
                    await self.register_all()
                    waiting = asyncio.create_task(self.ready.wait())
                    await asyncio.wait(
                        {waiting, asyncio.create_task(stop.wait())},
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    waiting.cancel()
                what = (
                    "serving (standalone)"
                    if a.standalone
                    else f"registered in {self.register_s:.1f} s, all channels open in "
                    f"{self.connect_s:.1f} s,"
                )
                print(
                    f"ready: {len(self.nodes)} load-test nodes {what} "
                    f"at http://{a.host}:{a.port}/n/<i>",
                    flush=True,
                )
                await stop.wait()
        finally:
            tasks = [t for t in (hb, *(n.channel_task for n in self.nodes)) if t is not None]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await runner.cleanup()


def args_max_body(args: argparse.Namespace) -> int:
    return int(args.max_body_mib * 2**20)


def raise_fd_limit() -> None:
    """Every channel is a socket: lift the soft open-files limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _pct(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=1000, method="inclusive")[int(q * 10) - 1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = ap.add_argument
    add("--scheduler", default="", help="scheduler base URL, e.g. http://127.0.0.1:8300")
    add("--standalone", action="store_true", help="no scheduler: serve only (tests, direct calls)")
    add("--nodes", type=int, default=1000, help="virtual nodes in this process")
    add("--host", default="127.0.0.1", help="address to listen on")
    add("--port", type=int, required=True, help="port to listen on")
    add("--heartbeat-s", type=float, default=10.0, help="per-node heartbeat period (0: none)")
    add(
        "--channel-ping-s",
        type=float,
        default=NODE_CHANNEL.ping_interval_s,
        help="WebSocket ping period of each channel (a real node's default)",
    )
    add(
        "--reconnect-max-s",
        type=float,
        default=NODE_CHANNEL.reconnect_max_s,
        help="longest wait between two attempts to open a channel (a real node's default)",
    )
    add("--completion-tokens", type=int, default=8, help="fake completion length (tokens)")
    add("--first-token", type=int, default=100, help="first fake completion token id")
    add("--weights-hash", default="", help="weights hash to claim until the pool sends one")
    add("--capacity", type=int, default=16, help="RegisterRequest.capacity of every node")
    add("--operator-prefix", default="loadtest-", help="node i's operator is PREFIX<i>")
    add("--trusted-key", action="append", default=[], help="extra node id allowed to send work")
    add("--register-concurrency", type=int, default=32)
    add("--register-attempts", type=int, default=20)
    add("--heartbeat-concurrency", type=int, default=256)
    add("--request-timeout-s", type=float, default=30.0)
    add("--connect-timeout-s", type=float, default=60.0, help="wait this long for the scheduler")
    add("--max-body-mib", type=float, default=16.0, help="largest call or HTTP body taken")
    args = ap.parse_args(argv)
    if not args.scheduler and not args.standalone:
        ap.error("--scheduler URL is required (or --standalone)")
    if args.nodes < 1 or args.completion_tokens < 1:
        ap.error("--nodes and --completion-tokens must be positive")
    if args.channel_ping_s <= 0 or args.reconnect_max_s <= 0:
        ap.error("--channel-ping-s and --reconnect-max-s must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"LOAD-TEST ENGINE (benchmarks only, verifies nothing): {args.nodes} virtual nodes",
        file=sys.stderr,
        flush=True,
    )
    raise_fd_limit()
    try:
        import uvloop  # type: ignore[import-not-found]

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(LoadTestNodes(args).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
