"""One weights version being fetched or seeded: its peers, choking and piece flow (trio).

A `Torrent` owns a `PieceStore`, a `PiecePicker` and one `Session` per connected peer.
Sessions speak the wire protocol of `protocol.swarm.wire`; the torrent decides whom to
upload to (choking) and what to ask for (the picker).

Invariants:
- A piece is stored, announced (`have`) and served only after its SHA-256 matched the
  signed manifest; a peer that sends a piece that does not match is banned host-wide at
  once and never dialed or accepted again.
- At most `upload_slots` peers are unchoked at a time; a leecher gives its slots to the
  peers that gave it the most bytes since the last re-choke (plus optimistic slots for
  random peers), a seed to the peers it has sent the least, so pieces spread evenly.
- A request unanswered for `request_timeout_s`, or owed by a peer that choked us or
  left, goes back to the picker; the download finishes from whoever remains; known peers
  that could not be reached are dialed again every `REDIAL_S`.
- With `share` off the torrent uploads to nobody unless it is a seed (star topology).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from protocol.messages import Manifest
from protocol.swarm.config import SwarmConfig
from protocol.swarm.picker import PiecePicker
from protocol.swarm.ratelimit import TokenBucket
from protocol.swarm.store import PieceStore
from protocol.swarm.wire import (
    CONTROL_FRAME_MAX,
    FrameReader,
    Kind,
    Msg,
    WireError,
    pack_bits,
    unpack_bits,
    write,
)

log = logging.getLogger("prime.swarm")
MAX_KNOWN = 1000  # peers remembered per version from peer exchange
REDIAL_S = 5.0  # a peer that could not be dialed (or left) is tried again after this


@dataclass
class PeerStats:
    """Bytes exchanged with one peer over this torrent's life."""

    downloaded: int = 0
    uploaded: int = 0


@dataclass
class TorrentStatus:
    """A snapshot of one torrent, safe to hand to another thread."""

    manifest_hash: str
    step: int
    folder: str
    complete: bool
    total: int
    pieces: int
    have: int
    left: int
    downloaded: int
    uploaded: int
    peers: list[str]
    per_peer: dict[str, PeerStats]
    bad_pieces: int
    started: float
    finished: float | None
    errors: list[str] = field(default_factory=list)


class Session:
    """One peer in one torrent, over one libp2p stream."""

    def __init__(self, torrent: Torrent, peer_id: str, addrs: list[str], stream, reader):
        self.t = torrent
        self.peer_id = peer_id
        self.addrs = addrs
        self.stream = stream
        self.reader: FrameReader = reader
        self.pieces = [False] * torrent.manifest.num_pieces
        self.am_choking = True
        self.peer_choking = True
        self.am_interested = False
        self.peer_interested = False
        self.inflight: set[int] = set()  # pieces we asked this peer for
        self.wanted: set[int] = set()  # pieces this peer asked us for (cancel removes)
        self.since_rechoke = 0  # bytes received since the last re-choke
        self.closed = False
        self._scope = trio.CancelScope()
        self._send, self._outbox = trio.open_memory_channel[Msg](1024)

    def send(self, msg: Msg) -> None:
        if not self.closed:
            try:
                self._send.send_nowait(msg)
            except trio.WouldBlock:  # a peer that does not read: drop it
                self.close("outbox full")

    def close(self, why: str = "") -> None:
        if self.closed:
            return
        self.closed = True
        self._send.close()
        self._scope.cancel()
        self.t.drop_session(self, why)

    # -- loops -----------------------------------------------------------------------
    async def run(self) -> None:
        """Serve this peer until either side ends the session (the caller awaits it)."""
        with self._scope:
            async with trio.open_nursery() as n:
                n.start_soon(self._guard, self._write_loop)
                await self._guard(self._read_loop)
        with trio.move_on_after(1) as cleanup:
            cleanup.shield = True
            with contextlib.suppress(Exception):  # already gone
                await self.stream.reset()

    async def _guard(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Run one loop; any end of it (clean, broken stream, bug) ends the session only."""
        try:
            await loop()
        except (WireError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.close(str(exc))
        except Exception as exc:
            log.exception("session with %s failed", self.peer_id[:16])
            self.close(repr(exc))
        else:
            self.close("done")

    async def _write_loop(self) -> None:
        up = self.t.upload
        async for msg in self._outbox:
            if msg.kind == Kind.PIECE and not msg.data:
                # A queued upload: skip it if cancelled or if we choked the peer since.
                if msg.index not in self.wanted or self.am_choking:
                    continue
                self.wanted.discard(msg.index)
                data = await trio.to_thread.run_sync(self.t.store.read, msg.index)
                await write(self.stream, Msg(Kind.PIECE, msg.index, data), up)
                self.t.count_upload(self, len(data))
            else:
                await write(self.stream, msg)

    async def _read_loop(self) -> None:
        max_frame = self.t.manifest.piece_size + CONTROL_FRAME_MAX
        while not self.closed:
            msg = await self.reader.read(max_frame)
            await self.t.handle(self, msg)


Dialer = Callable[[str, list[str], "Torrent"], Awaitable["Session | None"]]


class Torrent:
    def __init__(
        self,
        manifest: Manifest,
        manifest_hash: str,
        envelope: bytes,
        store: PieceStore,
        cfg: SwarmConfig,
        my_id: str,
        upload: TokenBucket,
        banned: set[str],
        dial: Dialer,
        on_ban: Callable[[str], None],
    ):
        self.manifest = manifest
        self.hash = manifest_hash
        self.envelope = envelope
        self.store = store
        self.cfg = cfg
        self.my_id = my_id
        self.upload = upload  # the host's upload link, shared by every torrent
        self.banned = banned
        self._dial = dial
        self._on_ban = on_ban
        self.picker = PiecePicker(store.have)
        self.sessions: dict[str, Session] = {}
        self.known: dict[str, list[str]] = {}  # peer id -> addrs, from tracker and PEX
        self.dialing: set[str] = set()
        self.spare: set[str] = set()  # not dialed on peer exchange alone (the trainer's seed)
        self.last_dial: dict[str, float] = {}  # peer id -> monotonic time of the last dial
        self.stats: dict[str, PeerStats] = {}
        self.bad_pieces = 0
        self.errors: list[str] = []
        self.started = time.time()
        self.finished: float | None = time.time() if store.complete else None
        self.done = trio.Event()
        self._finishing = False
        if store.complete:
            self.done.set()
        self.nursery: trio.Nursery | None = None
        self._rng = random.Random()

    # -- status ----------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return self.store.complete

    def status(self) -> TorrentStatus:
        return TorrentStatus(
            manifest_hash=self.hash,
            step=self.manifest.step,
            folder=str(self.store.folder),
            complete=self.complete,
            total=self.manifest.total_size,
            pieces=self.manifest.num_pieces,
            have=sum(self.store.have),
            left=self.store.left,
            downloaded=sum(s.downloaded for s in self.stats.values()),
            uploaded=sum(s.uploaded for s in self.stats.values()),
            peers=sorted(self.sessions),
            per_peer={k: PeerStats(v.downloaded, v.uploaded) for k, v in self.stats.items()},
            bad_pieces=self.bad_pieces,
            started=self.started,
            finished=self.finished,
            errors=list(self.errors),
        )

    # -- peers -----------------------------------------------------------------------
    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            self.nursery = n
            task_status.started()
            n.start_soon(self._choker)
            n.start_soon(self._timeouts)
            await trio.sleep_forever()

    def stop(self) -> None:
        for s in list(self.sessions.values()):
            s.close("torrent removed")
        if self.nursery is not None:
            self.nursery.cancel_scope.cancel()

    def add_peers(self, peers: list[tuple[str, list[str]]], direct: bool = True) -> None:
        """Learn of peers and dial some while below `max_peers`. `direct`: named by the
        caller (tracker, seeders); otherwise heard of by peer exchange, and then the
        `spare` peers (the trainer) are left alone."""
        for pid, addrs in peers:
            if pid == self.my_id or pid in self.banned or not addrs:
                continue
            if not direct and (
                (pid in self.spare and pid not in self.known)
                or (pid not in self.known and len(self.known) >= MAX_KNOWN)
            ):
                continue  # the trainer is spared; peer exchange cannot flood our memory
            self.known[pid] = addrs
        self._dial_more()

    def _dial_more(self) -> None:
        if self.nursery is None:
            return
        # A seed waits to be dialed: downloaders need it, it needs nobody.
        if self.complete:
            return
        now = time.monotonic()
        candidates = [
            p
            for p in self.known
            if p not in self.sessions
            and p not in self.dialing
            and p not in self.banned
            and now - self.last_dial.get(p, -REDIAL_S) >= REDIAL_S
        ]
        self._rng.shuffle(candidates)
        room = self.cfg.max_peers - len(self.sessions) - len(self.dialing)
        for pid in candidates[: max(room, 0)]:
            self.dialing.add(pid)
            self.last_dial[pid] = now
            self.nursery.start_soon(self._dial_one, pid)

    async def _dial_one(self, pid: str) -> None:
        try:
            session = await self._dial(pid, self.known[pid], self)
        except Exception as exc:  # unreachable, refused, timed out: try others
            log.debug("dial %s failed: %r", pid[:16], exc)
            session = None
        finally:
            self.dialing.discard(pid)
        if session is not None:
            await session.run()

    def attach(self, peer_id: str, addrs: list[str], stream, reader: FrameReader) -> Session | None:
        """A session over an already handshaken stream (the caller awaits its `run`), or
        None if this peer is not wanted."""
        if (
            self.nursery is None
            or peer_id in self.banned
            or peer_id in self.sessions
            or len(self.sessions) >= self.cfg.max_peers
        ):
            return None
        s = Session(self, peer_id, addrs, stream, reader)
        self.sessions[peer_id] = s
        self.stats.setdefault(peer_id, PeerStats())
        if addrs:
            self.known[peer_id] = addrs
        s.send(Msg(Kind.BITFIELD, data=pack_bits(self.store.have)))
        others = [(p, a) for p, a in self.known.items() if p != peer_id][:50]
        if others:
            s.send(Msg(Kind.PEERS, peers=others))
        return s

    def drop_session(self, s: Session, why: str) -> None:
        if self.sessions.get(s.peer_id) is not s:
            return
        del self.sessions[s.peer_id]
        self.picker.peer_has([i for i, h in enumerate(s.pieces) if h], sign=-1)
        for i in s.inflight:
            self.picker.drop_request(i, s.peer_id)
        s.inflight.clear()
        log.debug("peer %s left %s: %s", s.peer_id[:16], self.hash[:12], why)
        if not self.complete:
            self._dial_more()
            for other in list(self.sessions.values()):
                self._request_more(other)

    def ban(self, peer_id: str, why: str) -> None:
        log.warning("banning peer %s: %s", peer_id, why)
        self.errors.append(f"banned {peer_id}: {why}")
        self._on_ban(peer_id)

    # -- messages --------------------------------------------------------------------
    async def handle(self, s: Session, msg: Msg) -> None:
        k = msg.kind
        n = self.manifest.num_pieces
        if k in (Kind.HAVE, Kind.REQUEST, Kind.PIECE, Kind.CANCEL) and not 0 <= msg.index < n:
            raise WireError(f"piece index {msg.index} out of range")
        if k == Kind.BITFIELD:
            bits = unpack_bits(msg.data, n)
            self.picker.peer_has([i for i, b in enumerate(bits) if b and not s.pieces[i]])
            s.pieces = [a or b for a, b in zip(s.pieces, bits, strict=True)]
            self._update_interest(s)
        elif k == Kind.HAVE:
            if not s.pieces[msg.index]:
                s.pieces[msg.index] = True
                self.picker.peer_has([msg.index])
                self._update_interest(s)
        elif k == Kind.REQUEST:
            if not s.am_choking and self.store.have[msg.index]:
                s.wanted.add(msg.index)
                s.send(Msg(Kind.PIECE, msg.index))  # placeholder: the writer reads the data
        elif k == Kind.CANCEL:
            s.wanted.discard(msg.index)
        elif k == Kind.PIECE:
            await self._on_piece(s, msg.index, msg.data)
        elif k == Kind.CHOKE:
            s.peer_choking = True
            for i in s.inflight:
                self.picker.drop_request(i, s.peer_id)
            s.inflight.clear()
            self._request_all()
        elif k == Kind.UNCHOKE:
            s.peer_choking = False
            self._request_more(s)
        elif k == Kind.INTERESTED:
            s.peer_interested = True
            self._unchoke_if_free(s)
        elif k == Kind.NOT_INTERESTED:
            s.peer_interested = False
            if not s.am_choking:
                self._choke(s)
        elif k == Kind.PEERS:
            self.add_peers(msg.peers[:200], direct=False)
        else:
            raise WireError(f"unexpected {k.name} after the handshake")

    async def _on_piece(self, s: Session, index: int, data: bytes) -> None:
        if index not in s.inflight:
            return  # cancelled in endgame, or unsolicited: not used, not counted
        s.inflight.discard(index)
        self.stats[s.peer_id].downloaded += len(data)
        s.since_rechoke += len(data)
        if self.store.have[index]:  # another peer's copy won the endgame race
            return
        ok = await trio.to_thread.run_sync(self.store.put, index, data)
        if not ok:
            self.bad_pieces += 1
            self.picker.drop_request(index, s.peer_id)
            self.ban(s.peer_id, f"piece {index} does not match its hash")
            return
        for other in self.picker.got(index):
            o = self.sessions.get(other)
            if o is not None and other != s.peer_id and index in o.inflight:
                o.inflight.discard(index)
                o.send(Msg(Kind.CANCEL, index))
        for o in list(self.sessions.values()):
            o.send(Msg(Kind.HAVE, index))
        if self.store.complete and not self._finishing:
            self._finishing = True  # pieces verified in parallel threads: finish once
            await self._finish()
        else:
            self._request_all()

    async def _finish(self) -> None:
        await trio.to_thread.run_sync(self.store.finish, self.envelope)
        self.finished = time.time()
        log.info(
            "fetched step %d (%s) in %.1f s",
            self.manifest.step,
            self.hash[:12],
            self.finished - self.started,
        )
        self.done.set()
        for o in list(self.sessions.values()):
            self._update_interest(o)
            if all(o.pieces):  # two seeds have nothing to trade
                o.close("both complete")

    # -- requests and interest -------------------------------------------------------
    def _update_interest(self, s: Session) -> None:
        want = self.picker.is_interesting(s.pieces)
        if want != s.am_interested:
            s.am_interested = want
            s.send(Msg(Kind.INTERESTED if want else Kind.NOT_INTERESTED))
        if want:
            self._request_more(s)
        if self.complete and all(s.pieces):
            s.close("both complete")

    def _request_more(self, s: Session) -> None:
        while not s.closed and not s.peer_choking and len(s.inflight) < self.cfg.pipeline:
            i = self.picker.pick(s.peer_id, s.pieces)
            if i is None:
                return
            self.picker.mark_requested(i, s.peer_id)
            s.inflight.add(i)
            s.send(Msg(Kind.REQUEST, i))

    def _request_all(self) -> None:
        for s in list(self.sessions.values()):
            self._request_more(s)

    async def _timeouts(self) -> None:
        while True:
            await trio.sleep(1.0)
            for i, pid in self.picker.expired(self.cfg.request_timeout_s):
                self.picker.drop_request(i, pid)
                s = self.sessions.get(pid)
                if s is not None:
                    s.inflight.discard(i)
                    s.send(Msg(Kind.CANCEL, i))
            if not self.complete:
                self._request_all()
                self._dial_more()  # peers that failed or left may be back

    # -- choking ---------------------------------------------------------------------
    @property
    def _uploads_allowed(self) -> bool:
        return self.cfg.share or self.complete

    def count_upload(self, s: Session, n: int) -> None:
        self.stats[s.peer_id].uploaded += n

    def _unchoke(self, s: Session) -> None:
        s.am_choking = False
        s.send(Msg(Kind.UNCHOKE))

    def _choke(self, s: Session) -> None:
        s.am_choking = True
        s.wanted.clear()
        s.send(Msg(Kind.CHOKE))

    def _unchoke_if_free(self, s: Session) -> None:
        unchoked = sum(not o.am_choking for o in self.sessions.values())
        if self._uploads_allowed and s.am_choking and unchoked < self.cfg.upload_slots:
            self._unchoke(s)

    async def _choker(self) -> None:
        while True:
            await trio.sleep(self.cfg.rechoke_interval_s)
            self.rechoke()

    def rechoke(self) -> None:
        interested = [s for s in self.sessions.values() if s.peer_interested and not s.closed]
        if not self._uploads_allowed:
            keep: set[str] = set()
        else:
            if self.complete:  # a seed spreads its pieces: least served first
                ranked = sorted(interested, key=lambda s: self.stats[s.peer_id].uploaded)
            else:  # tit for tat: those who gave us the most lately
                ranked = sorted(interested, key=lambda s: -s.since_rechoke)
            regular = max(self.cfg.upload_slots - self.cfg.optimistic_slots, 1)
            keep = {s.peer_id for s in ranked[:regular]}
            rest = [s.peer_id for s in ranked[regular:]]
            self._rng.shuffle(rest)
            spare = self.cfg.upload_slots - len(keep)
            keep |= set(rest[: max(spare, 0)])
        for s in list(self.sessions.values()):
            s.since_rechoke = 0
            if s.peer_id in keep and s.am_choking:
                self._unchoke(s)
            elif s.peer_id not in keep and not s.am_choking:
                self._choke(s)
