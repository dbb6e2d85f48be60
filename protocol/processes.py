"""Child processes of a local deployment (demo, tests, local swarm): start, wait, stop.

One way to run any prime-swarm process as a child: `ManagedProcess.start` launches it with
its output in a log file, waits until its health URL answers, and `stop` ends it (SIGTERM,
then SIGKILL). Invariants: a child that exits during start-up raises with the tail of its
log; `stop` is idempotent and never leaves a zombie; on Linux a child gets SIGTERM when
its parent dies, so a killed test run or launcher leaves no orphans.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """This process gets SIGTERM when its parent dies, even by kill -9 (Linux; elsewhere
    children may outlive a killed parent). Runs in every `ManagedProcess` child before exec,
    and in each torchrun rank (its agent starts ranks in sessions of their own)."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        return
    if os.getppid() != parent:  # the parent died before the call: nobody will signal
        os.kill(os.getpid(), signal.SIGTERM)


# Ports handed out by this process, never handed out twice.
_GIVEN: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback TCP port that is free now, for a child to bind later. It is taken below
    the kernel's ephemeral range: a port from bind(0) lies inside it, where any outgoing
    connection or port-0 listener (libp2p, httpx) may take it before the child binds."""
    low, _ = _ephemeral_range()
    floor = max(1024, low - 12000)
    for _ in range(200):
        port = random.randrange(floor, low)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {floor}-{low}")


@dataclass
class ManagedProcess:
    name: str
    proc: subprocess.Popen
    log_path: Path
    health_url: str

    @classmethod
    def start(
        cls,
        name: str,
        cmd: list[str],
        health_url: str,
        log_path: Path,
        *,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 180,
        wait: bool = True,
    ) -> ManagedProcess:
        """Launch `cmd`; with `wait`, return once `health_url` answers.

        Launch from a long-lived thread: on Linux the child's parent-death signal fires
        when the launching *thread* exits, not only the process.
        """
        log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                preexec_fn=die_with_parent,
            )
        child = cls(name, proc, log_path, health_url)
        if wait:
            child.wait_healthy(timeout_s)
        return child

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.health_url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(
            f"{self.name} did not answer {self.health_url} within {timeout_s} s:\n{self.log_tail()}"
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, grace_s: float = 10) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
