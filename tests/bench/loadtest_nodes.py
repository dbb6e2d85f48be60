#!/usr/bin/env python
"""LOAD-TEST NODES: N fake worker nodes in one process, for scheduler benchmarks ONLY.

!!! This is a load-test engine. It generates nothing and VERIFIES NOTHING: every
!!! rollout is a few fixed token ids with made-up logprobs and an all-zero proof, and
!!! every verdict it signs is "accepted" without looking at the rollout. Never join it
!!! to a pool whose rollouts anyone trains on. It registers with engine="loadtest" so
!!! that a scheduler (and its dashboard) can tell it apart from a real worker.

What it owns: one aiohttp process hosting `--nodes` virtual workers, each with its own
Ed25519 identity, all behind one port with a path prefix per node (node i is
``http://HOST:PORT/n/i``). On the wire each one behaves like a real `prime-node`
(node/server.py, node/worker.py):

- ``POST /n/{i}/v1/rollouts``: opens the signed `RolloutRequest` (signature, expiry,
  replay, trusted sender: the scheduler that admitted it, plus any ``--trusted-key``) and
  answers a `Rollout` signed by node i: ``--completion-tokens`` fixed ids (capped at
  max_tokens), logprob -0.5 each, one 258-byte zero chunk per proof chunk, the node's
  weights version and hash;
- ``POST /n/{i}/v1/verify``: opens the `VerifyRequest` and the generator's `Rollout`
  envelope inside it and answers an accepting `Verdict` signed by node i (a rollout whose
  signer is not the node it names is rejected, as a real worker does, since that costs
  nothing and keeps the wire semantics);
- ``GET /n/{i}/health`` like a node's; ``GET /health`` (always 200) and ``GET /ready``
  (200 once every node is registered, 503 before) for the process; ``GET /stats``: counters
  and heartbeat latencies as JSON.

It registers every node with the scheduler (a `RegisterRequest` signed by the node, with
bounded concurrency and retries on 429/503), prints ``ready`` on stdout once all are in,
then heartbeats each node every ``--heartbeat-s``, spread evenly over the interval (1,000
nodes every 10 s = 100 heartbeats/s). A heartbeat answered 404 re-registers the node; one
answered "banned" stops that node's heartbeats. A heartbeat response carrying newer
trainer-signed weights is adopted at once (the instant engine "loads" them).

``--standalone`` skips the scheduler (serve only; send work signed by a ``--trusted-key``).

    python tests/bench/loadtest_nodes.py --scheduler http://127.0.0.1:8300 --nodes 1000 --port 9100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
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

from protocol.client import RemoteError, call  # noqa: E402
from protocol.codec import CodecError  # noqa: E402
from protocol.envelope import EnvelopeError, ReplayCache, open_envelope, seal  # noqa: E402
from protocol.identity import Identity, public_key_from_node_id  # noqa: E402
from protocol.messages import (  # noqa: E402
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
PROOF_CHUNK_BYTES = 258  # TOPLOC chunk size at top-k 128 (DESIGN.md section 2)
FAKE_LOGPROB = -0.5
ENGINE = "loadtest"


@dataclass
class VirtualNode:
    """One fake worker: identity, URL, weights it claims, lifecycle as the scheduler says."""

    index: int
    identity: Identity
    http_url: str
    weights_version: int = 0
    weights_hash: str = ""
    state: str = "new"  # new | registered | <NodeState from heartbeats> | stopped
    in_flight: int = 0
    outstanding_tokens: int = 0
    stats: dict[str, int] = field(
        default_factory=lambda: {"generated": 0, "generated_tokens": 0, "verified": 0}
    )

    @property
    def node_id(self) -> str:
        return self.identity.node_id


class LoadTestNodes:
    """The process: N virtual nodes, their HTTP routes, registration and heartbeats."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.scheduler = args.scheduler.rstrip("/")
        base = f"http://{args.advertise_host or args.host}:{args.port}"
        self.nodes = [
            VirtualNode(i, Identity.generate(), f"{base}/n/{i}", 0, args.weights_hash)
            for i in range(args.nodes)
        ]
        self.completion = [(args.first_token + k) for k in range(args.completion_tokens)]
        self.replay = ReplayCache()
        self.trusted: set[bytes] = {public_key_from_node_id(k) for k in args.trusted_key}
        self.pool: PoolConfig | None = None
        self.trainer_key: bytes = b""
        self.session: aiohttp.ClientSession | None = None
        self.ready = asyncio.Event()
        self.registered = 0
        self.counters = {
            "rollouts": 0,
            "verifies": 0,
            "refused": 0,
            "register_ok": 0,
            "register_retries": 0,
            "reregistered": 0,
            "heartbeats_ok": 0,
            "heartbeats_failed": 0,
            "heartbeats_late": 0,
            "banned": 0,
            "weights_adopted": 0,
        }
        self.hb_latencies: list[float] = []  # seconds, a bounded window (last 20,000)
        self.register_s = 0.0
        self.started = time.time()

    # -- HTTP server -------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=args_max_body(self.args))
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/ready", self.ready_route),
                web.get("/stats", self.stats_route),
                web.get("/n/{i}/health", self.node_health),
                web.post("/n/{i}/v1/rollouts", self.rollout),
                web.post("/n/{i}/v1/verify", self.verify),
            ]
        )
        return app

    def _node(self, request: web.Request) -> VirtualNode:
        try:
            i = int(request.match_info["i"])
            return self.nodes[i]
        except (ValueError, IndexError):
            raise web.HTTPNotFound(text="no such load-test node") from None

    def _error(self, status: int, message: str, kind: str = "invalid_request_error"):
        self.counters["refused"] += 1
        return web.json_response(
            {"error": {"message": message, "type": kind, "code": status}}, status=status
        )

    async def _open(self, request: web.Request, model):
        raw = await request.read()
        return open_envelope(
            raw,
            model,
            replay_cache=self.replay,
            trusted_senders=self.trusted or None,
            max_bytes=args_max_body(self.args),
        )

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "engine": ENGINE,
                "nodes": len(self.nodes),
                "registered": self.registered,
                "ready": self.ready.is_set(),
            }
        )

    async def ready_route(self, _request: web.Request) -> web.Response:
        status = 200 if self.ready.is_set() else 503
        return web.json_response({"ready": self.ready.is_set()}, status=status)

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
                "uptime_s": time.time() - self.started,
                "register_s": self.register_s,
                **self.counters,
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
            }
        )

    async def rollout(self, request: web.Request) -> web.Response:
        node = self._node(request)
        try:
            opened = await self._open(request, RolloutRequest)
        except EnvelopeError as exc:
            return self._error(exc.status, str(exc), "authentication_error")
        except CodecError as exc:
            return self._error(400, str(exc))
        req = opened.message
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
        return web.Response(body=seal(node.identity, rollout, ttl_s=3600), content_type=MSGPACK)

    async def verify(self, request: web.Request) -> web.Response:
        node = self._node(request)
        try:
            opened = await self._open(request, VerifyRequest)
            inner = open_envelope(opened.message.rollout_envelope, Rollout, check_expiry=False)
        except EnvelopeError as exc:
            return self._error(exc.status, str(exc), "authentication_error")
        except CodecError as exc:
            return self._error(400, str(exc))
        vreq, rollout = opened.message, inner.message
        if vreq.expected_weights_hash and vreq.expected_weights_hash != node.weights_hash:
            return self._error(
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
        return web.Response(body=seal(node.identity, verdict, ttl_s=3600), content_type=MSGPACK)

    # -- Scheduler side ----------------------------------------------------------------
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

    async def register(self, node: VirtualNode) -> None:
        """Register `node`, retrying on 429/503 (rate limits, start-up) with back-off."""
        assert self.session is not None and self.pool is not None
        msg = RegisterRequest(
            pool_id=self.pool.pool_id,
            operator=f"{self.args.operator_prefix}{node.index}",
            http_url=node.http_url,
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
        node.state = "registered"
        self.counters["register_ok"] += 1

    async def register_all(self) -> None:
        sem = asyncio.Semaphore(self.args.register_concurrency)
        t0 = time.perf_counter()

        async def one(node: VirtualNode) -> None:
            async with sem:
                await self.register(node)
                self.registered += 1

        await asyncio.gather(*(one(n) for n in self.nodes))
        self.register_s = time.perf_counter() - t0
        self.ready.set()

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
            if exc.status == 404:  # the scheduler forgot us: register again
                self.counters["reregistered"] += 1
                with contextlib.suppress(RemoteError, aiohttp.ClientError, OSError):
                    await self.register(node)
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
        self._adopt_weights(node, resp.weights_envelope)

    async def heartbeat_loop(self) -> None:
        """Each node every `heartbeat_s`, node k at offset k * heartbeat_s / N in the cycle."""
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
                if node.state in ("banned", "stopped", "left"):
                    continue
                task = asyncio.create_task(one(node))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.sleep(max(0.0, t0 + k * gap - time.monotonic()))

    # -- Lifecycle ---------------------------------------------------------------------
    async def run(self) -> None:
        a = self.args
        connector = aiohttp.TCPConnector(limit=a.pool_connections, ttl_dns_cache=None)
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
                    await self.register_all()
                what = "serving (standalone)" if a.standalone else "registered"
                print(
                    f"ready: {len(self.nodes)} load-test nodes {what} in "
                    f"{self.register_s:.1f} s at http://{a.host}:{a.port}/n/<i>",
                    flush=True,
                )
                if a.heartbeat_s > 0 and not a.standalone:
                    hb = asyncio.create_task(self.heartbeat_loop())
                await stop.wait()
        finally:
            if hb is not None:
                hb.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await hb
            await runner.cleanup()


def args_max_body(args: argparse.Namespace) -> int:
    return int(args.max_body_mib * 2**20)


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
    add("--advertise-host", default="", help="host in the registered URLs (default: --host)")
    add("--port", type=int, required=True, help="port to listen on")
    add("--heartbeat-s", type=float, default=10.0, help="per-node heartbeat period (0: none)")
    add("--completion-tokens", type=int, default=8, help="fake completion length (tokens)")
    add("--first-token", type=int, default=100, help="first fake completion token id")
    add("--weights-hash", default="", help="weights hash to claim until the pool sends one")
    add("--capacity", type=int, default=16, help="RegisterRequest.capacity of every node")
    add("--operator-prefix", default="loadtest-", help="node i's operator is PREFIX<i>")
    add("--trusted-key", action="append", default=[], help="extra node id allowed to send work")
    add("--register-concurrency", type=int, default=32)
    add("--register-attempts", type=int, default=20)
    add("--heartbeat-concurrency", type=int, default=256)
    add("--pool-connections", type=int, default=512, help="client connection pool size")
    add("--request-timeout-s", type=float, default=30.0)
    add("--connect-timeout-s", type=float, default=60.0, help="wait this long for the scheduler")
    add("--max-body-mib", type=float, default=16.0)
    args = ap.parse_args(argv)
    if not args.scheduler and not args.standalone:
        ap.error("--scheduler URL is required (or --standalone)")
    if args.nodes < 1 or args.completion_tokens < 1:
        ap.error("--nodes and --completion-tokens must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"LOAD-TEST ENGINE (benchmarks only, verifies nothing): {args.nodes} virtual nodes",
        file=sys.stderr,
        flush=True,
    )
    try:
        import uvloop  # type: ignore[import-not-found]

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(LoadTestNodes(args).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
