"""Two peers behind different NATs trade a version through a circuit relay (network
namespaces, `tests.netns`): the seed A sits in one private network, the fetcher B in
another, the relay R on the public side. Neither can dial the other; A reserves a slot on
R and B reaches A through it. Without the relayed address, B gets nothing. Real processes
(`prime-trainer publish`, `prime-node fetch`), real libp2p, every piece hash-checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from protocol.identity import Identity
from protocol.processes import free_port
from tests.netns import available, nat_lab
from tests.rl_runs import ENV, REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _wait_for(path, text: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        assert proc.poll() is None, path.read_text()[-3000:]
        time.sleep(0.2)
    raise TimeoutError(f"{text!r} not in {path}:\n{path.read_text()[-3000:]}")


def test_peers_behind_two_nats_trade_through_the_relay(tmp_path):
    if reason := available():
        if "root" in reason:
            pytest.skip(reason)
        pytest.fail(reason)
    relay_key, seed_key = tmp_path / "relay.key", tmp_path / "seed.key"
    relay_id = Identity.load_or_create(relay_key).node_id
    seed_id = Identity.load_or_create(seed_key).node_id
    (tmp_path / "nothing").write_bytes(b"relay only")
    version = tmp_path / "step_1"
    version.mkdir()
    (version / "weights.bin").write_bytes(os.urandom(3 * 2**20))
    (version / "config.json").write_text("{}")
    with nat_lab("psrelay") as lab:
        lan_a, lan_b = lab.lans
        relay_port, seed_port = free_port(), free_port()
        relay_addr = f"/ip4/{lab.pub_ip}/tcp/{relay_port}/p2p/{relay_id}"
        publish = [sys.executable, "-m", "trainer.cli", "publish", "--progress", "false"]
        with (tmp_path / "relay.log").open("w") as log:
            relay = lab.popen(
                lab.pub, [*publish, "--source", str(tmp_path / "nothing"),
                          "--trainer-key", str(relay_key), "--swarm.relay-service", "true",
                          "--swarm.listen", json.dumps([f"/ip4/{lab.pub_ip}/tcp/{relay_port}"])],
                cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        _wait_for(tmp_path / "relay.log", "written to", relay)
        with (tmp_path / "seed.log").open("w") as log:
            seed = lab.popen(
                lan_a, [*publish, "--source", str(version), "--step", "1",
                        "--trainer-key", str(seed_key), "--swarm.piece-size", str(256 * 1024),
                        "--swarm.listen", json.dumps([f"/ip4/{lab.lan_ip(lan_a)}/tcp/{seed_port}"]),
                        "--swarm.relays", json.dumps([relay_addr])],
                cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        _wait_for(tmp_path / "seed.log", "written to", seed)
        assert "reachable through relay" in (tmp_path / "seed.log").read_text()
        direct = f"/ip4/{lab.lan_ip(lan_a)}/tcp/{seed_port}/p2p/{seed_id}"
        circuit = f"{relay_addr}/p2p-circuit/p2p/{seed_id}"

        def fetch(dest: str, peers: list[str], timeout_s: float) -> subprocess.CompletedProcess:
            return lab.run(
                lan_b, [sys.executable, "-m", "node.cli", "fetch", "--progress", "false",
                        "--manifest", str(version / ".manifest"), "--trusted-key", seed_id,
                        "--dest", str(tmp_path / dest), "--key-file", str(tmp_path / "b.key"),
                        "--swarm.connect-timeout-s", "3", "--peers", json.dumps(peers)],
                cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout_s,
            )  # fmt: skip

        # Relay off (only A's direct address): B cannot reach A, and gets nothing.
        with pytest.raises(subprocess.TimeoutExpired):
            fetch("direct-only", [direct], 20)
        # Through the relay: the whole version, byte for byte.
        t0 = time.monotonic()
        out = fetch("relayed", [direct, circuit], 120)
        took = time.monotonic() - t0
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        got = tmp_path / "relayed" / "weights.bin"
        assert got.read_bytes() == (version / "weights.bin").read_bytes()
        print(f"\n3 MiB fetched through the relay across two NATs in {took:.1f} s")
