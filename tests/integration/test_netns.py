"""The NAT lab (tests/netns.py) behaves like the internet a NAT'd worker sees.

Outbound TCP from a LAN works and appears from its router's public IP; nothing on the
public side (nor the other LAN) can open a connection into a LAN; and the lab leaves no
namespace or process behind, also when the body raised.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.netns import NatLab, available, list_namespaces, nat_lab

pytestmark = pytest.mark.timeout(120)

PORT = 47001  # every namespace has its own port space; fixed ports keep it readable

# TCP server: prints "READY", then for each connection prints "PEER <ip>" and sends the
# peer address it saw back to the client.
SERVER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(16)
print("READY", flush=True)
while True:
    c, (ip, port) = s.accept()
    print("PEER", ip, flush=True)
    c.sendall(ip.encode() + b"\n")
    c.close()
"""

# TCP client: one connect with a timeout; prints JSON {"ok", "reply" | "error"}.
CLIENT = r"""
import json, socket, sys
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
    with socket.create_connection((host, port), timeout=timeout) as c:
        c.settimeout(timeout)
        reply = c.makefile().readline().strip()
    print(json.dumps({"ok": True, "reply": reply}))
except OSError as e:
    print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}))
"""


def _require_lab() -> None:
    if os.geteuid() != 0:
        pytest.skip("not root: network namespaces need root")
    reason = available()
    if reason:
        pytest.fail(f"the NAT lab cannot be built here: {reason}")


@pytest.fixture(scope="module")
def lab():
    _require_lab()
    with nat_lab("pstest") as built:
        yield built


class Server:
    def __init__(self, lab: NatLab, ns: str, host: str, port: int = PORT):
        self.proc = lab.popen(
            ns,
            [sys.executable, "-c", SERVER, host, str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline().strip()
        if line != "READY":
            self.proc.kill()
            raise AssertionError(
                f"server in {ns} did not start: {line!r} {self.proc.stderr.read()}"
            )

    def peers(self) -> list[str]:
        """Peers seen so far, after the server is stopped (drains its stdout)."""
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=5)
        return [line.split()[1] for line in out.splitlines() if line.startswith("PEER ")]


def connect(lab: NatLab, ns: str, host: str, port: int = PORT, timeout: float = 2.0) -> dict:
    out = lab.run(
        ns,
        [sys.executable, "-c", CLIENT, host, str(port), str(timeout)],
        capture_output=True,
        text=True,
        timeout=timeout + 15,
        check=True,
    ).stdout
    return json.loads(out)


def test_lan_reaches_public_server_through_masquerade(lab: NatLab):
    server = Server(lab, lab.pub, lab.pub_ip)
    seen_by_client = {}
    for ns in lab.lans:
        result = connect(lab, ns, lab.pub_ip)
        assert result["ok"], f"{ns} -> {lab.pub_ip}:{PORT}: {result}"
        seen_by_client[ns] = result["reply"]
    peers = server.peers()
    for ns in lab.lans:
        assert seen_by_client[ns] == lab.public_ip_of(ns), (
            f"{ns} ({lab.lan_ip(ns)}) appeared as {seen_by_client[ns]}, "
            f"want its router's public IP {lab.public_ip_of(ns)}"
        )
    assert peers == [lab.public_ip_of(ns) for ns in lab.lans]
    assert not any(p.startswith("192.168.") for p in peers)


def test_public_side_cannot_connect_into_a_lan(lab: NatLab):
    servers = {ns: Server(lab, ns, "0.0.0.0") for ns in lab.lans}
    try:
        for ns in lab.lans:
            # The LAN process does listen: its own namespace reaches it.
            local = connect(lab, ns, lab.lan_ip(ns))
            assert local["ok"], f"{ns} cannot reach its own listener: {local}"
            for target in (lab.lan_ip(ns), lab.public_ip_of(ns)):
                t0 = time.monotonic()
                result = connect(lab, lab.pub, target)
                assert not result["ok"], f"pub -> {ns} via {target}:{PORT} connected: {result}"
                assert time.monotonic() - t0 < 5
        # Even a public host that routes 192.168.k.0/24 at the router (a neighbour on the
        # same segment) is dropped by the router's forward filter: the connect times out.
        for ns in lab.lans:
            route = [lab.lan_ip(ns).rsplit(".", 1)[0] + ".0/24", "via", lab.public_ip_of(ns)]
            lab.run(lab.pub, ["ip", "route", "add", *route], check=True)
            try:
                result = connect(lab, lab.pub, lab.lan_ip(ns), timeout=1.0)
            finally:
                lab.run(lab.pub, ["ip", "route", "del", *route], check=True)
            assert not result["ok"], f"router forwarded a new inbound connection: {result}"
            assert "timed out" in result["error"], result
    finally:
        peers = {ns: s.peers() for ns, s in servers.items()}
    for ns in lab.lans:
        # Only the LAN's own probe arrived.
        assert peers[ns] == [lab.lan_ip(ns)], f"{ns} listener saw {peers[ns]}"


def test_lans_cannot_reach_each_other(lab: NatLab):
    lan1, lan2 = lab.lans
    server = Server(lab, lan2, "0.0.0.0")
    try:
        for target in (lab.lan_ip(lan2), lab.public_ip_of(lan2)):
            result = connect(lab, lan1, target)
            assert not result["ok"], f"{lan1} -> {lan2} via {target}:{PORT} connected: {result}"
    finally:
        peers = server.peers()
    assert peers == [], f"{lan2} listener saw {peers}"


def _assert_gone(prefix: str, procs: list[subprocess.Popen]) -> None:
    left = [ns for ns in list_namespaces() if ns.startswith(f"{prefix}-")]
    assert left == [], f"namespaces left behind: {left}"
    for proc in procs:
        assert proc.poll() is not None, f"process {proc.pid} ({proc.args}) still running"


@pytest.mark.parametrize("exc", [None, RuntimeError, KeyboardInterrupt])
def test_exit_removes_namespaces_and_processes(exc):
    _require_lab()
    prefix = "pstx"
    # A stale namespace from a "crashed" earlier run does not stop the build.
    subprocess.run(["ip", "netns", "add", f"{prefix}-lan1"], check=False, capture_output=True)
    procs: list[subprocess.Popen] = []

    def body() -> None:
        with nat_lab(prefix) as lab:
            assert sorted(lab.namespaces) == sorted(
                ns for ns in list_namespaces() if ns.startswith(f"{prefix}-")
            )
            for ns in lab.namespaces:
                procs.append(lab.popen(ns, ["sleep", "600"]))
            if exc is not None:
                raise exc("body failed")

    if exc is None:
        body()
    else:
        with pytest.raises(exc):
            body()
    assert len(procs) == 5
    _assert_gone(prefix, procs)
