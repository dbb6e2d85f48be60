"""The bridge to libp2p: a swarm peer running in its own thread under its own trio loop.

py-libp2p is trio-based; the rest of the code base is asyncio or plain threads. A
`SwarmHost` starts a libp2p host (Noise security only, Yamux) in a daemon thread and
offers a small typed API that any thread may call: `seed`, `fetch` (a
`concurrent.futures.Future`; asyncio callers wrap it with `asyncio.wrap_future`),
`add_peers`, `status`, `remove`, `close`. Nothing outside `protocol.swarm` sees trio.

Invariants:
- The peer id is the node's Ed25519 identity (the same key signs its HTTP messages).
- A manifest is used only if one of the `trusted` keys signed it (the pool's trainer
  key), and only for one weights folder at a time; a banned peer (one that sent a bad
  piece) is refused on every torrent for the host's life.
- Upload and download caps are per host, shared by every torrent and peer.
- Behind NAT: a peer holding a reservation on a relay (circuit relay v2; the trainer's
  seed is the pool's) announces `<relay>/p2p-circuit/p2p/<me>` next to its direct
  addresses; a dialer tries the direct ones first, then each relay. A relayed session is
  checked like any other (every piece is hashed): the relay only forwards bytes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TypeVar

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto import ed25519, x25519
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.tools.anyio_service import background_trio_service

from protocol.identity import Identity
from protocol.swarm.config import SwarmConfig
from protocol.swarm.manifest import MANIFEST_FILE, open_manifest
from protocol.swarm.ratelimit import TokenBucket
from protocol.swarm.store import PieceStore
from protocol.swarm.torrent import Session, Torrent, TorrentStatus
from protocol.swarm.wire import (
    CONTROL_FRAME_MAX,
    PROTOCOL_ID,
    FrameReader,
    Kind,
    Msg,
    WireError,
    write,
)

log = logging.getLogger("prime.swarm")
T = TypeVar("T")
HANDSHAKE_TIMEOUT_S = 10.0


class SwarmHost:
    def __init__(self, identity: Identity, cfg: SwarmConfig, trusted: set[bytes]):
        self.identity = identity
        self.cfg = cfg
        self.trusted = trusted
        self.peer_id = identity.node_id
        self.addrs: list[str] = []  # full multiaddrs ending in /p2p/<peer id>
        self.listen_addrs: list[str] = []  # the direct ones among them
        self.relayed: dict[str, str] = {}  # relay peer id -> our circuit address through it
        self.banned: set[str] = set()
        self.torrents: dict[str, Torrent] = {}
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._host = None

    # -- life ------------------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> SwarmHost:
        self._thread = threading.Thread(target=self._thread_main, name="swarm", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError("the libp2p host did not start")
        if self._failure is not None:
            raise RuntimeError(f"the libp2p host failed to start: {self._failure}")
        if self.cfg.use_relay and self.cfg.relays:
            self.reserve(self.cfg.relays)
        return self

    def close(self) -> None:
        if self._token is not None and self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> SwarmHost:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # surfaced by start() or logged
            self._failure = exc
            self._ready.set()
            log.exception("swarm host stopped")

    async def _main(self) -> None:
        cfg = self.cfg
        key_pair = ed25519.create_new_key_pair(self.identity.seed)
        noise = NoiseTransport(key_pair, noise_privkey=x25519.create_new_key_pair().private_key)
        listen = [multiaddr.Multiaddr(a) for a in cfg.listen]
        host = new_host(
            key_pair=key_pair,
            sec_opt={NOISE_ID: noise},  # never plaintext or secio
            muxer_preference="YAMUX",
            listen_addrs=listen,
            announce_addrs=[multiaddr.Multiaddr(a) for a in cfg.announce_addrs] or None,
            # No auto-dialing to keep a connection count: torrents dial whom they need.
            connection_config=ConnectionConfig(
                max_connections=cfg.max_connections,
                min_connections=0,
                low_watermark=0,
                high_watermark=cfg.max_connections,
            ),
        )
        if str(host.get_id()) != self.peer_id:
            raise RuntimeError("libp2p peer id differs from the node id")
        host.set_stream_handler(PROTOCOL_ID, self._inbound)
        self._host = host
        self.up = TokenBucket(cfg.upload_rate)
        self.down = TokenBucket(cfg.download_rate)
        self._stop = trio.Event()
        # Circuit relay v2: every peer can be reached through a relay it reserved a slot
        # on (STOP) and can reserve one (CLIENT); a relay service also forwards (HOP).
        # The data cap is explicit: 0 would mean a 0-byte budget per circuit.
        limits = RelayLimits(
            duration=0,
            data=1 << 50,
            max_circuit_conns=cfg.relay_max_circuits,
            max_reservations=cfg.relay_max_reservations,
            reservation_ttl=3600,
        )
        relay = CircuitV2Protocol(host, limits=limits, allow_hop=cfg.relay_service)
        roles = RelayRole.STOP | RelayRole.CLIENT
        if cfg.relay_service:
            roles |= RelayRole.HOP
        services = [relay, *([DCUtRProtocol(host)] if cfg.hole_punch else [])]
        async with host.run(listen_addrs=listen), contextlib.AsyncExitStack() as stack:
            # The services' nurseries open (and close) outside the host's own nursery.
            for service in services:
                await stack.enter_async_context(background_trio_service(service))
                await service.event_started.wait()
            self._relay = CircuitV2Transport(host, relay, RelayConfig(roles=roles, limits=limits))
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._token = trio.lowlevel.current_trio_token()
                self.listen_addrs = [str(a) for a in host.get_addrs()]
                self.addrs = list(self.listen_addrs)
                self._ready.set()
                await self._stop.wait()
                for t in self.torrents.values():
                    t.stop()
                nursery.cancel_scope.cancel()

    # -- the bridge ------------------------------------------------------------------
    def _submit(self, fn: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Run `fn()` on the trio loop; its result or exception lands in the future."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._token is None or self._nursery is None:
            raise RuntimeError("the swarm host is not running")

        async def runner() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(await fn())
            except BaseException as exc:  # handed to the caller's thread
                fut.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise

        self._token.run_sync_soon(self._nursery.start_soon, runner)
        return fut

    def _call(self, fn: Callable[[], Awaitable[T]], timeout_s: float = 60.0) -> T:
        return self._submit(fn).result(timeout_s)

    def seed(self, envelope: bytes, folder: Path) -> str:
        """Serve a complete weights folder under its signed manifest; returns its hash."""
        manifest = open_manifest(envelope, self.trusted)
        store = PieceStore.seed(Path(folder), manifest)

        async def go() -> str:
            return (await self._add(manifest, envelope, store)).hash

        return self._call(go)

    def fetch(
        self, envelope: bytes, dest: Path, peers: list[str] = (), spare: Iterable[str] = ()
    ) -> concurrent.futures.Future[Path]:
        """Download the version into `dest` (resuming a `.partial` left there), starting
        from `peers` (multiaddrs with /p2p/); the future gives the finished folder. Peer ids
        in `spare` (the trainer's) are dialed only when named here or in `add_peers`, never
        on peer exchange alone. The torrent keeps seeding afterwards until `remove`."""
        manifest = open_manifest(envelope, self.trusted)
        digest = manifest.digest()
        parsed = _parse_peers(peers)

        async def add() -> Torrent:
            t = self.torrents.get(digest)
            if t is None:
                store = await trio.to_thread.run_sync(_open_store, Path(dest), manifest, envelope)
                t = await self._add(manifest, envelope, store)
            t.spare |= set(spare)
            t.add_peers(parsed)
            return t

        t = self._call(add, timeout_s=3600)  # registered before this returns: status() works

        async def wait() -> Path:
            await t.done.wait()
            return t.store.folder

        return self._submit(wait)

    def add_peers(self, manifest_hash: str, peers: list[str]) -> None:
        """Tell a torrent of more peers to dial (tracker answers, a fallback seed); unknown
        hashes are ignored."""
        parsed = _parse_peers(peers)

        async def go() -> None:
            t = self.torrents.get(manifest_hash)
            if t is not None:
                t.add_peers(parsed)

        self._call(go)

    def reserve(self, relay_addrs: list[str]) -> list[str]:
        """Hold a reservation on each relay in `relay_addrs` (full multiaddrs of relay
        peers; the trainer's seed is one) and announce the relayed address through it
        (`addrs`). Idempotent: a relay still connected keeps its reservation (libp2p
        refreshes it), one that dropped (a restarted trainer) is reserved on again.
        Returns the circuit addresses now announced."""

        async def go() -> list[str]:
            network = self._host.get_network()
            for peer_id, addrs in _parse_peers(relay_addrs):
                if peer_id == self.peer_id or (
                    peer_id in self.relayed and network.connections.get(ID.from_base58(peer_id))
                ):
                    continue
                direct = [a for a in addrs if "/p2p-circuit" not in a]
                try:
                    info = _peer_info(direct)
                    with trio.fail_after(self.cfg.connect_timeout_s):
                        await self._host.connect(info)
                        stream = await self._host.new_stream(info.peer_id, [HOP_ID])
                        ok = await self._relay.reserve(stream, info.peer_id, self._nursery)
                        await stream.close()
                except Exception as exc:  # a relay that is down or refuses: try later
                    log.info("no reservation on relay %s: %r", peer_id[:16], exc)
                    self.relayed.pop(peer_id, None)
                    continue
                if ok:
                    self.relayed[peer_id] = f"{direct[0]}/p2p-circuit/p2p/{self.peer_id}"
                    log.info("reachable through relay %s", peer_id[:16])
                else:
                    self.relayed.pop(peer_id, None)
            self.addrs = [*self.listen_addrs, *self.relayed.values()]
            return list(self.relayed.values())

        return self._call(go)

    def status(self, manifest_hash: str) -> TorrentStatus | None:
        async def go() -> TorrentStatus | None:
            t = self.torrents.get(manifest_hash)
            return t.status() if t else None

        return self._call(go)

    def statuses(self) -> list[TorrentStatus]:
        async def go() -> list[TorrentStatus]:
            return [t.status() for t in self.torrents.values()]

        return self._call(go)

    def remove(self, manifest_hash: str) -> None:
        """Stop seeding or fetching a version (its files stay where they are)."""

        async def go() -> None:
            t = self.torrents.pop(manifest_hash, None)
            if t is not None:
                t.stop()

        self._call(go)

    # -- inside trio -----------------------------------------------------------------
    async def _add(self, manifest, envelope: bytes, store: PieceStore) -> Torrent:
        digest = manifest.digest()
        if digest in self.torrents:
            return self.torrents[digest]
        t = Torrent(
            manifest,
            digest,
            envelope,
            store,
            self.cfg,
            self.peer_id,
            self.up,
            self.banned,
            self._dial,
            self._ban,
        )
        self.torrents[digest] = t
        await self._nursery.start(t.run)
        return t

    def _ban(self, peer_id: str) -> None:
        self.banned.add(peer_id)
        for t in self.torrents.values():
            s = t.sessions.get(peer_id)
            if s is not None:
                s.close("banned")
        self._nursery.start_soon(self._disconnect, peer_id)

    async def _disconnect(self, peer_id: str) -> None:
        try:
            await self._host.disconnect(ID.from_base58(peer_id))
        except Exception as exc:  # already gone
            log.debug("disconnect %s: %r", peer_id[:16], exc)

    def _hello(self, t: Torrent) -> Msg:
        return Msg(Kind.HANDSHAKE, data=bytes.fromhex(t.hash), peers=[(self.peer_id, self.addrs)])

    async def _dial(self, peer_id: str, addrs: list[str], t: Torrent) -> Session | None:
        """Open a session with `peer_id` for `t`: its direct addresses first, then each
        relayed one (a peer behind NAT), through that relay."""
        direct = [a for a in addrs if "/p2p-circuit" not in a]
        relayed = [a for a in addrs if "/p2p-circuit" in a]
        try:
            if not direct:
                raise WireError("no direct address")
            info = _peer_info(direct)
            # Dial only the addresses named now: a peer that restarted (a trainer after
            # kill -9) has a new port, and libp2p would otherwise keep trying the dead one.
            self._host.get_peerstore().clear_addrs(info.peer_id)
            with trio.fail_after(self.cfg.connect_timeout_s):
                await self._host.connect(info)
                stream = await self._host.new_stream(info.peer_id, [PROTOCOL_ID])
        except Exception:
            # A connection that outlived its peer stays in libp2p's table: drop it.
            await self._disconnect(peer_id)
            if not relayed:
                raise
            stream, info = await self._dial_relayed(peer_id, relayed)
        if str(info.peer_id) != peer_id:
            await stream.reset()
            raise WireError("dialed address belongs to another peer")
        reader = FrameReader(stream, self.down)
        with trio.fail_after(HANDSHAKE_TIMEOUT_S):
            await write(stream, self._hello(t))
            reply = await reader.read(CONTROL_FRAME_MAX)
        if reply.kind != Kind.HANDSHAKE or reply.data.hex() != t.hash:
            await stream.reset()
            raise WireError("peer does not serve this manifest")
        return t.attach(peer_id, [], stream, reader) or await _reset(stream)

    async def _dial_relayed(self, peer_id: str, circuits: list[str]):
        """A stream to `peer_id` through the first relay in `circuits` that gets us there."""
        failure: Exception = WireError("no relayed address")
        for circuit in circuits:
            try:
                with trio.fail_after(self.cfg.connect_timeout_s):
                    await self._relay.dial(multiaddr.Multiaddr(circuit))
                    info = info_from_p2p_addr(multiaddr.Multiaddr(circuit))
                    stream = await self._host.new_stream(info.peer_id, [PROTOCOL_ID])
                return stream, info
            except Exception as exc:  # this relay is down or has no reservation for it
                failure = exc
        raise failure

    async def _inbound(self, stream) -> None:
        peer_id = str(stream.muxed_conn.peer_id)
        if peer_id in self.banned:
            await stream.reset()
            return
        reader = FrameReader(stream, self.down)
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                hello = await reader.read(CONTROL_FRAME_MAX)
                t = self.torrents.get(hello.data.hex()) if hello.kind == Kind.HANDSHAKE else None
                if t is None:
                    await stream.reset()
                    return
                await write(stream, self._hello(t))
        except (WireError, trio.TooSlowError):
            await _reset(stream)
            return
        addrs = next((a for p, a in hello.peers if p == peer_id), [])
        session = t.attach(peer_id, addrs[:16], stream, reader)
        if session is None:
            await _reset(stream)
            return
        await session.run()


async def _reset(stream) -> None:
    with contextlib.suppress(Exception):  # already gone
        await stream.reset()
    return None


def _open_store(dest: Path, manifest, envelope: bytes) -> PieceStore:
    """A folder this node finished before (it holds the same signed manifest, its pieces
    were checked on arrival) is seeded as it is; anything else is (re)downloaded."""
    if (dest / MANIFEST_FILE).is_file() and (dest / MANIFEST_FILE).read_bytes() == envelope:
        try:
            return PieceStore.seed(dest, manifest)
        except (OSError, ValueError):
            pass  # files missing or resized since: fetch again
    return PieceStore.download(dest, manifest)


def _peer_info(addrs: list[str]):
    """One PeerInfo from full multiaddrs of one peer (each ending in /p2p/<id>)."""
    info = info_from_p2p_addr(multiaddr.Multiaddr(addrs[0]))
    for a in addrs[1:]:
        info.addrs.append(multiaddr.Multiaddr(a.split("/p2p/")[0]))
    return info


def _parse_peers(addrs: list[str]) -> list[tuple[str, list[str]]]:
    """Group multiaddrs ending in /p2p/<id> by peer id."""
    out: dict[str, list[str]] = {}
    for a in addrs:
        if "/p2p/" not in a:
            raise ValueError(f"peer address {a!r} lacks /p2p/<peer id>")
        out.setdefault(a.rsplit("/p2p/", 1)[1], []).append(a)
    return list(out.items())
