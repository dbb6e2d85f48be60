"""Test helper: start real `prime-node serve` processes on loopback and talk to them.

Each node is a separate OS process with its own key file and log; `stop()` kills it and
the fixture teardown always runs it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from protocol.identity import Identity

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class NodeProcess:
    name: str
    url: str
    identity: Identity
    proc: subprocess.Popen
    log_path: Path
    extra: list[str] = field(default_factory=list)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_node(workdir: Path, name: str, *args: str, timeout_s: float = 180) -> NodeProcess:
    """Start a node with `args` as config flags; wait until /health answers."""
    workdir.mkdir(parents=True, exist_ok=True)
    key = workdir / f"{name}.key"
    identity = Identity.load_or_create(key)
    port = free_port()
    log_path = workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "node.cli", "serve", "--server.port", str(port), "--key-file", str(key),
           "--log-dir", str(workdir / name), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)
    node = NodeProcess(name, f"http://127.0.0.1:{port}", identity, proc, log_path, list(args))
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"node {name} exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{node.url}/health", timeout=2).status_code == 200:
                return node
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    node.stop()
    raise TimeoutError(f"node {name} did not answer within {timeout_s} s:\n{log_path.read_text()[-3000:]}")
