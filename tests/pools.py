"""Test helper: a real pool on loopback: a signed pool file, a `prime-scheduler serve`
process, `prime-node join` worker processes, and the trainer-side client.

Every process is a separate OS process managed by `protocol.processes.ManagedProcess`;
`Pool.close` stops them all (fixtures always call it).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from protocol.identity import Identity
from protocol.messages import (
    AdmissionPolicy,
    CheckerPolicy,
    PoolConfig,
    ReputationPolicy,
    RolloutResult,
    VerificationPolicy,
)
from protocol.processes import ManagedProcess, free_port
from protocol.scheduler_client import SchedulerClient
from scheduler.pool import make_api_key, write_pool
from scheduler.registry import NodeRecord
from verifier.models import resolve_model

REPO = Path(__file__).resolve().parent.parent
TINY_THRESHOLDS = REPO / "configs" / "verification" / "tiny-torch-cpu-fp32.toml"
# The machine's PostgreSQL (trust auth); tests create a database of their own on it.
POSTGRES_SERVER = "postgresql://postgres@127.0.0.1:5432"
# Heartbeats and node-state sweeps fast enough for short pool tests.
FAST_LIFECYCLE = (
    "--lifecycle.heartbeat-interval-s", "0.5",
    "--lifecycle.unhealthy-after-s", "3",
    "--lifecycle.dead-after-s", "6",
    "--lifecycle.check-interval-s", "0.5",
)  # fmt: skip


def tiny_verification() -> VerificationPolicy:
    import tomllib

    return VerificationPolicy(**tomllib.loads(TINY_THRESHOLDS.read_text())["verification"])


@dataclass
class Pool:
    workdir: Path
    pool_id: str
    owner: Identity
    trainer: Identity
    pool_file: Path
    db_url: str
    port: int = field(default_factory=free_port)
    scheduler: ManagedProcess | None = None
    nodes: dict[str, ManagedProcess] = field(default_factory=dict)
    scheduler_args: tuple[str, ...] = ()
    replica_ports: list[int] = field(default_factory=list)
    replicas: list[ManagedProcess] = field(default_factory=list)
    model: str = "tiny"
    scheduler_command: tuple[str, ...] = (sys.executable, "-m", "scheduler.cli")
    """How the scheduler is started (a test of the torch-free install runs its script)."""
    host: str = "127.0.0.1"
    """Where the scheduler listens and everyone reaches it (a NAT lab's public address)."""
    scheduler_wrap: tuple[str, ...] = ()
    """Prepended to the scheduler's command line (e.g. `ip netns exec <ns>`)."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def urls(self) -> str:
        """Every scheduler replica, as nodes and clients take them (comma-separated)."""
        ports = [self.port, *self.replica_ports]
        return ",".join(f"http://{self.host}:{p}" for p in ports)

    def client(self) -> SchedulerClient:
        return SchedulerClient(self.urls, self.trainer, self.pool_id)

    def api_key(self, name: str = "test", rate_per_s: float = 1000.0, burst: int = 1000) -> str:
        """A key to the scheduler's OpenAI endpoint, issued by the pool owner."""
        return make_api_key(self.owner, self.pool_id, name, 3600.0, rate_per_s, burst)

    @property
    def api_key_file(self) -> Path:
        """A file holding an orchestrator's key (written on first use)."""
        path = self.workdir / "orchestrator.apikey"
        if not path.exists():
            path.write_text(self.api_key("orchestrator"))
        return path

    def openai(self, **kw):
        """The official `openai` client on the pool's endpoint, with a fresh key."""
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key(), **kw)

    def start_scheduler(
        self, *args: str, log_name: str = "scheduler", port: int | None = None
    ) -> ManagedProcess:
        """Start (or restart) the scheduler; `port` starts a replica on another port."""
        self.scheduler_args = args or self.scheduler_args
        cmd = [
            *self.scheduler_wrap,
            *self.scheduler_command,
            "serve",
            "--server.host",
            self.host,
            "--pool-file",
            str(self.pool_file),
            "--key-file",
            str(self.workdir / "scheduler.key"),
            "--database.url",
            self.db_url,
            "--server.port",
            str(port or self.port),
            "--log-dir",
            str(self.workdir / "scheduler-logs"),
            "--openai.tokenizer",
            str(resolve_model(self.model)),
            *self.scheduler_args,
        ]
        child = ManagedProcess.start(
            log_name,
            cmd,
            f"http://{self.host}:{port or self.port}/health",
            self.workdir / f"{log_name}.log",
            cwd=REPO,
            timeout_s=60,
        )
        if port is None:
            self.scheduler = child
        else:
            self.replica_ports.append(port)
            self.replicas.append(child)
        return child

    def join(
        self,
        name: str,
        *args: str,
        operator: str = "",
        wait: bool = True,
        dishonest: str | None = None,
        wrap: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> ManagedProcess:
        """Start `prime-node join` on the tiny model (or a dishonest node of kind `dishonest`,
        see tests.adversaries.DISHONEST_WORKERS); wait until the scheduler sees it healthy.
        `wrap` is prepended to its command line (`ip netns exec <ns>`: then its own /health
        is out of this process's reach, and only the scheduler's view is waited for)."""
        key = self.workdir / f"{name}.key"
        Identity.load_or_create(key)
        port = free_port()
        entry = ["node.cli", "join"] if dishonest is None else ["tests.adversary_node", dishonest]
        cmd = [
            *wrap,
            sys.executable,
            "-m",
            *entry,
            "--pool",
            self.pool_id,
            "--scheduler",
            self.urls,
            "--key-file",
            str(key),
            "--log-dir",
            str(self.workdir / name),
            "--server.port",
            str(port),
            "--operator",
            operator or name,
            "--weights.folder",
            str(self.workdir / "weights"),
            *args,
        ]
        child = ManagedProcess.start(
            name,
            cmd,
            "" if wrap else f"http://127.0.0.1:{port}/health",
            self.workdir / f"{name}.log",
            cwd=REPO,
            env={"OMP_NUM_THREADS": "1", **(env or {})},
            wait=False,
        )
        self.nodes[name] = child
        if wait:
            self.wait_joined(name)
        return child

    def wait_joined(self, name: str, timeout_s: float = 180) -> None:
        if self.nodes[name].health_url:
            self.nodes[name].wait_healthy(timeout_s)
        self.wait_node_state(
            self.node_id(name), "healthy", 60 if self.nodes[name].health_url else timeout_s
        )

    def join_many(
        self, names: list[str], env: dict[str, str] | None = None, **dishonest: str
    ) -> None:
        """Start several nodes at once (start-up is mostly imports: overlap them); `env`
        is added to the environment of the dishonest ones."""
        for name in names:
            kind = dishonest.get(name)
            self.join(name, dishonest=kind, wait=False, env=env if kind else None)
        for name in names:
            self.wait_joined(name)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def state(self) -> dict:
        return httpx.get(f"{self.url}/v1/dashboard/state", timeout=10).json()

    def node_state(self, node_id: str) -> str | None:
        for n in self.state()["nodes"]:
            if n["node_id"] == node_id:
                return n["state"]
        return None

    def node_id(self, name: str) -> str:
        return Identity.load_or_create(self.workdir / f"{name}.key").node_id

    def wait_node_state(self, node_id: str, state: str, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.node_state(node_id) == state:
                return
            time.sleep(0.3)
        raise TimeoutError(f"node {node_id} not {state} after {timeout_s} s: {self.state()}")

    def close(self) -> None:
        for child in self.nodes.values():
            child.kill9()
        for child in [self.scheduler, *self.replicas]:
            if child is not None:
                child.stop()


def make_pool(
    workdir: Path,
    pool_id: str = "test",
    db_url: str | None = None,
    admission: AdmissionPolicy | None = None,
    reputation: ReputationPolicy | None = None,
    verification: VerificationPolicy | None = None,
    model: str = "tiny",
    async_level: int = 2,
    checkers: CheckerPolicy | None = None,
) -> Pool:
    workdir.mkdir(parents=True, exist_ok=True)
    owner = Identity.load_or_create(workdir / "owner.key")
    trainer = Identity.load_or_create(workdir / "trainer.key")
    config = PoolConfig(
        pool_id=pool_id,
        model=model,
        trainer_public_key=trainer.public_key,
        admission=admission or AdmissionPolicy(),
        verification=verification or tiny_verification(),
        reputation=reputation or ReputationPolicy(),
        checkers=checkers or CheckerPolicy(),
        async_level=async_level,
    )
    pool_file = write_pool(workdir / f"{pool_id}.pool", owner, config)
    url = db_url or f"sqlite+aiosqlite:///{workdir / 'scheduler.db'}"
    return Pool(workdir, pool_id, owner, trainer, pool_file, url, model=model)


def processes_with(*needles: str) -> dict[int, str]:
    """Live processes whose command line contains every one of `needles`: pid -> command
    line (arguments joined by spaces). For tests that kill one child of a launcher."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile
            continue
        if all(n in cmd for n in needles):
            found[int(entry.name)] = cmd
    return found


async def collect(
    client: SchedulerClient, expected: int, timeout_s: float, after: int = 0
) -> list[RolloutResult]:
    """Read the results stream until `expected` results arrived (or time runs out)."""
    out: list[RolloutResult] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(out) < expected and loop.time() < deadline:
        page = await client.results(after, limit=1000, wait_s=2.0)
        out.extend(page.results)
        after = page.last_seq
    return out


@contextlib.asynccontextmanager
async def postgres_database() -> AsyncIterator[str]:
    """A fresh PostgreSQL database on the machine's server (127.0.0.1:5432, trust auth),
    dropped afterwards; its own database, so concurrent test runs never share state."""
    import asyncpg

    name = f"prime_test_{secrets.token_hex(6)}"
    admin = await asyncpg.connect(f"{POSTGRES_SERVER}/postgres")
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield f"postgresql+asyncpg://{POSTGRES_SERVER.split('://', 1)[1]}/{name}"
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


def node_record(i: int = 1, **kw) -> NodeRecord:
    """A scheduler's in-memory record of node `n<i>`, healthy with its channel open (for
    unit tests of the registry and the lifecycle); `kw` overrides any field."""
    fields = dict(
        node_id=f"n{i}",
        public_key=bytes(32),
        operator=f"op{i}",
        address="127.0.0.1",
        engine="torch",
        model="tiny",
        capacity=4,
        state="healthy",
        reputation=1.0,
        weights_version=3,
        weights_hash="h",
        registered_at=0.0,
        last_seen=0.0,
        connected=True,
    )
    return NodeRecord(**{**fields, **kw})
