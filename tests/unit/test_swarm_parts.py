"""The weight swarm's parts, each alone: manifests, the piece store, the piece picker, the
wire framing, the rate limiter, the scheduler's tracker and the settings' validators."""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import trio
from pydantic import ValidationError
from safetensors.torch import save_file

from node.config import FetchConfig
from protocol.identity import Identity
from protocol.messages import FileEntry, Manifest, SwarmAnnounce, WeightUpdate
from protocol.swarm.config import SwarmConfig
from protocol.swarm.manifest import (
    MANIFEST_FILE,
    ManifestError,
    build_manifest,
    open_manifest,
    publish_folder,
    sign_manifest,
)
from protocol.swarm.picker import PiecePicker
from protocol.swarm.ratelimit import TokenBucket
from protocol.swarm.store import PieceStore
from protocol.swarm.wire import FrameReader, Kind, Msg, WireError, encode, pack_bits, unpack_bits
from scheduler.tracker import Tracker
from trainer.config import PublishConfig, WeightsConfig

KiB = 1024


def version(tmp_path: Path) -> Path:
    folder = tmp_path / "v"
    folder.mkdir()
    tensors = {"a": torch.arange(5000, dtype=torch.float32), "b": torch.ones(3, 7)}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"x": 1}))
    (folder / ".hidden").write_text("never part of a version")
    return folder


# -- manifests ---------------------------------------------------------------------------
def test_manifest_hashes_the_concatenated_files_piece_by_piece(tmp_path):
    folder = version(tmp_path)
    m = build_manifest(folder, step=3, piece_size=4 * KiB)
    assert [f.name for f in m.files] == ["config.json", "model.safetensors"]
    blob = b"".join((folder / f.name).read_bytes() for f in m.files)
    assert m.total_size == len(blob) and m.num_pieces == -(-len(blob) // (4 * KiB))
    for i, h in enumerate(m.pieces):  # pieces span file boundaries
        assert hashlib.sha256(blob[i * 4 * KiB : (i + 1) * 4 * KiB]).hexdigest() == h
    # The tensor layout points at each tensor's bytes in the concatenation.
    a = next(t for t in m.tensors if t.name == "a")
    assert a.shape == [5000] and a.dtype == "F32"
    assert (
        blob[a.offset : a.offset + a.size]
        == torch.arange(5000, dtype=torch.float32).numpy().tobytes()
    )
    assert build_manifest(folder, 3, 4 * KiB).digest() == m.digest()  # deterministic


def test_only_a_trusted_signature_opens_a_manifest(tmp_path):
    trainer, other = Identity.generate(), Identity.generate()
    m, env = publish_folder(version(tmp_path), trainer, 1, 4 * KiB)
    assert (tmp_path / "v" / MANIFEST_FILE).read_bytes() == env
    assert open_manifest(env, {trainer.public_key}).digest() == m.digest()
    with pytest.raises(ManifestError, match="not trusted"):
        open_manifest(sign_manifest(other, m), {trainer.public_key})
    tampered = env.replace(m.pieces[0].encode(), b"0" * 64)
    with pytest.raises(ManifestError, match="bad signature"):
        open_manifest(tampered, {trainer.public_key})


def test_manifest_shape_is_checked():
    ok = dict(step=1, piece_size=1024, total_size=2048, files=[FileEntry(name="a", size=2048)])
    Manifest(**ok, pieces=["0" * 64] * 2)
    with pytest.raises(ValidationError, match="2 pieces"):
        Manifest(**ok, pieces=["0" * 64])
    with pytest.raises(ValidationError, match="plain name"):
        FileEntry(name="../etc/passwd", size=1)
    with pytest.raises(ValidationError, match="sum of the file sizes"):
        Manifest(**{**ok, "total_size": 4096}, pieces=["0" * 64] * 4)


# -- the piece store ------------------------------------------------------------------------
def test_store_keeps_only_pieces_that_match_and_resumes_after_a_crash(tmp_path):
    trainer = Identity.generate()
    src = version(tmp_path)
    m, env = publish_folder(src, trainer, 1, 4 * KiB)
    seed = PieceStore.seed(src, m)
    dest = tmp_path / "dl" / "v"
    store = PieceStore.download(dest, m)
    assert not any(store.have) and store.left == m.total_size
    good = seed.read(1)
    assert not store.put(1, b"x" * len(good))  # a bad piece is never written
    assert not store.have[1]
    assert store.put(1, good) and store.have[1]
    # A killed process leaves a .partial folder: reopening re-checks what is there.
    again = PieceStore.download(dest, m)
    assert again.have == store.have
    for i in range(m.num_pieces):
        again.put(i, seed.read(i))
    final = again.finish(env)
    assert final == dest and not dest.with_name("v.partial").exists()
    for f in m.files:
        assert (dest / f.name).read_bytes() == (src / f.name).read_bytes()
    assert (dest / MANIFEST_FILE).read_bytes() == env
    (src / "config.json").write_text("{}")  # a seed whose files do not fit its manifest
    with pytest.raises(ValueError, match="the manifest says"):
        PieceStore.seed(src, m)


def _finish_while_serving(store: PieceStore, piece: bytes, envelope: bytes) -> list:
    """Finish `store` while one thread reads piece 0 and another writes it again; returns
    what those threads raised."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def serve(op) -> None:
        try:
            while not stop.is_set():
                op()
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    def read() -> None:
        assert store.read(0) == piece

    def late_copy() -> None:
        assert store.put(0, piece)

    threads = [threading.Thread(target=serve, args=(op,)) for op in (read, late_copy)]
    for t in threads:
        t.start()
    time.sleep(0.002)
    store.finish(envelope)
    time.sleep(0.002)
    stop.set()
    for t in threads:
        t.join()
    return errors


def test_a_piece_asked_for_while_its_download_is_finished_is_served_from_its_files(tmp_path):
    """A peer's request can reach the store while another thread finishes the download
    (`Torrent._finish` renames `<dest>.partial` to `<dest>`), and a late endgame copy of
    a piece can be written then too: each is read or written wherever the files are at
    that moment, never a FileNotFoundError for the moved `.partial` folder (seen on the
    H200 for `delta_N_*.partial/delta.zst`)."""
    trainer = Identity.generate()
    src = tmp_path / "v"
    src.mkdir()
    rng = random.Random(0)
    for i in range(48):  # piece 0 spans 41 small files: a read opens them one by one
        (src / f"f{i:02d}").write_bytes(rng.randbytes(100))
    m, env = publish_folder(src, trainer, 1, 4 * KiB)
    seed = PieceStore.seed(src, m)
    pieces = [seed.read(i) for i in range(m.num_pieces)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads switch often: the race shows in the first round
    try:
        for n in range(5):
            dest = tmp_path / f"dl{n}" / "v"
            store = PieceStore.download(dest, m)
            for i, piece in enumerate(pieces):
                assert store.put(i, piece)
            errors = _finish_while_serving(store, pieces[0], env)
            assert not errors, errors[0]
            assert store.folder == dest and not dest.with_name("v.partial").exists()
            assert store.read(0) == pieces[0]
    finally:
        sys.setswitchinterval(interval)


# -- the picker ---------------------------------------------------------------------------
def test_picker_asks_for_the_rarest_piece_the_peer_has():
    p = PiecePicker([False] * 4, random.Random(0))
    p.peer_has([0, 1, 2, 3])
    p.peer_has([0, 2, 3])
    p.peer_has([0, 3])
    assert p.pick("a", [True] * 4) == 1  # held by one peer only
    assert p.pick("a", [True, False, True, True]) == 2
    assert p.pick("a", [False] * 4) is None
    # Ties are broken at random, so peers do not all chase the same piece.
    ties = PiecePicker([False] * 8)
    ties.peer_has(range(8))
    assert len({ties.pick("a", [True] * 8) for _ in range(50)}) > 3


def test_endgame_asks_other_peers_for_outstanding_pieces_and_cancels_the_rest():
    p = PiecePicker([True, True, False, False])
    p.peer_has([2, 3])
    p.mark_requested(2, "a")
    assert not p.endgame
    assert p.pick("b", [True] * 4) == 3
    p.mark_requested(3, "b")
    assert p.endgame
    assert p.pick("a", [True] * 4) == 3  # the piece a was not asked for
    p.mark_requested(3, "a")
    assert p.pick("a", [True] * 4) is None
    assert sorted(p.got(3)) == ["a", "b"]  # both to cancel (the winner is skipped by caller)
    p.drop_peer("a")
    assert not p.endgame and p.pick("c", [True] * 4) == 2


def test_timed_out_requests_are_reported():
    p = PiecePicker([False, False])
    p.mark_requested(0, "a")
    assert p.expired(60) == []
    time.sleep(0.02)
    assert p.expired(0.01) == [(0, "a")]


# -- the wire -------------------------------------------------------------------------------
class Chunky:
    """A stream that returns whatever it holds in small random slices."""

    def __init__(self, data: bytes):
        self.data = data

    async def read(self, n: int) -> bytes:
        k = min(n, random.randint(1, 7), len(self.data))
        out, self.data = self.data[:k], self.data[k:]
        return out


def test_frames_survive_any_slicing_and_oversized_ones_are_refused():
    msgs = [
        Msg(Kind.HANDSHAKE, data=os.urandom(32), peers=[("p", ["/ip4/1.2.3.4/tcp/1/p2p/p"])]),
        Msg(Kind.PIECE, 7, os.urandom(3000)),
        Msg(Kind.HAVE, 9),
    ]

    async def main():
        reader = FrameReader(Chunky(b"".join(encode(m) for m in msgs)))
        assert [await reader.read(4096) for _ in msgs] == msgs
        with pytest.raises(WireError, match="stream ended"):
            await reader.read(4096)
        with pytest.raises(WireError, match="exceeds"):
            await FrameReader(Chunky(encode(msgs[1]))).read(1024)
        with pytest.raises(WireError, match="malformed"):
            await FrameReader(Chunky(b"\x00\x00\x00\x02\x91\x01")).read(1024)

    trio.run(main)


def test_bitfields_round_trip():
    bits = [random.random() < 0.5 for _ in range(37)]
    assert unpack_bits(pack_bits(bits), 37) == bits
    with pytest.raises(WireError):
        unpack_bits(pack_bits(bits), 100)


def test_token_bucket_holds_its_rate():
    async def main():
        bucket = TokenBucket(rate=1024 * KiB, burst=64 * KiB)
        t0 = trio.current_time()
        for _ in range(16):
            await bucket.take(64 * KiB)  # 1 MiB in all, 64 KiB of it free (the burst)
        return trio.current_time() - t0

    assert 0.8 < trio.run(main) < 1.5


# -- the tracker ----------------------------------------------------------------------------
def test_tracker_lists_other_members_seeds_first_and_forgets_the_silent():
    t = Tracker(interval_s=0.05)
    h = "a" * 64
    t.announce("p1", SwarmAnnounce(manifest_hash=h, addrs=["/ip4/1.1.1.1/tcp/1"]))
    t.announce("p2", SwarmAnnounce(manifest_hash=h, addrs=["/ip4/2.2.2.2/tcp/1"], complete=True))
    answer = t.announce("p3", SwarmAnnounce(manifest_hash=h, addrs=["/ip4/3.3.3.3/tcp/1"]))
    assert [p.peer_id for p in answer.peers] == ["p2", "p1"]
    t.announce("p1", SwarmAnnounce(manifest_hash=h, stopped=True))
    assert [p.peer_id for p in t.announce("p3", SwarmAnnounce(manifest_hash=h)).peers] == ["p2"]
    time.sleep(0.25)  # past 4 intervals
    assert t.announce("p3", SwarmAnnounce(manifest_hash=h)).peers == []
    t.forget("p3")
    assert t.counts()[h[:12]] == {"peers": 0, "seeds": 0, "relayed": 0, "unreachable": 0}


def test_the_tracker_knows_who_is_reached_directly_and_who_through_a_relay():
    t, h = Tracker(), "b" * 64
    relay = "/ip4/8.8.8.8/tcp/4001/p2p/R"
    t.announce("public", SwarmAnnounce(manifest_hash=h, addrs=["/ip4/1.1.1.1/tcp/1"]))
    t.announce("natd", SwarmAnnounce(manifest_hash=h, addrs=[
        "/ip4/192.168.1.2/tcp/1", f"{relay}/p2p-circuit/p2p/natd"]))  # fmt: skip
    t.announce("both", SwarmAnnounce(manifest_hash=h, addrs=[
        "/ip4/2.2.2.2/tcp/1", f"{relay}/p2p-circuit/p2p/both"]))  # fmt: skip
    t.announce("lost", SwarmAnnounce(manifest_hash=h, addrs=["/ip4/10.0.0.3/tcp/1"]))
    counts = t.counts()[h[:12]]
    assert (counts["peers"], counts["relayed"], counts["unreachable"]) == (4, 2, 1)


# -- settings -------------------------------------------------------------------------------
def test_swarm_settings_fail_fast_with_a_clear_message(tmp_path):
    with pytest.raises(ValidationError, match="not a multiaddr"):
        SwarmConfig(listen=["127.0.0.1:4001"])
    with pytest.raises(ValidationError, match="not an Ed25519 node id"):
        FetchConfig(manifest=tmp_path / "m", trusted_key="nobody")
    with pytest.raises(ValidationError, match="/p2p/"):
        FetchConfig(
            manifest=tmp_path / "m",
            trusted_key=Identity.generate().node_id,
            peers=["/ip4/1.2.3.4/tcp/1"],
        )
    with pytest.raises(ValidationError, match="does not exist"):
        PublishConfig(source=tmp_path / "missing")
    with pytest.raises(ValidationError, match="path or a swarm manifest"):
        WeightUpdate(version=1)
    assert WeightsConfig(transport="swarm", swarm={"upload_rate": 10}).swarm.upload_rate == 10


# -- delta versions ---------------------------------------------------------------------------
def _version(folder: Path, state: dict, config: str = "{}") -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(config)
    return folder


def test_a_delta_rebuilds_the_new_version_byte_for_byte(tmp_path):
    import torch

    from protocol.swarm.delta import apply_delta, make_delta
    from protocol.swarm.manifest import build_manifest

    g = torch.Generator().manual_seed(0)
    master = {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}
    base = _version(tmp_path / "a", {k: v.bfloat16() for k, v in master.items()})
    moved = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in master.items()}
    moved["b"][:3] = torch.tensor([-0.0, float("nan"), float("inf")])  # raw bytes, not floats
    new = _version(tmp_path / "b", {k: v.bfloat16() for k, v in moved.items()})
    stats = make_delta(base, new, tmp_path / "d")
    assert stats is not None and 0 < stats.changed < stats.elements
    assert stats.delta_bytes < stats.full_bytes / 2
    apply_delta(base, tmp_path / "d", tmp_path / "out")
    assert build_manifest(tmp_path / "out", 1, 4096).pieces == build_manifest(new, 1, 4096).pieces
    assert (base / "model.safetensors").read_bytes() != (new / "model.safetensors").read_bytes()


def test_a_delta_is_not_made_when_the_full_version_pays_or_cannot_be_rebuilt(tmp_path):
    import torch

    from protocol.swarm.delta import make_delta

    g = torch.Generator().manual_seed(1)
    w = torch.randn(128, 32, generator=g)
    base = _version(tmp_path / "a", {"w": w})
    # Every value changed (an fp32 step): the delta would be larger than half the version.
    assert make_delta(base, _version(tmp_path / "b", {"w": w + 1e-3}), tmp_path / "d1") is None
    # A config file changed: not a weights-only step.
    assert make_delta(base, _version(tmp_path / "c", {"w": w}, '{"x": 1}'), tmp_path / "d2") is None
    # Another dtype (another header): nothing to patch in place.
    assert make_delta(base, _version(tmp_path / "e", {"w": w.bfloat16()}), tmp_path / "d3") is None
    assert not any((tmp_path / d).exists() for d in ("d1", "d2", "d3"))


def test_a_delta_that_does_not_fit_its_base_is_refused_and_leaves_nothing(tmp_path):
    import msgpack
    import numpy as np
    import torch
    import zstandard

    from protocol.swarm.delta import DELTA_FILE, DeltaError, apply_delta

    base = _version(tmp_path / "a", {"w": torch.zeros(16)})
    bad = {
        "unknown tensor": [{"file": "model.safetensors", "name": "nope", "gaps": b"", "values": b""}],
        "index out of range": [
            {"file": "model.safetensors", "name": "w",
             "gaps": np.array([99], np.uint32).tobytes(), "values": bytes(4)}
        ],
        "not a base file": [{"file": "../x.safetensors", "name": "w", "gaps": b"", "values": b""}],
    }  # fmt: skip
    for what, tensors in bad.items():
        d = tmp_path / what.replace(" ", "_")
        d.mkdir()
        raw = msgpack.packb({"v": 1, "tensors": tensors}, use_bin_type=True)
        (d / DELTA_FILE).write_bytes(zstandard.ZstdCompressor().compress(raw))
        with pytest.raises(DeltaError):
            apply_delta(base, d, tmp_path / "out")
        assert not (tmp_path / "out").exists(), what
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / DELTA_FILE).write_bytes(b"not zstd")
    with pytest.raises(DeltaError):
        apply_delta(base, tmp_path / "junk", tmp_path / "out")
