"""Test helper: start real `prime-node serve` processes on loopback.

Each node is a separate OS process with its own key file and log, managed by
`protocol.processes.ManagedProcess`; fixtures always stop it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from protocol.identity import Identity
from protocol.processes import ManagedProcess, free_port

REPO = Path(__file__).resolve().parent.parent


@dataclass
class NodeProcess:
    name: str
    url: str
    identity: Identity
    child: ManagedProcess

    @property
    def log_path(self) -> Path:
        return self.child.log_path

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def alive(self) -> bool:
        return self.child.alive()

    def stop(self) -> None:
        self.child.stop()


def node_command(port: int, key: Path, log_dir: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "node.cli",
        "serve",
        "--server.port",
        str(port),
        "--key-file",
        str(key),
        "--log-dir",
        str(log_dir),
        *args,
    ]


def start_node(workdir: Path, name: str, *args: str, timeout_s: float = 180) -> NodeProcess:
    """Start a node with `args` as config flags; wait until /health answers."""
    workdir.mkdir(parents=True, exist_ok=True)
    key = workdir / f"{name}.key"
    identity = Identity.load_or_create(key)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # One thread per node: several nodes share this machine's two cores.
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    child = ManagedProcess.start(
        name,
        node_command(port, key, workdir / name, *args),
        f"{url}/health",
        workdir / f"{name}.log",
        cwd=REPO,
        env=env,
        timeout_s=timeout_s,
    )
    return NodeProcess(name, url, identity, child)
