"""The weight swarm under faults: a peer serving corrupted pieces, a manifest not signed by
the trainer, a downloader killed mid-download, a late joiner, the trainer gone.

Real libp2p hosts on loopback (Noise, Yamux); the downloaders that get killed are real
`prime-node fetch` processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from protocol.identity import Identity
from protocol.processes import ManagedProcess, free_port
from protocol.swarm.config import SwarmConfig
from protocol.swarm.host import SwarmHost
from protocol.swarm.manifest import MANIFEST_FILE, ManifestError, publish_folder, sign_manifest

REPO = Path(__file__).resolve().parents[2]
KiB, MiB = 1024, 1024 * 1024


def make_version(folder: Path, size: int, piece_size: int, trainer: Identity, step: int = 1):
    folder.mkdir(parents=True)
    (folder / "model.bin").write_bytes(os.urandom(size))
    (folder / "config.json").write_text(json.dumps({"step": step}))
    return publish_folder(folder, trainer, step, piece_size)


def digest_files(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if not p.name.startswith(".")
    }


def test_corrupting_peer_is_banned_and_no_bad_piece_is_kept(tmp_path: Path) -> None:
    trainer = Identity.generate()
    src = tmp_path / "src"
    manifest, envelope = make_version(src, 2 * MiB, 64 * KiB, trainer)
    # The liar holds the signed manifest but files whose every piece has a flipped byte.
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    data = bytearray((bad / "model.bin").read_bytes())
    for pos in range(0, len(data), 64 * KiB):
        data[pos] ^= 0xFF
    (bad / "model.bin").write_bytes(bytes(data))

    trusted = {trainer.public_key}
    seed = SwarmHost(trainer, SwarmConfig(upload_rate=512 * KiB), trusted).start()
    liar = SwarmHost(Identity.generate(), SwarmConfig(), trusted).start()  # fast, unlimited
    peers = [
        SwarmHost(Identity.generate(), SwarmConfig(upload_rate=1 * MiB), trusted).start()
        for _ in range(3)
    ]
    try:
        digest = seed.seed(envelope, src)
        liar.seed(envelope, bad)
        futures = [
            p.fetch(envelope, tmp_path / f"d{i}" / "v", liar.addrs + seed.addrs)
            for i, p in enumerate(peers)
        ]
        folders = [f.result(90) for f in futures]
        for p, folder in zip(peers, folders, strict=True):
            assert digest_files(folder) == digest_files(src)
            status = p.status(digest)
            assert status.complete
            # Every downloader met the liar first, got at least one bad piece, and banned it.
            assert status.bad_pieces >= 1
            assert liar.peer_id in p.banned
            assert liar.peer_id not in status.peers
            # Bad pieces came from the liar only: no honest peer ever re-served one.
            assert all(liar.peer_id in e for e in status.errors)
            assert set(p.banned) == {liar.peer_id}
        liar_status = liar.status(digest)
        assert liar_status.peers == []  # every session with it was dropped
    finally:
        for h in [seed, liar, *peers]:
            h.close()


def test_manifest_not_signed_by_the_trainer_is_refused(tmp_path: Path) -> None:
    trainer, mallory = Identity.generate(), Identity.generate()
    manifest, _ = make_version(tmp_path / "src", 256 * KiB, 64 * KiB, trainer)
    forged = sign_manifest(mallory, manifest)  # same content, wrong signer
    with SwarmHost(Identity.generate(), SwarmConfig(), {trainer.public_key}) as host:
        with pytest.raises(ManifestError, match="not trusted"):
            host.fetch(forged, tmp_path / "d" / "v")
        with pytest.raises(ManifestError):
            host.fetch(b"\x93garbage", tmp_path / "d" / "v")
        assert host.statuses() == []
    assert not (tmp_path / "d").exists()


def _fetch_process(
    tmp: Path, name: str, manifest: Path, trainer: Identity, peers: list[str], port: int, rate: int
) -> ManagedProcess:
    cmd = [
        sys.executable,
        "-m",
        "node.cli",
        "fetch",
        "--manifest",
        str(manifest),
        "--trusted_key",
        trainer.node_id,
        "--peers",
        json.dumps(peers),
        "--dest",
        str(tmp / name / "v"),
        "--key_file",
        str(tmp / f"{name}.key"),
        "--swarm.listen",
        json.dumps([f"/ip4/127.0.0.1/tcp/{port}"]),
        "--swarm.upload_rate",
        str(rate),
        "--status_file",
        str(tmp / f"{name}.json"),
        "--seed_after_s",
        "600",
        "--progress",
        "false",
    ]
    return ManagedProcess.start(
        name, cmd, "http://unused", tmp / f"{name}.log", cwd=REPO, wait=False
    )


def _status(tmp: Path, name: str) -> dict:
    try:
        return json.loads((tmp / f"{name}.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _fraction(tmp: Path, name: str) -> float:
    s = _status(tmp, name)
    return s.get("have", 0) / s.get("pieces", 1)


def _wait(pred, what: str, procs: dict[str, ManagedProcess], timeout_s: float = 90) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.2)
    logs = "\n".join(f"--- {n}\n{p.log_tail(1500)}" for n, p in procs.items())
    raise TimeoutError(f"{what} within {timeout_s} s\n{logs}")


@pytest.mark.slow
def test_killed_and_late_downloaders_finish_from_peers_after_the_trainer_left(
    tmp_path: Path,
) -> None:
    trainer = Identity.generate()
    src = tmp_path / "src"
    size, rate = 3 * MiB, 512 * KiB
    _, envelope = make_version(src, size, 64 * KiB, trainer)
    manifest_file = tmp_path / "v.manifest"
    manifest_file.write_bytes(envelope)
    seed = SwarmHost(trainer, SwarmConfig(upload_rate=rate), {trainer.public_key}).start()
    seed.seed(envelope, src)
    ports = {n: free_port() for n in "abcd"}
    ids = {n: Identity.load_or_create(tmp_path / f"{n}.key").node_id for n in "abcd"}
    addr = {n: f"/ip4/127.0.0.1/tcp/{ports[n]}/p2p/{ids[n]}" for n in "abcd"}
    procs: dict[str, ManagedProcess] = {}
    try:
        for n in "abc":
            procs[n] = _fetch_process(
                tmp_path, n, manifest_file, trainer, seed.addrs, ports[n], rate
            )
        # Kill c (kill -9) in the middle of its download.
        _wait(lambda: 0.2 < _fraction(tmp_path, "c") < 0.8, "c half-way", procs)
        procs["c"].kill9()
        had = _status(tmp_path, "c")["have"]
        assert not _status(tmp_path, "c")["complete"]
        _wait(
            lambda: all(_status(tmp_path, n).get("complete") for n in "ab"),
            "a and b complete",
            procs,
        )
        seed.close()  # the trainer is gone: whatever follows comes from peers alone
        # c restarts on its .partial folder; d joins late knowing only a (and learns b).
        procs["c"] = _fetch_process(
            tmp_path, "c", manifest_file, trainer, [addr["a"], addr["b"]], ports["c"], rate
        )
        procs["d"] = _fetch_process(
            tmp_path, "d", manifest_file, trainer, [addr["a"]], ports["d"], rate
        )
        _wait(
            lambda: all(_status(tmp_path, n).get("complete") for n in "cd"),
            "c and d complete from peers",
            procs,
        )
        for n in "abcd":
            assert digest_files(tmp_path / n / "v") == digest_files(src), n
            assert _status(tmp_path, n)["bad_pieces"] == 0
        c = _status(tmp_path, "c")
        # The restarted c kept the pieces it had checked before the kill. Its byte count
        # may hold endgame duplicates: up to `pipeline` pieces asked of each of its 2 peers.
        endgame = 2 * SwarmConfig().pipeline * 64 * KiB
        assert had > 0 and c["downloaded"] <= size - had * 64 * KiB + endgame
        assert (
            trainer.node_id not in c["per_peer"]
            and trainer.node_id not in _status(tmp_path, "d")["per_peer"]
        )
        assert not (tmp_path / "c" / "v.partial").exists()
    finally:
        seed.close()
        for p in procs.values():
            p.kill9()


def test_a_version_finished_before_a_restart_is_seeded_not_fetched_again(tmp_path: Path) -> None:
    trainer = Identity.generate()
    src = tmp_path / "src"
    _, envelope = make_version(src, 512 * KiB, 64 * KiB, trainer)
    node = Identity.generate()
    with SwarmHost(trainer, SwarmConfig(), {trainer.public_key}) as seed:
        seed.seed(envelope, src)
        with SwarmHost(node, SwarmConfig(), {trainer.public_key}) as first:
            first.fetch(envelope, tmp_path / "d" / "v", seed.addrs).result(30)
    # The node restarts with no peer at all: its own finished folder is enough.
    with SwarmHost(node, SwarmConfig(), {trainer.public_key}) as again:
        folder = again.fetch(envelope, tmp_path / "d" / "v").result(10)
        (status,) = again.statuses()
        assert status.complete and status.downloaded == 0
        assert digest_files(folder) == digest_files(src)


def _publisher(tmp: Path, source: Path, name: str) -> tuple[ManagedProcess, list[str]]:
    """`prime-trainer publish` of `source` as its own process; returns it and its addrs."""
    proc = ManagedProcess.start(
        name, [sys.executable, "-m", "trainer.cli", "publish", "--source", str(source),
               "--trainer-key", str(tmp / "trainer.key"), "--progress", "false"],
        "", tmp / f"{name}.log", cwd=REPO, wait=False,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while "--peers '" not in (text := proc.log_path.read_text().replace("\n", "")):
        assert proc.alive() and time.monotonic() < deadline, proc.log_tail()
        time.sleep(0.1)
    return proc, json.loads(text.split("--peers '", 1)[1].split("'", 1)[0])


def test_a_trainer_restarted_on_a_new_port_is_reached_by_a_node_that_knew_it(
    tmp_path: Path,
) -> None:
    """kill -9 of the trainer's seed, restart with the same key on another port: a node
    that had fetched from the old one fetches the next version from the new address
    (libp2p must not keep dialing the dead port or a dead connection)."""
    trainer = Identity.load_or_create(tmp_path / "trainer.key")
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    make_version(v1, 256 * KiB, 64 * KiB, trainer, step=1)
    make_version(v2, 256 * KiB, 64 * KiB, trainer, step=2)
    first, addrs1 = _publisher(tmp_path, v1, "pub1")
    env1 = (v1 / MANIFEST_FILE).read_bytes()  # as the publisher signed it
    try:
        with SwarmHost(Identity.generate(), SwarmConfig(), {trainer.public_key}) as node:
            node.fetch(env1, tmp_path / "n" / "v1", addrs1).result(30)
            first.kill9()
            second, addrs2 = _publisher(tmp_path, v2, "pub2")
            env2 = (v2 / MANIFEST_FILE).read_bytes()
            assert addrs2 != addrs1
            try:
                folder = node.fetch(env2, tmp_path / "n" / "v2", addrs2).result(20)
            finally:
                second.stop()
            assert digest_files(folder) == digest_files(v2)
    finally:
        first.stop()
