"""Test harness: a public network and two NAT'd private networks in Linux network namespaces.

`nat_lab(prefix)` builds, with `ip` and `nft`, this topology and tears it down again::

                        <prefix>-pub  (br0 10.77.0.1/24, the "internet")
                        /                                          \\
      veth r1 <-> wan 10.77.0.11                     veth r2 <-> wan 10.77.0.12
          <prefix>-rtr1  (NAT router)                    <prefix>-rtr2  (NAT router)
      lan 192.168.1.1/24                                 lan 192.168.2.1/24
          |                                                  |
      eth0 192.168.1.2/24  <prefix>-lan1                 eth0 192.168.2.2/24  <prefix>-lan2

The public side is ONE bridge (`br0`) in the public namespace, holding 10.77.0.1 and
enslaving one veth per router, so both routers sit on the same /24 as the public hosts
(like two home routers on the internet). Scheduler, trainer and public workers run in
`<prefix>-pub` and share 10.77.0.1 (different ports); NAT'd workers run in the LAN
namespaces and reach the public side only through their router.

What this module owns: the namespaces `<prefix>-pub`, `<prefix>-rtr<k>`, `<prefix>-lan<k>`
(and every interface, address, route, sysctl and nftables rule inside them), the lock
file `/run/prime-swarm-netns/<prefix>.lock`, and the processes started with
`NatLab.popen` plus any other process still inside its namespaces at teardown.

Invariants while the lab is up:
- Every namespace has `lo` up; IPv6 is disabled in all of them (the rules are IPv4 only).
- A LAN's only route out is its default route via 192.168.k.1.
- A router forwards (net.ipv4.ip_forward=1), masquerades LAN traffic leaving through
  `wan` (so it appears from 10.77.0.1k), and its forward chain (policy drop) accepts only
  LAN->wan traffic and established/related replies: no new inbound connection reaches a
  LAN and there is no port forwarding. A router has no default route, so LAN1 cannot reach
  LAN2's 192.168.2.0/24 either.
- The public namespace does not forward and has no route to 192.168.0.0/16.
- One live lab per prefix per machine: the lock file (flock) is held for the lab's life,
  so any namespace with the prefix found at start is stale (a crashed earlier run) and is
  deleted, after killing the processes left in it.

On exit, whatever happened (exception, KeyboardInterrupt), processes are killed and
every namespace the lab created is deleted (which removes its veths).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import signal
import subprocess
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PUB_IP = "10.77.0.1"
HOST_IP = "10.77.0.254"  # the root namespace on the public bridge (`host_link`)
PUB_PREFIXLEN = 24
N_PRIVATE = 2
LOCK_DIR = Path("/run/prime-swarm-netns")
LOCK_TIMEOUT_S = 120.0
_PREFIX_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.]{0,19}$")
# ip, nft and sysctl live in /usr/sbin on Debian, which a non-login PATH may lack.
_PATH = os.pathsep.join(
    [os.environ.get("PATH", os.defpath), "/usr/local/sbin", "/usr/sbin", "/sbin"]
)


def _tool(name: str) -> str | None:
    return shutil.which(name, path=_PATH)


class LabError(RuntimeError):
    """A command that builds or inspects the lab failed."""


def router_public_ip(k: int) -> str:
    return f"10.77.0.{10 + k}"


def router_lan_ip(k: int) -> str:
    return f"192.168.{k}.1"


def lan_host_ip(k: int) -> str:
    return f"192.168.{k}.2"


def _sh(argv: Sequence[str], *, input: str | None = None, timeout: float = 30) -> str:
    """Run a command; raise LabError naming it, its exit status and stderr on failure."""
    argv = [_tool(argv[0]) or argv[0], *argv[1:]]
    try:
        proc = subprocess.run(
            argv,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PATH": _PATH},  # for what `ip netns exec` runs
        )
    except FileNotFoundError as e:
        raise LabError(f"`{' '.join(argv)}`: {argv[0]} not found ({e})") from e
    except subprocess.TimeoutExpired as e:
        raise LabError(f"`{' '.join(argv)}` timed out after {timeout} s") from e
    if proc.returncode != 0:
        raise LabError(
            f"`{' '.join(argv)}` failed (exit {proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()}"
        )
    return proc.stdout


def list_namespaces() -> list[str]:
    """Names from `ip netns list` (its lines look like `name (id: 3)`)."""
    out = _sh(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _own_names(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(prefix)}-(pub|rtr\d+|lan\d+)$")


def _ns_pids(ns: str) -> list[int]:
    try:
        out = _sh(["ip", "netns", "pids", ns])
    except LabError:
        return []
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_pids(pids: list[int], grace_s: float = 2.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive or sig == signal.SIGKILL:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            alive = [p for p in alive if _pid_alive(p)]
            if not alive:
                return
            time.sleep(0.05)
        pids = alive


def _pid_alive(pid: int) -> bool:
    try:
        # Reap it if it is our child (a zombie would still answer kill(0)).
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _delete_namespace(ns: str) -> None:
    """Kill what runs in `ns`, then delete it (its veths go with it)."""
    _kill_pids(_ns_pids(ns))
    _sh(["ip", "netns", "del", ns])


def available() -> str:
    """ "" when a lab can be built here, else why not (not root, no `ip netns`, no `nft`)."""
    if os.geteuid() != 0:
        return "not root: network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    if _tool("ip") is None:
        return "`ip` (iproute2) is not installed"
    if _tool("nft") is None:
        return "`nft` is not installed (Debian package nftables)"
    if _tool("sysctl") is None:
        return "`sysctl` is not installed (Debian package procps)"
    probe = f"psprobe-{os.getpid()}"
    try:
        _sh(["ip", "netns", "add", probe])
    except LabError as e:
        return f"`ip netns` does not work here: {e}"
    try:
        # Proves nf_tables and NAT support in a fresh namespace, not only the binary.
        _sh(
            ["ip", "netns", "exec", probe, "nft", "-f", "-"],
            input=(
                "table ip probe {\n"
                "  chain post {\n"
                "    type nat hook postrouting priority srcnat; policy accept;\n"
                '    oifname "lo" masquerade\n'
                "  }\n"
                "}\n"
            ),
        )
    except LabError as e:
        return f"nftables NAT does not work in a network namespace: {e}"
    finally:
        with contextlib.suppress(LabError):
            _sh(["ip", "netns", "del", probe])
    return ""


@dataclass
class NatLab:
    """The built lab: namespace names, addresses, and a way to run processes in it."""

    prefix: str
    pub: str
    routers: list[str]
    lans: list[str]
    pub_ip: str = PUB_IP
    host_link: bool = False
    """The root namespace sits on the public bridge too, as HOST_IP (a public host)."""
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    @property
    def namespaces(self) -> list[str]:
        return [self.pub, *self.routers, *self.lans]

    def _k(self, ns: str) -> int:
        if ns in self.lans:
            return self.lans.index(ns) + 1
        if ns in self.routers:
            return self.routers.index(ns) + 1
        raise ValueError(f"{ns!r} is not a LAN or router namespace of this lab")

    def public_ip_of(self, ns: str) -> str:
        """The address `ns`'s traffic appears from on the public network."""
        if ns == self.pub:
            return self.pub_ip
        return router_public_ip(self._k(ns))

    def lan_ip(self, ns: str) -> str:
        """A LAN namespace's own (private) address, 192.168.k.2."""
        if ns not in self.lans:
            raise ValueError(f"{ns!r} is not a LAN namespace of this lab")
        return lan_host_ip(self._k(ns))

    def exec_prefix(self, ns: str) -> list[str]:
        """Prepend to a command line to run it inside `ns`: ["/usr/sbin/ip", "netns", "exec", ns]."""
        if ns not in self.namespaces:
            raise ValueError(f"{ns!r} is not a namespace of this lab")
        return [_tool("ip") or "ip", "netns", "exec", ns]

    def popen(self, ns: str, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start `argv` inside `ns`; the lab kills it (its whole session) on exit."""
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen([*self.exec_prefix(ns), *argv], **kw)
        self._procs.append(proc)
        return proc

    def run(self, ns: str, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """subprocess.run(`argv`) inside `ns` (same keywords)."""
        return subprocess.run([*self.exec_prefix(ns), *argv], **kw)

    def _stop_procs(self) -> None:
        for proc in self._procs:
            if proc.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=3.0)
        for proc in self._procs:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()


@contextlib.contextmanager
def _prefix_lock(prefix: str) -> Iterator[None]:
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(LOCK_DIR / f"{prefix}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise LabError(
                        f"another live nat_lab holds prefix {prefix!r} "
                        f"({LOCK_DIR / (prefix + '.lock')}) for over {LOCK_TIMEOUT_S:.0f} s"
                    ) from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # releases the flock


def _build(lab: NatLab, created: list[str]) -> None:
    def ip(ns: str, *args: str) -> None:
        _sh(["ip", "-n", ns, *args])

    def sysctl(ns: str, *settings: str) -> None:
        _sh(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *settings])

    for ns in lab.namespaces:
        _sh(["ip", "netns", "add", ns])
        created.append(ns)
        ip(ns, "link", "set", "lo", "up")
        sysctl(
            ns,
            "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1",
        )

    # Public network: one bridge holding the public hosts' address.
    sysctl(lab.pub, "net.ipv4.ip_forward=0")
    ip(lab.pub, "link", "add", "br0", "type", "bridge", "stp_state", "0")
    ip(lab.pub, "addr", "add", f"{lab.pub_ip}/{PUB_PREFIXLEN}", "dev", "br0")
    ip(lab.pub, "link", "set", "br0", "up")
    if lab.host_link:
        # root <-> pub: `<prefix>-host` here, `host` on the bridge (deleted with pub).
        _sh(["ip", "link", "add", f"{lab.prefix}-host"[:15], "type", "veth"]
            + ["peer", "name", "host", "netns", lab.pub])  # fmt: skip
        ip(lab.pub, "link", "set", "host", "master", "br0")
        ip(lab.pub, "link", "set", "host", "up")
        _sh(["ip", "addr", "add", f"{HOST_IP}/{PUB_PREFIXLEN}", "dev", f"{lab.prefix}-host"[:15]])
        _sh(["ip", "link", "set", f"{lab.prefix}-host"[:15], "up"])

    for k, (rtr, lan) in enumerate(zip(lab.routers, lab.lans, strict=True), start=1):
        # pub <-> router: `r<k>` on the bridge, `wan` in the router.
        _sh(
            ["ip", "link", "add", f"r{k}", "netns", lab.pub, "type", "veth"]
            + ["peer", "name", "wan", "netns", rtr]
        )
        ip(lab.pub, "link", "set", f"r{k}", "master", "br0")
        ip(lab.pub, "link", "set", f"r{k}", "up")
        ip(rtr, "addr", "add", f"{router_public_ip(k)}/{PUB_PREFIXLEN}", "dev", "wan")
        ip(rtr, "link", "set", "wan", "up")

        # router <-> LAN: `lan` in the router, `eth0` in the LAN.
        _sh(
            ["ip", "link", "add", "lan", "netns", rtr, "type", "veth"]
            + ["peer", "name", "eth0", "netns", lan]
        )
        ip(rtr, "addr", "add", f"{router_lan_ip(k)}/24", "dev", "lan")
        ip(rtr, "link", "set", "lan", "up")
        ip(lan, "addr", "add", f"{lan_host_ip(k)}/24", "dev", "eth0")
        ip(lan, "link", "set", "eth0", "up")
        ip(lan, "route", "add", "default", "via", router_lan_ip(k))

        sysctl(rtr, "net.ipv4.ip_forward=1")
        _sh(
            ["ip", "netns", "exec", rtr, "nft", "-f", "-"],
            input=_router_ruleset(f"192.168.{k}.0/24"),
        )


def _router_ruleset(lan_net: str) -> str:
    return f"""\
flush ruleset
table ip nat {{
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "wan" ip saddr {lan_net} masquerade
  }}
}}
table ip filter {{
  chain forward {{
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    ct state invalid drop
    iifname "lan" oifname "wan" ip saddr {lan_net} accept
  }}
}}
"""


def _delete_host_link(prefix: str) -> None:
    """The root side of `host_link` goes at once (with pub it would go only once the
    namespace is freed, which may be after the next lab wants the name)."""
    name = f"{prefix}-host"[:15]
    if Path(f"/sys/class/net/{name}").exists():
        subprocess.run([_tool("ip") or "ip", "link", "del", name], capture_output=True)


def _teardown(lab: NatLab, created: list[str]) -> list[str]:
    problems: list[str] = []
    try:
        lab._stop_procs()
    except Exception as e:  # keep going: namespaces must still go
        problems.append(f"stopping processes: {e}")
    _delete_host_link(lab.prefix)
    for ns in reversed(created):
        try:
            _delete_namespace(ns)
        except LabError as e:
            problems.append(str(e))
    try:
        left = [ns for ns in list_namespaces() if ns in created]
    except LabError as e:
        problems.append(str(e))
    else:
        if left:
            problems.append(f"namespaces still present after teardown: {left}")
    return problems


@contextlib.contextmanager
def nat_lab(prefix: str = "ps", host_link: bool = False) -> Iterator[NatLab]:
    """Build the lab (see the module docstring), yield it, and always tear it down.
    `host_link`: also plug the root namespace (the test process) into the public bridge
    as `HOST_IP`, so a test can talk to public hosts directly (one such lab at a time)."""
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"bad prefix {prefix!r}: want 1-20 of [A-Za-z0-9_.], letter/digit first")
    reason = available()
    if reason:
        raise LabError(f"cannot build a nat_lab here: {reason}")
    lab = NatLab(
        prefix=prefix,
        pub=f"{prefix}-pub",
        routers=[f"{prefix}-rtr{k}" for k in range(1, N_PRIVATE + 1)],
        lans=[f"{prefix}-lan{k}" for k in range(1, N_PRIVATE + 1)],
        host_link=host_link,
    )
    with _prefix_lock(prefix):
        own = _own_names(prefix)
        for ns in list_namespaces():
            if own.match(ns):
                _delete_namespace(ns)  # stale: we hold the prefix lock, so no live lab owns it
        _delete_host_link(prefix)
        created: list[str] = []
        ok = False
        try:
            _build(lab, created)
            yield lab
            ok = True
        finally:
            problems = _teardown(lab, created)
            if problems:
                msg = f"nat_lab({prefix!r}) teardown: " + "; ".join(problems)
                if ok:
                    raise LabError(msg)
                warnings.warn(msg, stacklevel=2)
