"""The scheduler daemon's HTTP API (aiohttp) and the lifecycle of the pool's nodes.

Routes (internal bodies are signed msgpack envelopes, see `protocol.envelope`):
- GET  /health, GET /v1/pool (the owner-signed pool config, untouched)
- nodes: POST /v1/nodes/register, /v1/nodes/heartbeat, /v1/nodes/deregister; GET
  /v1/nodes/connect, the WebSocket each node opens and every call to it goes over
  (`scheduler.channel`: the scheduler never dials a node)
- orchestrator (trainer key only): POST /v1/rollouts/submit, /v1/rollouts/results,
  /v1/weights
- swarm tracker (nodes and the trainer): POST /v1/swarm/announce (see `scheduler.tracker`)
- OpenAI-compatible, with the pool owner's API keys: GET /v1/models, POST
  /v1/chat/completions, /v1/completions, /tokenize (see `scheduler.openai_front`)
- operators: GET /dashboard, GET /v1/dashboard/state, GET /metrics

Invariants:
- Every bad input gets a 4xx with a JSON error and one log line; the daemon keeps serving.
- Every signed route checks signature, expiry and replay (nonce) before anything else,
  then the sender's rate limit; per-address limits apply to every route.
- Node state that matters (admission, state, reputation, bans) is written to the database;
  heartbeats are kept in memory and written in batches. Every published weights version's
  hash is kept (`scheduler.ledger`) so rollouts are checked against it after a restart.
- A node is healthy only while its channel is open (a hello signed by its key) and its
  heartbeats arrive; until then, and whenever the channel drops, it gets no work.
- A node silent past `unhealthy_after_s` gets no work; past `dead_after_s` it is dead and
  its in-flight work is re-dispatched.
- The server builds the dispatcher's parts (`scheduler.store.Store`, the node-call layer
  `scheduler.node_calls.NodeCalls`) and reaches the dispatcher only through its public
  surface (start/stop, submit, results_after, kick, node_gone, queued, status); it writes
  no node field itself (the registry and the lifecycle do).
- Replicas (`scheduler.lease`): only the holder of the database lease loads state and
  serves; a standby answers 503 (except /health and /v1/pool) until the lease is free, then
  takes over exactly like a restart. Two replicas never dispatch together.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections import Counter
from pathlib import Path

from aiohttp import web
from sqlalchemy import select

from protocol.channel import CONNECT_ROUTE
from protocol.client import RemoteError
from protocol.envelope import ReplayCache, open_envelope, seal
from protocol.http import (
    MSGPACK,
    body_timeout_middleware,
    error_middleware,
    error_response,
    serve_app,
)
from protocol.identity import Identity
from protocol.messages import (
    Deregister,
    Heartbeat,
    HeartbeatResponse,
    NodeAck,
    RegisterRequest,
    RegisterResponse,
    ResultsPage,
    ResultsQuery,
    RolloutResult,
    SubmitAck,
    SubmitRollouts,
    SwarmAnnounce,
    WeightUpdate,
)
from scheduler import db
from scheduler.admission import Refused, admit
from scheduler.channel import ChannelClosed, NodeChannels
from scheduler.config import SchedulerConfig
from scheduler.dashboard import dashboard_routes
from scheduler.dispatch import Dispatcher, Saturated
from scheduler.lease import ReplicaLease
from scheduler.ledger import StaleUpdate, WeightsLedger
from scheduler.lifecycle import DRAIN, LEAVE, RESTART_RESTORE, allowed, transition
from scheduler.metrics import SchedulerMetrics
from scheduler.node_calls import NodeCalls
from scheduler.openai_front import OpenAIFront
from scheduler.pool import read_pool
from scheduler.ratelimit import RateLimited, RateLimiter
from scheduler.registry import NodeRecord, Registry
from scheduler.store import Store
from scheduler.tracker import Tracker

log = logging.getLogger("prime.scheduler")
SEEN_FLUSH_S = 5.0
STANDBY_ROUTES = frozenset({"/health", "/v1/pool"})


class SchedulerServer:
    def __init__(self, cfg: SchedulerConfig, identity: Identity):
        self.cfg = cfg
        self.identity = identity
        self.pool = read_pool(cfg.pool_file)
        self.pool_id = self.pool.config.pool_id
        self.trainer_key = self.pool.config.trainer_public_key
        self.metrics = SchedulerMetrics()
        self.registry = Registry(
            self.pool.config.reputation,
            cfg.dispatch.probation,
            self.pool.config.checkers,
            self.pool.config.founding_checkers(),
        )
        self.replay = ReplayCache()
        rl = cfg.rate_limits
        self.by_identity = RateLimiter(rl.per_identity_per_s, rl.per_identity_burst, "node key")
        self.by_address = RateLimiter(rl.per_address_per_s, rl.per_address_burst, "address")
        self.new_nodes = RateLimiter(
            rl.new_nodes_per_address_per_min / 60,
            max(1, int(rl.new_nodes_per_address_per_min)),
            "address (new node keys)",
        )
        self.engine = db.create_engine(cfg.database.url)
        self.writer = db.Writer(self.engine, cfg.database.flush_interval_ms / 1000)
        self.channels = NodeChannels(
            self.registry,
            self.pool_id,
            cfg.channel,
            self.replay,
            self._channel_opened,
            self._channel_closed,
        )
        self.ledger = WeightsLedger()
        # The dispatcher's parts: the store (durable state) and the node-call layer.
        self.store = Store(self.engine, self.writer, self.pool_id)
        self.calls = NodeCalls(self.channels, self.store.persist_node)
        self.dispatcher = Dispatcher(
            self.pool,
            identity,
            self.registry,
            self.store,
            self.calls,
            cfg.dispatch,
            self.metrics,
            self.ledger,
        )
        self.openai = OpenAIFront(self.dispatcher, self.pool, cfg.openai, cfg.dispatch)
        self.tracker = Tracker(cfg.lifecycle.swarm_announce_interval_s)
        self._seen_dirty: set[str] = set()
        self._tasks: list[asyncio.Task] = []
        self.replica_id = cfg.replica.replica_id or (f"{socket.gethostname()}:{cfg.server.port}")
        self.lease = ReplicaLease(self.engine, self.replica_id, cfg.replica.lease_s)

    @property
    def active(self) -> bool:
        return self.lease.active

    # -- app -------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.cfg.server.max_body_bytes,
            middlewares=[
                self.metrics.error_middleware(),
                error_middleware(log, {RateLimited: 429, Refused: 403, ValueError: 400}),
                self._standby_guard,
                self._address_limit,
                body_timeout_middleware(self.cfg.server.body_read_timeout_s, log),
            ],
        )
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/v1/pool", self.get_pool),
                web.post("/v1/nodes/register", self.register),
                web.post("/v1/nodes/heartbeat", self.heartbeat),
                web.post("/v1/nodes/deregister", self.deregister),
                web.get(CONNECT_ROUTE, self.channels.handler),
                web.post("/v1/rollouts/submit", self.submit),
                web.post("/v1/rollouts/results", self.results),
                web.post("/v1/weights", self.weights),
                web.post("/v1/swarm/announce", self.swarm_announce),
                *self.openai.routes(),
                *dashboard_routes(self.dashboard_state),
                *self.metrics.routes(self._refresh_gauges),
            ]
        )
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app) -> None:
        await db.migrate(self.engine, self.cfg.database.url)
        self.writer.start()
        if not await self.lease.acquire(self._activate):
            log.info("standby: replica %s holds the pool's lease", self.lease.holder)
        self._tasks.append(asyncio.create_task(self.lease.run(self._activate), name="lease"))

    async def _activate(self) -> None:
        await self._load_state()
        await self.dispatcher.start()
        self._tasks += [
            asyncio.create_task(self._monitor(), name="monitor"),
            asyncio.create_task(self._flush_seen(), name="flush-seen"),
        ]
        log.info(
            "scheduler %s (replica %s) serving pool %s (%d nodes known, weights v%d)",
            self.identity.node_id,
            self.replica_id,
            self.pool_id,
            len(self.registry.nodes),
            self.ledger.version,
        )

    async def _on_shutdown(self, _app) -> None:
        await self.channels.close_all()  # the nodes reconnect to whichever replica serves

    async def _on_cleanup(self, _app) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.active:
            await self.dispatcher.stop()
            self._write_seen()
        await self.writer.stop()
        await self.engine.dispose()

    async def _load_state(self) -> None:
        await self.ledger.load(self.engine)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(select(db.nodes))).all()
        for r in rows:
            node = NodeRecord(**{k: v for k, v in r._mapping.items() if k != "pool_id"})
            # A restart is not the nodes' fault: give them a fresh heartbeat window.
            if node.state in ("healthy", "registered", "unhealthy", "draining"):
                self.registry.touch(node)
            if node.state == "healthy":
                transition(node, "unhealthy", RESTART_RESTORE)  # until it reconnects
            self.registry.add(node)

    # -- middleware and helpers -------------------------------------------------------
    @web.middleware
    async def _standby_guard(self, request: web.Request, handler):
        if not self.active and request.path not in STANDBY_ROUTES:
            raise web.HTTPServiceUnavailable(
                text=f"standby replica: the active scheduler is {self.lease.holder}",
                headers={"Retry-After": "1"},
            )
        return await handler(request)

    @web.middleware
    async def _address_limit(self, request: web.Request, handler):
        address = request.remote or ""
        if address not in self.cfg.rate_limits.exempt_addresses:
            self.by_address.check(address, address)
        return await handler(request)

    async def _open(self, request: web.Request, model, trusted: set[bytes] | None = None):
        opened = open_envelope(
            await request.read(),
            model,
            replay_cache=self.replay,
            trusted_senders=trusted,
            max_bytes=self.cfg.server.max_body_bytes,
        )
        if opened.sender != self.trainer_key:
            self.by_identity.check(opened.sender, opened.sender_id)
        return opened

    def _signed(self, message) -> web.Response:
        return web.Response(body=seal(self.identity, message), content_type=MSGPACK)

    def _node(self, opened) -> NodeRecord:
        node = self.registry.get(opened.sender_id)
        if node is None:
            raise web.HTTPNotFound(
                text=f"node {opened.sender_id} is not registered: register first"
            )
        return node

    # -- routes: pool and nodes --------------------------------------------------------
    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok" if self.active else "standby",
                "replica": self.replica_id,
                "pool_id": self.pool_id,
                "scheduler_id": self.identity.node_id,
                # Nodes compare clocks with it (`prime-node doctor`): envelopes expire.
                "time": time.time(),
                "nodes": self.registry.counts(),
                "weights_version": self.ledger.version,
                # Healthy nodes per weights version: the orchestrator waits for the pool to
                # hold a new version before it asks for rollouts of it.
                "healthy_versions": dict(
                    Counter(str(n.weights_version) for n in self.registry.healthy())
                ),
                "queued": self.dispatcher.queued,
                "open_requests": self.dispatcher.open_requests,
                # Weight swarms the tracker knows: members and seeds per manifest hash.
                "swarms": self.tracker.counts(),
            }
        )

    async def get_pool(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.pool.envelope, content_type=MSGPACK)

    async def register(self, request: web.Request) -> web.Response:
        opened = await self._open(request, RegisterRequest)
        req = opened.message
        node_id = opened.sender_id
        existing = self.registry.get(node_id)
        address = request.remote or ""
        if existing is None and address not in self.cfg.rate_limits.exempt_addresses:
            self.new_nodes.check(address, address)  # identities are free: cap their minting
        try:
            await admit(self.engine, self.pool, opened, existing)
        except Refused as exc:
            log.warning("registration of %s refused: %s", node_id, exc)
            return error_response(exc.status, str(exc), "admission_error")
        now = time.time()
        node = NodeRecord(
            node_id=node_id,
            public_key=opened.sender,
            operator=req.operator,
            address=request.remote or "",
            engine=req.engine,
            model=req.model,
            capacity=req.capacity,
            state="registered",
            reputation=existing.reputation if existing else self.pool.config.reputation.initial,
            weights_version=req.weights_version,
            weights_hash=req.weights_hash,
            registered_at=existing.registered_at if existing else now,
            last_seen=now,
        )
        if existing is not None:
            # It restarted: its calls are gone, and it opens a new channel.
            self.dispatcher.node_gone(existing, "the node registered again")
        self.registry.add(node)
        await self.store.persist_node(node)
        log.info("admitted %s (%s) from %s", node_id, req.operator or "no operator", node.address)
        self.dispatcher.kick()
        return self._signed(
            RegisterResponse(
                node_id=node_id,
                pool_id=self.pool_id,
                scheduler_id=self.identity.node_id,
                heartbeat_interval_s=self.cfg.lifecycle.heartbeat_interval_s,
                weights_envelope=self.ledger.envelope,
            )
        )

    async def heartbeat(self, request: web.Request) -> web.Response:
        opened = await self._open(request, Heartbeat)
        node = self._node(opened)
        hb = opened.message
        self.metrics.heartbeats_total.inc()
        if node.state not in ("banned", "left", "dead"):
            was = node.state
            # A heartbeat does not end a run of failing calls: a benched node stays out of
            # work until its bench ends (`scheduler.node_calls`).
            self.registry.heard(node, hb)
            self._seen_dirty.add(node.node_id)
            if node.state != was:
                # A state change is durable at once (a restart must not forget it).
                self.store.persist_node(node)
            if node.state != was or self.dispatcher.queued:
                # A node that became healthy or loaded new weights may take queued work.
                self.dispatcher.kick()
        elif node.state == "dead":
            raise web.HTTPNotFound(text="this node was declared dead: register again")
        behind = node.weights_version < self.ledger.version
        return self._signed(
            HeartbeatResponse(
                state=node.state, weights_envelope=self.ledger.envelope if behind else b""
            )
        )

    async def deregister(self, request: web.Request) -> web.Response:
        opened = await self._open(request, Deregister)
        node = self._node(opened)
        self.registry.touch(node)  # a draining node polls here instead of heartbeating
        to, event = ("draining", DRAIN) if opened.message.stage == "drain" else ("left", LEAVE)
        # A node that left or died stays so (registering again makes a new record).
        if node.state != "banned" and allowed(node.state, to, event):
            transition(node, to, event)
            await self.store.persist_node(node)
            log.info("%s is %s", node.label, node.state)
        if node.state == "left":
            self.dispatcher.node_gone(node)
        return self._signed(NodeAck(state=node.state, in_flight=node.in_flight))

    # -- routes: orchestrator ----------------------------------------------------------
    async def submit(self, request: web.Request) -> web.Response:
        opened = await self._open(request, SubmitRollouts, trusted={self.trainer_key})
        if opened.message.pool_id != self.pool_id:
            raise web.HTTPNotFound(text=f"this scheduler runs pool {self.pool_id!r}")
        try:
            accepted, duplicates = await self.dispatcher.submit(opened.message.requests)
        except Saturated as exc:
            raise web.HTTPServiceUnavailable(text=str(exc), headers={"Retry-After": "1"}) from exc
        return self._signed(SubmitAck(accepted=accepted, duplicates=duplicates))

    async def results(self, request: web.Request) -> web.Response:
        q = (await self._open(request, ResultsQuery, trusted={self.trainer_key})).message
        rows = await self.dispatcher.results_after(q.after, q.limit, q.wait_s)
        page = [
            RolloutResult(
                seq=r.seq,
                request_id=r.request_id,
                source=r.source,
                status=r.status,
                detail=r.detail,
                weights_version=r.weights_version,
                rollout_envelope=r.rollout_envelope,
                verdict_envelopes=_unpack_list(r.verdict_envelopes),
            )
            for r in rows
        ]
        return self._signed(ResultsPage(results=page, last_seq=page[-1].seq if page else q.after))

    async def swarm_announce(self, request: web.Request) -> web.Response:
        """Tracker: record the sender in a weights swarm, answer with other members."""
        opened = await self._open(request, SwarmAnnounce)
        if opened.sender != self.trainer_key:
            node = self._node(opened)
            if node.state == "banned":
                self.tracker.forget(node.node_id)
                raise web.HTTPForbidden(text="this node is banned from the pool")
        return self._signed(self.tracker.announce(opened.sender_id, opened.message))

    async def weights(self, request: web.Request) -> web.Response:
        raw = await request.read()
        opened = open_envelope(
            raw,
            WeightUpdate,
            replay_cache=self.replay,
            trusted_senders={self.trainer_key},
            max_bytes=self.cfg.server.max_body_bytes,
        )
        try:
            await self.ledger.publish(raw, opened.message, self.engine, self.writer)
        except StaleUpdate as exc:
            raise web.HTTPConflict(text=str(exc)) from exc
        log.info("pool weights are now version %d", self.ledger.version)
        for node in self.registry.healthy():
            self._tasks.append(asyncio.create_task(self._push_weights(node, raw)))
        self._tasks = [t for t in self._tasks if not t.done()]
        return web.json_response({"weights_version": self.ledger.version})

    def _channel_opened(self, node: NodeRecord) -> None:
        """`node` proved its key over a channel it opened: it can be called now, so it
        may turn healthy at once (it heartbeats anyway)."""
        self.registry.channel_opened(node)
        if node.state == "healthy":
            self.store.persist_node(node)
            self.dispatcher.kick()

    def _channel_closed(self, node: NodeRecord) -> None:
        """No call reaches `node` until it reconnects: no new work for it meanwhile."""
        if self.registry.channel_closed(node):
            self.store.persist_node(node)

    async def _push_weights(self, node: NodeRecord, raw: bytes) -> None:
        """Hand the trainer's signed update to a node now (heartbeats relay it too, later):
        RL steps are seconds apart, heartbeats may be tens of seconds."""
        try:
            answer = await asyncio.wait_for(
                self.channels.post(node, "/v1/weights/update", raw),
                self.cfg.dispatch.generate_timeout_s,
            )
            held = json.loads(answer)
        except RemoteError as exc:
            log.info("%s refused weights push (%d)", node.label, exc.status)
            return
        except (ChannelClosed, TimeoutError, ValueError) as exc:
            log.info(
                "weights push to %s failed: %s (its heartbeat will relay them)", node.label, exc
            )
            return
        if self.registry.holds(node, int(held["weights_version"]), str(held["weights_hash"])):
            self.dispatcher.kick()

    # -- background --------------------------------------------------------------------
    async def _monitor(self) -> None:
        lc = self.cfg.lifecycle
        while True:
            await asyncio.sleep(lc.check_interval_s)
            for node in self.registry.sweep(time.time(), lc.unhealthy_after_s, lc.dead_after_s):
                log.warning("%s is %s (no heartbeat)", node.label, node.state)
                if node.state == "dead":
                    self.dispatcher.node_gone(node)
                self.store.persist_node(node)

    def _write_seen(self) -> None:
        dirty, self._seen_dirty = self._seen_dirty, set()
        for node_id in dirty:
            node = self.registry.get(node_id)
            if node is not None:
                self.store.persist_node(node)

    async def _flush_seen(self) -> None:
        while True:
            await asyncio.sleep(SEEN_FLUSH_S)
            self._write_seen()

    def _refresh_gauges(self) -> None:
        self.metrics.set_node_states(self.registry.counts())
        self.metrics.queue_depth.set(self.dispatcher.queued)
        self.metrics.in_flight.set(sum(n.in_flight for n in self.registry.nodes.values()))

    def dashboard_state(self) -> dict:
        now = time.time()
        status = self.dispatcher.status()
        return {
            "pool_id": self.pool_id,
            "scheduler_id": self.identity.node_id,
            "time": now,
            "weights_version": self.ledger.version,
            "totals": status["totals"],
            "nodes": [
                {
                    "node_id": n.node_id,
                    "operator": n.operator,
                    "state": n.state,
                    "weights_version": n.weights_version,
                    "reputation": round(n.reputation, 3),
                    "in_flight": n.in_flight,
                    "generated": n.generated,
                    "tokens_per_s": round(n.tokens_per_s(now), 1),
                    "verified": n.verified,
                    "accepted": n.accepted,
                    "rejected": n.rejected,
                    # the share of its rollouts verified (`scheduler.spot_checks`)
                    "verification_rate": round(self.dispatcher.spot.rate(n), 4),
                    "last_seen_s": round(now - n.last_seen, 1),
                }
                for n in sorted(self.registry.nodes.values(), key=lambda n: n.registered_at)
            ],
            "recent_verdicts": status["recent_verdicts"],
        }


def _unpack_list(blob: bytes) -> list[bytes]:
    import msgpack

    return list(msgpack.unpackb(blob)) if blob else []


def run(cfg: SchedulerConfig) -> None:
    identity = Identity.load_or_create(Path(cfg.key_file).expanduser())
    server = SchedulerServer(cfg, identity)
    print(
        f"scheduler {identity.node_id} for pool {server.pool_id} at "
        f"http://{cfg.server.host}:{cfg.server.port} (dashboard: /dashboard)",
        flush=True,
    )
    serve_app(server.app(), cfg.server, loop=_fast_loop())


def _fast_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it exists: about half the event-loop overhead of the stdlib loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
