"""A worker's side of the weight swarm: fetch each announced version from peers, load it
into the engine between requests, keep seeding it to the others.

`SwarmWeights.want(update)` is called with a trainer-signed `WeightUpdate` that carries a
manifest (pushed by the scheduler, or relayed in a heartbeat answer). It starts one
background fetch per version: the tracker (the scheduler) names the other members, the
update names the trainer's seed. A node that finds complete peers at the tracker leaves
the trainer alone unless those peers stall (`seeder_fallback_s`). When the update lists
deltas and the node holds the base of one of them, it fetches only the deltas after that
base, rebuilds each version (`protocol.swarm.delta`) and seeds it in full, so a late
joiner (no base) fetches the newest full version from peers, not from the trainer.

Invariants:
- Nothing is fetched unless the pool's trainer key signed the manifest and the update
  names the same hash; every piece is hash-checked before it is stored or served
  (`protocol.swarm`), so the engine only ever loads bytes the trainer published.
- A version is fetched and loaded only when it is newer than the one the node serves
  (`node.worker.is_newer`, checked again by the `load` hook at the swap); the swap runs
  on the engine thread, between batches (hot swap, no restart).
- Its hooks into the node (`load`, `current_version`, `tracker`, `on_loaded`) are given
  to the constructor by the node's assembly (`node.assembly`), never set afterwards.
- A version rebuilt from a delta is loaded or seeded only after every piece of it hashed
  to its trainer-signed full manifest (the one the delta manifest carries); a forged
  delta manifest, a delta that does not apply or a rebuild that does not match sends the
  node to the full version instead.
- The newest `keep_versions` versions stay on disk and seeded; older ones are removed.
- Before each fetch the node holds a reservation on the trainer's seed (the pool's
  relay, `use_relay`), so peers that cannot dial it (NAT) still reach it through there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

from node.config import NodeWeightsConfig
from node.worker import StaleWeights, is_newer
from protocol.identity import Identity, node_id_from_public_key
from protocol.messages import Manifest, SwarmAnnounce, WeightUpdate
from protocol.swarm.config import SwarmConfig
from protocol.swarm.delta import DeltaError, apply_delta
from protocol.swarm.host import SwarmHost
from protocol.swarm.manifest import MANIFEST_FILE, ManifestError, build_manifest, open_manifest
from protocol.swarm.tracker import TrackerClient, dial_addrs

log = logging.getLogger("prime.node.swarm")


EARLY_REANNOUNCE_S = (1.0, 3.0, 7.0)  # after a fetch starts (then every announce interval)


class SwarmWeights:
    # The libp2p host class; tests swap in one that serves corrupted pieces
    # (tests/adversaries.py, `corrupt-pieces`).
    host_cls: type[SwarmHost] = SwarmHost

    def __init__(
        self,
        identity: Identity,
        cfg: SwarmConfig,
        trusted: set[bytes],
        folder: Path,
        *,
        load: Callable[[WeightUpdate], Awaitable[None]],
        current_version: Callable[[], int],
        tracker: TrackerClient | None = None,
        on_loaded: Callable[[], None] = lambda: None,
        keep_versions: int = 3,
        seeder_fallback_s: float = 10.0,
        announce_interval_s: float = 15.0,
    ):
        """`load` swaps a fetched version into the engine (raising `StaleWeights` if a
        newer one got there first), `current_version` reads the version served,
        `tracker` names the other members (a pool node's scheduler; None: only the
        seeders the updates name), `on_loaded` runs after each swap."""
        self.identity = identity
        self.cfg = cfg
        self.trusted = trusted
        self.folder = Path(folder).expanduser()
        self.load = load
        self.current_version = current_version
        self.keep_versions = keep_versions
        self.seeder_fallback_s = seeder_fallback_s
        self.announce_interval_s = announce_interval_s
        self.host = self.host_cls(identity, cfg, trusted)
        self.tracker = tracker
        self.on_loaded = on_loaded
        self.tasks: dict[str, asyncio.Task] = {}  # manifest hash -> fetch-and-load
        self._announcer: asyncio.Task | None = None
        self.versions: dict[str, int] = {}  # manifest hash -> step, fetched or fetching
        self.held: dict[str, Path] = {}  # full manifest hash -> its complete folder

    @classmethod
    def from_config(
        cls,
        identity: Identity,
        cfg: NodeWeightsConfig,
        trusted: set[bytes],
        *,
        load: Callable[[WeightUpdate], Awaitable[None]],
        current_version: Callable[[], int],
        tracker: TrackerClient | None = None,
        on_loaded: Callable[[], None] = lambda: None,
    ) -> SwarmWeights | None:
        """The node's swarm peer as configured (None when the swarm is switched off)."""
        if not cfg.swarm:
            return None
        return cls(
            identity,
            cfg.peer,
            trusted,
            cfg.folder.expanduser() / identity.node_id,
            load=load,
            current_version=current_version,
            tracker=tracker,
            on_loaded=on_loaded,
            keep_versions=cfg.keep_versions,
            seeder_fallback_s=cfg.seeder_fallback_s,
        )

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.host.start()
        log.info("swarm peer %s listening on %s", self.host.peer_id, ", ".join(self.host.addrs))

    async def close(self) -> None:
        tasks = [*self.tasks.values(), *([self._announcer] if self._announcer else [])]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await asyncio.to_thread(self.host.close)

    def want(self, update: WeightUpdate) -> bool:
        """Start fetching the update's version (once per manifest); True if it started."""
        manifest = open_manifest(update.manifest, self.trusted)
        digest = manifest.digest()
        if manifest.step != update.version or update.weights_hash not in ("", digest):
            raise ValueError("the update's version or hash does not match its manifest")
        if digest in self.tasks or not is_newer(manifest.step, self.current_version()):
            return False
        self.versions[digest] = manifest.step
        self.tasks[digest] = asyncio.create_task(self._guarded(update, manifest, digest))
        if self._announcer is None:
            self._announcer = asyncio.create_task(self._announce_forever())
        return True

    async def _announce(self, digest: str) -> list[tuple[str, bool]]:
        """Tell the tracker where this node stands on `digest`; returns the (address,
        complete) of other members, and adds them to the torrent."""
        status = await asyncio.to_thread(self.host.status, digest)
        if self.tracker is None or status is None:
            return []
        msg = SwarmAnnounce(
            manifest_hash=digest, addrs=self.host.addrs, complete=status.complete, left=status.left
        )
        try:
            answer = await self.tracker.announce(msg)
        except Exception as exc:  # the tracker is a help, not a dependency
            log.info("tracker announce failed: %s", exc)
            return []
        self.announce_interval_s = answer.interval_s
        members = [(a, p.complete) for p in answer.peers for a in dial_addrs(p)]
        if members and not status.complete:
            await asyncio.to_thread(self.host.add_peers, digest, [a for a, _ in members])
        return members

    async def _announce_forever(self) -> None:
        """Keep the tracker's entries of every version held or fetched alive."""
        while True:
            await asyncio.sleep(self.announce_interval_s)
            for digest in list(self.versions):
                await self._announce(digest)

    async def _guarded(self, update: WeightUpdate, manifest: Manifest, digest: str) -> None:
        """Fetch and load; on failure log it and forget the attempt, so the next offer of
        the same update (a heartbeat relays it until the node reports it) starts over."""
        try:
            await self._fetch_and_load(update, manifest, digest)
        except Exception:
            log.exception("weights of step %d not fetched or not loaded", update.version)
            self.tasks.pop(digest, None)
            self.versions.pop(digest, None)
            await asyncio.to_thread(self.host.remove, digest)

    async def _fetch_and_load(self, update: WeightUpdate, manifest: Manifest, digest: str) -> None:
        """`manifest` is the update's, already checked against the trainer key by `want`."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        if self.cfg.use_relay and update.seeders:
            # The trainer's seed is the pool's relay: behind NAT, this is how peers reach us.
            await asyncio.to_thread(self.host.reserve, list(update.seeders))
        path = await self._via_deltas(update, digest) if update.deltas else None
        how = "through deltas"
        if path is None:
            dest = self.folder / f"step_{manifest.step}_{digest[:12]}"
            path = await self._fetch(update.manifest, digest, manifest.step, dest, update)
            how = "in full"
        self.held[digest] = path
        log.info(
            "step %d fetched %s in %.1f s into %s",
            manifest.step,
            how,
            loop.time() - started,
            path.name,
        )
        await self._announce(digest)
        try:
            await self.load(
                WeightUpdate(version=manifest.step, path=str(path), weights_hash=digest)
            )
        except StaleWeights as exc:  # a newer version was loaded while this one came in
            log.info("step %d fetched, not loaded: %s", manifest.step, exc)
        else:
            self.on_loaded()
        await self._forget_old()

    async def _fetch(
        self, envelope: bytes, digest: str, step: int, dest: Path, update: WeightUpdate
    ) -> Path:
        """Fetch one torrent (a full version or a delta) into `dest` from the swarm."""
        loop = asyncio.get_running_loop()
        # The trainer's seed is dialed only when no peer holds the whole torrent yet, or when
        # those that do stall; never because another peer mentioned it.
        trainer_ids = {node_id_from_public_key(k) for k in self.trusted}
        future = self.host.fetch(envelope, dest, [], spare=trainer_ids)
        self.versions.setdefault(digest, step)
        members = await self._announce(digest)
        seeded_by_peers = any(complete for _, complete in members)
        if not seeded_by_peers:
            await asyncio.to_thread(self.host.add_peers, digest, list(update.seeders))
        done = asyncio.wrap_future(future)
        trainer_added = not seeded_by_peers
        last_have, last_progress = 0, loop.time()
        # Peers that start fetching this version just after us are unknown to the tracker
        # now: ask again 1, 3 and 7 s after the start, so the first fetchers of a version trade with
        # the later ones instead of each pulling it all from the trainer's seed.
        reannounce = [loop.time() + d for d in EARLY_REANNOUNCE_S]
        while not done.done():
            await asyncio.wait([done], timeout=1.0)
            status = await asyncio.to_thread(self.host.status, digest)
            if done.done() or status is None:
                break
            if reannounce and loop.time() >= reannounce[0]:
                reannounce.pop(0)
                await self._announce(digest)
            if status.have > last_have:
                last_have, last_progress = status.have, loop.time()
            if not trainer_added and loop.time() - last_progress > self.seeder_fallback_s:
                log.info("peers stalled on step %d: asking the trainer's seed", step)
                await asyncio.to_thread(self.host.add_peers, digest, list(update.seeders))
                trainer_added = True
        return await done

    async def _via_deltas(self, update: WeightUpdate, digest: str) -> Path | None:
        """Rebuild the update's version from a version this node holds and the deltas after
        it (`protocol.swarm.delta`), each result hashed against its signed full manifest
        and then seeded like a fetched version; None when no delta applies (no base held,
        a forged manifest, a rebuild that does not match): the caller fetches it in full."""
        try:
            chain = [open_manifest(e, self.trusted) for e in update.deltas]
            results = [open_manifest(d.result, self.trusted) for d in chain]
        except ManifestError as exc:
            log.error("deltas of step %d refused (fetching it in full): %s", update.version, exc)
            return None
        starts = [i for i, d in enumerate(chain) if d.delta_of in self.held]
        if not starts or results[-1].digest() != digest:
            return None
        base = self.held[chain[starts[-1]].delta_of]
        for d, envelope, result in zip(
            chain[starts[-1] :], update.deltas[starts[-1] :], results[starts[-1] :], strict=True
        ):
            r_digest = result.digest()
            if r_digest in self.held:
                base = self.held[r_digest]
                continue
            d_digest = d.digest()
            d_dest = self.folder / f"delta_{d.step}_{d_digest[:12]}"
            delta = await self._fetch(envelope, d_digest, d.step, d_dest, update)
            out = self.folder / f"step_{result.step}_{r_digest[:12]}"
            try:
                await asyncio.to_thread(apply_delta, base, delta, out)
                rebuilt = await asyncio.to_thread(
                    build_manifest, out, result.step, result.piece_size, result.parent_step
                )
            except DeltaError as exc:
                log.error("delta of step %d does not apply: %s", d.step, exc)
                return None
            if rebuilt.pieces != result.pieces or rebuilt.files != result.files:
                # Every delta piece matched the trainer's hashes: the base was not what
                # it claims (a damaged disk). Nothing rebuilt is ever loaded or served.
                shutil.rmtree(out, ignore_errors=True)
                log.error("step %d rebuilt from its delta does not match its manifest", d.step)
                return None
            (out / MANIFEST_FILE).write_bytes(d.result)
            await asyncio.to_thread(self.host.seed, d.result, out)
            self.versions[r_digest] = result.step
            self.held[r_digest] = out
            await self._announce(r_digest)  # peers that lack the base fetch it from us
            base = out
        return base

    async def _forget_old(self) -> None:
        """Keep the newest `keep_versions` steps (a step's full version and its delta)."""
        kept = sorted(set(self.versions.values()), reverse=True)[: self.keep_versions]
        for digest, step in [(d, k) for d, k in self.versions.items() if k not in kept]:
            task = self.tasks.pop(digest, None)
            if task is not None and not task.done():
                continue  # still fetching: not old yet
            self.versions.pop(digest, None)
            self.held.pop(digest, None)
            status = await asyncio.to_thread(self.host.status, digest)
            await asyncio.to_thread(self.host.remove, digest)
            if status is not None:
                shutil.rmtree(status.folder, ignore_errors=True)
            log.info("dropped weights of step %d", step)
