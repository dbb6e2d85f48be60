"""`prime-node join`: a worker node's life in a pool, from admission to a clean leave.

Owns the node side of the scheduler contract (GET /v1/pool, register, heartbeat,
deregister) around one `NodeServer`, assembled by `node.assembly` exactly as `prime-node
serve` assembles its own (every engine flag honoured alike). Invariants:
- The pool config is used only if it names the pool asked for and, with `--owner`, is
  signed by that owner; weights are loaded only under the pool's trainer key
  (`NodeServer.load_relayed_weights`), whoever relays them.
- Until registration the proof routes take work from nobody; afterwards only from the key
  that signed the scheduler's `RegisterResponse` (re-read at every registration).
- Once registered, a lost scheduler (down, restarting, answering errors) never stops the
  node: it keeps serving and retries with backoff capped at the heartbeat interval, moving
  to the next scheduler replica when several are listed (`--scheduler URL1,URL2`); a 404
  means the scheduler forgot the node, so it registers again.
- Exit codes (`JoinError.exit_code`): 0 after a clean leave or a stop before admission;
  2 when refused (wrong pool or owner, bad invite, admission refused, scheduler
  unreachable at start); 3 when banned. Anything else is a bug and propagates.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import math
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import aiohttp
from aiohttp import web
from pydantic import ValidationError

from node.channel import SchedulerLink
from node.config import WILDCARD_HOSTS, JoinConfig
from protocol.client import RemoteError, call
from protocol.codec import CodecError
from protocol.envelope import EnvelopeError, open_envelope
from protocol.identity import Identity, IdentityError, node_id_from_public_key
from protocol.messages import (
    Deregister,
    EngineMix,
    Heartbeat,
    HeartbeatResponse,
    Invite,
    NodeAck,
    PoolConfig,
    RegisterRequest,
    RegisterResponse,
)

if TYPE_CHECKING:  # torch-heavy: imported only once the pool checks passed
    from node.server import NodeServer
    from node.swarm_weights import SwarmWeights
    from node.worker import Worker

log = logging.getLogger("prime.node.join")
T = TypeVar("T")

EXIT_REFUSED = 2
EXIT_BANNED = 3
MAX_CAPACITY = 4096  # RegisterRequest.capacity's upper bound
MIN_HEARTBEAT_S = 0.1  # guards against a scheduler asking for a busy loop
DRAIN_POLL_S = 0.2
# Worth retrying at start: the scheduler is busy (429), restarting (5xx), or our nonce
# collided (409, a fresh envelope fixes it). Any other 4xx is a refusal.
RETRY_STATUSES = frozenset({408, 409, 425, 429})


class JoinError(RuntimeError):
    """The node cannot join or stay in the pool; `exit_code` is the process's exit status."""

    def __init__(self, message: str, exit_code: int = EXIT_REFUSED):
        super().__init__(message)
        self.exit_code = exit_code


def _retryable(exc: BaseException) -> bool:
    """A failure that may pass by itself (network, scheduler restart, overload)."""
    if isinstance(exc, RemoteError):
        return exc.status in RETRY_STATUSES or exc.status >= 500
    return isinstance(exc, aiohttp.ClientError | TimeoutError | OSError)


def _transient(exc: BaseException) -> bool:
    """Once registered, nothing the scheduler says or fails to say (except a ban or a
    refused re-registration, raised as `JoinError`) is a reason to stop serving."""
    return _retryable(exc) or isinstance(exc, RemoteError | CodecError | EnvelopeError)


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _backoff(attempt: int, cap: float = math.inf) -> float:
    return min(cap, 0.5 * 2**attempt)


async def _with_retries(
    fn: Callable[[], Awaitable[T]],
    attempts: int,
    what: str,
    on_retry: Callable[[], None] | None = None,
) -> T:
    """Await `fn()` up to `attempts` times while it fails retryably; re-raise the last error."""
    for attempt in range(attempts):
        try:
            return await fn()
        except Exception as exc:
            if not _retryable(exc) or attempt == attempts - 1:
                raise
            if on_retry is not None:
                on_retry()
            delay = _backoff(attempt)
            log.warning("%s failed (%s); retrying in %.1f s", what, _describe(exc), delay)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")


def _unreachable(url: str, attempts: int, exc: BaseException) -> JoinError:
    return JoinError(f"scheduler {url} unreachable after {attempts} attempt(s): {_describe(exc)}")


async def _get_bytes(session: aiohttp.ClientSession, url: str) -> bytes:
    async with session.get(url) as resp:
        body = await resp.read()
        if resp.status >= 300:
            raise RemoteError(resp.status, body[:500].decode(errors="replace"))
        return body


async def fetch_pool(session: aiohttp.ClientSession, cfg: JoinConfig) -> tuple[PoolConfig, bytes]:
    """The scheduler's owner-signed pool config and the owner's key, after the node's checks."""
    urls = cfg.scheduler_urls
    tries = iter(range(10**9))
    url = f"{urls[0]}/v1/pool"

    def attempt() -> Awaitable[bytes]:
        nonlocal url
        url = f"{urls[next(tries) % len(urls)]}/v1/pool"  # replicas in turn
        return _get_bytes(session, url)

    try:
        raw = await _with_retries(attempt, max(cfg.startup_attempts, len(urls)), "GET /v1/pool")
    except Exception as exc:
        if isinstance(exc, RemoteError) and not _retryable(exc):
            raise JoinError(f"GET {url} failed: {exc}") from exc
        if _retryable(exc):
            raise _unreachable(cfg.scheduler, cfg.startup_attempts, exc) from exc
        raise
    try:
        # Long-lived: the owner signs a pool once; its expiry is not a freshness check.
        opened = open_envelope(raw, PoolConfig, check_expiry=False)
    except (CodecError, EnvelopeError) as exc:
        raise JoinError(f"{url} did not serve a valid owner-signed pool config: {exc}") from exc
    pool = opened.message
    if pool.pool_id != cfg.pool:
        raise JoinError(
            f"the scheduler at {cfg.scheduler} serves pool {pool.pool_id!r}, not {cfg.pool!r}"
        )
    if cfg.owner and opened.sender_id != cfg.owner:
        raise JoinError(
            f"pool {pool.pool_id!r} is signed by {opened.sender_id}, not by the owner "
            f"{cfg.owner} given with --owner"
        )
    return pool, opened.sender


def read_invite(value: str, pool: PoolConfig, owner: bytes, node_id: str) -> bytes:
    """The invite envelope named by `value` (a token or a file holding one), checked as far
    as the node can: signed by the pool owner, for this pool and node, not expired."""
    token = value.strip()
    # A token is too long to be a file name on most systems: is_file() then raises.
    with contextlib.suppress(OSError):
        path = Path(token).expanduser()
        if path.is_file():
            token = path.read_text().strip()
    shown = token if len(token) <= 40 else token[:37] + "..."
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        # Invites live for days: only the owner's expiry counts, not the 1 h message cap.
        opened = open_envelope(raw, Invite, max_ttl_s=math.inf)
    except (binascii.Error, ValueError) as exc:  # CodecError and EnvelopeError included
        raise JoinError(
            f"--invite {shown!r} is neither a file nor a valid invite token: {exc}"
        ) from exc
    invite = opened.message
    if opened.sender != owner:
        raise JoinError(
            f"the invite is signed by {opened.sender_id}, not by the owner of pool "
            f"{pool.pool_id!r} ({node_id_from_public_key(owner)})"
        )
    if invite.pool_id != pool.pool_id:
        raise JoinError(f"the invite is for pool {invite.pool_id!r}, not {pool.pool_id!r}")
    if invite.node_id and invite.node_id != node_id:
        raise JoinError(f"the invite is bound to node {invite.node_id}, not this node ({node_id})")
    return raw


class PoolNode:
    """One node in one pool: its server, its registration, its heartbeats and its leave."""

    # The worker class (None: node.worker.Worker, imported late so a refusal stays fast);
    # tests swap in dishonest subclasses (tests/adversary_node.py).
    worker_cls: type[Worker] | None = None
    # Same for the weight-swarm peer (None: node.swarm_weights.SwarmWeights); tests swap in
    # one that serves corrupted pieces.
    swarm_cls: type[SwarmWeights] | None = None

    def __init__(self, cfg: JoinConfig, identity: Identity, session: aiohttp.ClientSession):
        self.cfg = cfg
        self.identity = identity
        self.session = session
        self.pool: PoolConfig | None = None
        self.invite = b""
        self.worker: Worker | None = None
        self.mix: EngineMix | None = None
        self.server: NodeServer | None = None
        self.runner: web.AppRunner | None = None
        self.link: SchedulerLink | None = None
        self.scheduler_key: bytes | None = None
        self.interval = 5.0
        self.state = ""
        # Set at the first register attempt: from then on, a stop deregisters (the
        # scheduler may have admitted the node even if its answer never arrived).
        self.register_sent = False
        self.current = 0  # index into cfg.scheduler_urls
        self.wake = asyncio.Event()  # set to send the next heartbeat now (new weights loaded)

    def _url(self, route: str) -> str:
        return f"{self.cfg.scheduler_urls[self.current]}{route}"

    def _next_scheduler(self) -> None:
        """Move to the next scheduler replica (after a failure or a standby's 503)."""
        urls = self.cfg.scheduler_urls
        if len(urls) > 1:
            self.current = (self.current + 1) % len(urls)
            log.info("trying scheduler replica %s", urls[self.current])

    # -- start ---------------------------------------------------------------------
    async def live(self) -> None:
        """Check the pool, start the server, register, then heartbeat until cancelled."""
        cfg = self.cfg
        self.pool, owner = await fetch_pool(self.session, cfg)
        pool = self.pool
        node_id = self.identity.node_id
        if pool.admission.mode == "allowlist" and node_id not in pool.admission.allowlist:
            raise JoinError(
                f"pool {pool.pool_id!r} admits listed nodes only, and {node_id} is not listed"
            )
        if cfg.invite:
            self.invite = read_invite(cfg.invite, pool, owner, node_id)
        elif pool.admission.mode == "invite":
            log.warning("pool %s admits by invite only and no --invite was given", pool.pool_id)
        await self._start_server()
        try:
            await self.register(cfg.startup_attempts)
        except JoinError:
            raise
        except Exception as exc:
            if _retryable(exc):
                raise _unreachable(cfg.scheduler, cfg.startup_attempts, exc) from exc
            if isinstance(exc, CodecError | EnvelopeError):
                raise JoinError(f"the scheduler's answer to register is unusable: {exc}") from exc
            raise
        assert self.link is not None
        channel = asyncio.create_task(self.link.run_forever(), name="channel")
        try:
            await self.heartbeat_forever()
        finally:
            channel.cancel()
            await asyncio.gather(channel, return_exceptions=True)

    async def _start_server(self) -> None:
        from node.assembly import assemble, load_engine
        from node.engines import engine_mix
        from node.swarm_weights import SwarmWeights
        from node.worker import Worker
        from protocol.swarm.tracker import TrackerClient

        cfg, pool = self.cfg, self.pool
        assert pool is not None
        try:
            engine_cfg = cfg.engine.resolve(pool.model)
        except ValidationError as exc:
            reason = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
            raise JoinError(
                f"cannot serve the pool's model here: {reason}; "
                "point --engine.model at a local copy of it"
            ) from exc
        # Off the loop, so a signal during a long load is still noticed.
        engine = await asyncio.to_thread(load_engine, engine_cfg)
        self.mix = engine_mix(engine, engine_cfg.kind)
        covered = pool.verification.engine_mixes
        if not self.mix.covered_by(covered):
            engine.close()
            raise JoinError(
                f"pool {pool.pool_id!r} verifies with thresholds calibrated for "
                f"{', '.join(m.label() for m in covered) or 'no engine mix'}; this node would "
                f"generate on {self.mix.label()}: pass --engine.dtype / --engine.device / "
                "--engine.kind (/ --engine.decode) to match one, or ask the pool owner to "
                "calibrate this mix"
            )
        self.server = assemble(
            engine,
            engine_cfg,
            self.identity,
            cfg.server,
            cfg.weights,
            policy=pool.verification,
            pool_id=pool.pool_id,
            trainer_keys={pool.trainer_public_key},
            model_name=pool.model,  # served as the pool's model, even from a local folder
            callers=set(),  # nobody may send work until the scheduler is known
            api_key=None,  # a pool node answers its scheduler only
            # The scheduler is the swarm's tracker; a new version loaded is told at once.
            tracker=TrackerClient(
                self.session, lambda: self.cfg.scheduler_urls[self.current], self.identity
            ),
            on_loaded=self.beat_now,
            worker_cls=self.worker_cls or Worker,
            swarm_cls=self.swarm_cls or SwarmWeights,
        )
        self.worker = self.server.worker
        # A short grace on shutdown: the drain already waited for in-flight work.
        self.runner = web.AppRunner(self.server.app(), access_log=None, shutdown_timeout=5.0)
        await self.runner.setup()
        await web.TCPSite(self.runner, cfg.server.host, cfg.server.port).start()
        port = self.runner.addresses[0][1]
        host = "127.0.0.1" if cfg.server.host in WILDCARD_HOSTS else cfg.server.host
        host = f"[{host}]" if ":" in host else host
        self.link = SchedulerLink(
            self.session,
            self.identity,
            pool.pool_id,
            f"http://{host}:{port}",
            lambda: self.cfg.scheduler_urls[self.current],
            self._next_scheduler,
            cfg.channel,
        )
        log.info(
            "node %s serving on %s:%d (its scheduler calls it over the node channel)",
            self.identity.node_id,
            cfg.server.host,
            port,
        )

    # -- scheduler calls -----------------------------------------------------------
    async def register(self, attempts: int) -> None:
        """Register (again); a refusal raises `JoinError`, a transient failure re-raises."""
        assert self.pool is not None and self.server is not None and self.worker is not None
        cfg, pool, engine = self.cfg, self.pool, self.worker.engine
        assert self.mix is not None

        def attempt() -> Awaitable[tuple]:
            request = RegisterRequest(
                pool_id=pool.pool_id,
                operator=cfg.operator,
                model=pool.model,  # served as the pool's model, even from a local folder
                engine=self.mix.engine,
                dtype=self.mix.dtype,
                device=self.mix.device,
                decode=self.mix.decode,
                weights_version=engine.weights_version,
                weights_hash=engine.weights_hash,
                capacity=min(cfg.server.max_concurrent_requests, MAX_CAPACITY),
                invite=self.invite,
            )
            self.register_sent = True
            url = self._url("/v1/nodes/register")
            return call(self.session, url, self.identity, request, RegisterResponse)

        try:
            opened, _ = await _with_retries(
                attempt,
                max(attempts, len(self.cfg.scheduler_urls)),
                "register",
                self._next_scheduler,
            )
        except RemoteError as exc:
            if _retryable(exc):
                raise
            raise JoinError(
                f"the scheduler refused to admit this node (HTTP {exc.status}): {exc.message}"
            ) from exc
        resp = opened.message
        if resp.scheduler_id != opened.sender_id:
            raise JoinError(
                f"the register answer names scheduler {resp.scheduler_id} but is signed by {opened.sender_id}"
            )
        if resp.node_id != self.identity.node_id or resp.pool_id != pool.pool_id:
            raise JoinError(
                f"the scheduler admitted node {resp.node_id} to pool {resp.pool_id!r}, "
                f"not {self.identity.node_id} to {pool.pool_id!r}"
            )
        self.scheduler_key = opened.sender
        self.server.callers = {opened.sender}
        self.interval = max(resp.heartbeat_interval_s, MIN_HEARTBEAT_S)
        self.state = "registered"
        if self.link is not None:
            self.link.wake.set()  # a (re-)registration closed any older channel: reopen now
        log.info(
            "registered in pool %s (scheduler %s, heartbeat every %.1f s)",
            pool.pool_id,
            resp.scheduler_id,
            self.interval,
        )
        if resp.weights_envelope:
            await self._load_weights(resp.weights_envelope)

    async def _load_weights(self, envelope: bytes) -> None:
        """Load relayed weights; a failure is logged, never fatal: the node keeps serving
        its current version and the next heartbeat offers the weights again."""
        from node.worker import RequestRejected

        assert self.server is not None
        try:
            await self.server.load_relayed_weights(envelope)
        except (CodecError, EnvelopeError, RequestRejected) as exc:
            log.error("weights relayed by the scheduler not loaded: %s", exc)

    async def heartbeat(self) -> None:
        assert self.worker is not None
        engine = self.worker.engine
        beat = Heartbeat(
            node_id=self.identity.node_id,
            weights_version=engine.weights_version,
            weights_hash=engine.weights_hash,
            outstanding_tokens=self.worker.outstanding_tokens,
            stats=dict(self.worker.stats),
        )
        url = self._url("/v1/nodes/heartbeat")
        opened, _ = await call(self.session, url, self.identity, beat, HeartbeatResponse)
        if opened.sender != self.scheduler_key:
            # A scheduler restarted with another key: dispatches it signs would get 403.
            log.warning(
                "heartbeat answered by %s, not the scheduler this node registered with; registering again",
                opened.sender_id,
            )
            await self.register(attempts=1)
            return
        resp = opened.message
        if resp.state == "banned":
            raise JoinError(
                f"the scheduler banned this node from pool {self.cfg.pool!r}", exit_code=EXIT_BANNED
            )
        if resp.state != self.state:
            log.info("node state: %s -> %s", self.state or "?", resp.state)
            self.state = resp.state
        if resp.weights_envelope:
            await self._load_weights(resp.weights_envelope)

    async def heartbeat_forever(self) -> None:
        failures = 0
        while True:
            try:
                try:
                    await self.heartbeat()
                except RemoteError as exc:
                    if exc.status != 404:
                        raise
                    log.warning(
                        "the scheduler does not know this node (HTTP 404): registering again"
                    )
                    await self.register(attempts=1)
                failures = 0
            except JoinError:
                raise
            except Exception as exc:
                if not _transient(exc):
                    raise
                failures += 1
                log.warning(
                    "scheduler unreachable or failing (%s); node keeps serving, retry %d",
                    _describe(exc),
                    failures,
                )
                self._next_scheduler()
            delay = self.interval if failures == 0 else _backoff(failures - 1, self.interval)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), delay)
            self.wake.clear()

    def beat_now(self) -> None:
        """Heartbeat at once (the scheduler should learn of new weights without delay)."""
        self.wake.set()

    async def _deregister(self, stage: str) -> NodeAck:
        url = self._url("/v1/nodes/deregister")
        message = Deregister(node_id=self.identity.node_id, stage=stage)
        opened, _ = await call(self.session, url, self.identity, message, NodeAck)
        return opened.message

    # -- stop ----------------------------------------------------------------------
    async def leave(self, hurry: asyncio.Event) -> None:
        """Drain (no new work; finish what is in flight, up to drain_timeout_s), then leave.
        With the scheduler unreachable there is no one to hand work to: just stop."""
        if not self.register_sent or self.server is None or self.worker is None:
            return
        loop = asyncio.get_running_loop()
        try:
            ack = await self._deregister("drain")
            log.info(
                "draining: scheduler awaits %d request(s), %d running here",
                ack.in_flight,
                self.server.in_flight,
            )
            deadline = loop.time() + self.cfg.drain_timeout_s
            while ack.in_flight or self.server.in_flight or self.worker.outstanding:
                if hurry.is_set():
                    log.warning("second signal: leaving without waiting for in-flight work")
                    break
                if loop.time() >= deadline:
                    log.warning(
                        "drain timed out after %.0f s; leaving with work in flight",
                        self.cfg.drain_timeout_s,
                    )
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(hurry.wait(), DRAIN_POLL_S)
                # Repeating "drain" is how the node learns the scheduler's in-flight count.
                ack = await self._deregister("drain")
            await self._deregister("leave")
            log.info("left pool %s", self.cfg.pool)
        except Exception as exc:
            if not _transient(exc):
                raise
            log.warning(
                "the scheduler did not take the leave (%s); stopping anyway", _describe(exc)
            )

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()  # stops the worker too (the app's cleanup hook)
        if self.worker is not None:
            self.worker.engine.close()


async def run(cfg: JoinConfig, node_cls: type[PoolNode] = PoolNode) -> None:
    """Join the pool and serve until SIGTERM/SIGINT (then leave cleanly) or until refused
    or banned (`JoinError`). A second signal cuts the drain short."""
    loop = asyncio.get_running_loop()
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        identity = Identity.load_or_create(cfg.key_file)
    except IdentityError as exc:
        raise JoinError(str(exc)) from exc
    # connect: a scheduler host that does not answer counts as down quickly.
    timeout = aiohttp.ClientTimeout(total=30, connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        node = node_cls(cfg, identity, session)
        life = asyncio.create_task(node.live())
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({life, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if life.done():
                life.result()  # raises JoinError (refused, banned) or a bug
                raise AssertionError("node.live() returned")
            log.info("stop requested")
            life.cancel()
            await asyncio.gather(life, return_exceptions=True)
            await node.leave(hurry)
        except JoinError as exc:
            log.error("%s", exc)
            raise
        finally:
            stopped.cancel()
            life.cancel()
            await node.close()
