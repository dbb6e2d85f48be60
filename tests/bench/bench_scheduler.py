#!/usr/bin/env python
"""Scheduler benchmark: dispatch rate and latency at 1,000 nodes, memory, overhead, and
how fast the pool is whole again after a scheduler restart.

Starts real processes on loopback (`protocol.processes.ManagedProcess`): a scheduler
(`python -m scheduler.cli serve`, SQLite, its pool made with `scheduler.cli pool create`)
and ONE load-test nodes process (tests/bench/loadtest_nodes.py: `--nodes` fake workers
with an instant engine that verifies nothing, each with its own key, heartbeating every
`--heartbeat-s`). Each fake node opens its own node channel, the WebSocket at
/v1/nodes/connect (`protocol.channel`): the scheduler never dials a node, every call it
makes to one (generate, verify) goes over that node's channel and is answered in the
load-test process. This process is the orchestrator: it holds the pool's trainer key.

1. Idle, all nodes heartbeating with their channels open (both ends ping every
   `--channel-ping-s`): scheduler RSS and CPU at N connected nodes, heartbeat latency (the
   load-test process measures it), node states as the scheduler reports them.
2. Overhead: the same small `RolloutRequest`, sequentially, `--overhead-n` times each,
   interleaved: sent directly to one load-test node over HTTP (signed by the scheduler's
   own key, which the nodes trust; the node's own cost, not the scheduler's path), directly
   to one node and then verified by a second one (the same work the scheduler does for a
   request, without it), and through the scheduler (`SubmitRollouts` of one request, its
   calls over the nodes' channels, then `ResultsQuery` long-polls until it is released).
   Ratios of medians: through / direct, through / (direct + verify).
3. Rate steps: `SubmitRollouts` at a fixed offered rate R (a batch every `--batch-ms`),
   `--warmup-s` then `--measure-s`, while one long-poll loop reads the results stream.
   Per request the end-to-end latency is measured here (batch sent -> page with its result
   received: queue, dispatch, generation, verification, DB commit, release, long-poll).
   The scheduler's `prime_scheduler_dispatch_latency_seconds` histogram (submit -> sent to
   a generator) is scraped from /metrics before and after the measured window; p50/p99
   come from the bucket deltas (linear inside a bucket, as Prometheus's
   histogram_quantile). A step is *sustained* when the measured window's releases reach
   95% of R, every request of the window is released (within `--drain-s`) with status
   accepted, and no submission was refused (503/429). The headline: the highest sustained
   R whose dispatch p99 (the scheduler's histogram; end-to-end when absent) is < 50 ms.
   Steps stop after two unsustained ones in a row.
4. Memory: scheduler RSS (psutil, children included) idle at N connected nodes and peak
   under load. CPU % of each process per step (2 cores = 200%): on this box the scheduler,
   the nodes process and this orchestrator share the cores, so read the rates as a floor.
5. Restart (`--restarts` times, after the steps): kill -9 the scheduler, start it again at
   once on the same database, key and port, and time from the restart's start until the
   pool is whole again: the scheduler's /health reports N healthy nodes AND the load-test
   process reports all N channels open (it counts a channel open once its hello is sent
   and the scheduler has not closed it). Both are needed: a scheduler reloads the nodes'
   last state from its database, so its /health alone may say "healthy" before a single
   channel is back (`healthy_at_first_health` records what it said first). The time
   includes the scheduler's start-up and the nodes' reconnect backoff (0.25 s doubling, as
   a real node's). Then a batch of requests must all come back accepted (the channels
   carry calls again).

How to read it: absolute rates belong to this shared 2-core machine; the overhead ratio is
measured side by side in one run and carries over better. Rate limits are lifted for the
benchmark (loopback is exempt from the per-address limit): it protects a public scheduler,
and 1,000 nodes behind one address would trip it by design.

Outputs: rich tables, tests/bench/results/scheduler_cpu.json and .png (stem: --out).

    python tests/bench/bench_scheduler.py                       # 1,000 nodes, full steps
    python tests/bench/bench_scheduler.py --quick --out /tmp/s  # 100 nodes, two short steps
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
if str(REPO_ROOT) not in sys.path:  # runs from a checkout, installed or not
    sys.path.insert(0, str(REPO_ROOT))

import aiohttp  # noqa: E402
import psutil  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from protocol.client import RemoteError, call  # noqa: E402
from protocol.envelope import open_envelope  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from protocol.messages import (  # noqa: E402
    PoolConfig,
    ResultsPage,
    ResultsQuery,
    Rollout,
    RolloutRequest,
    RolloutSpec,
    SamplingParams,
    SubmitAck,
    SubmitRollouts,
    Verdict,
    VerifyRequest,
)
from protocol.processes import ManagedProcess, free_port  # noqa: E402

RESULTS_DIR = HERE / "results"
LOADTEST = HERE / "loadtest_nodes.py"
P99_TARGET_S = 0.050
RATE_TARGET = 500.0
RSS_TARGET_BYTES = 300 * 2**20
DISPATCH_METRIC = "prime_scheduler_dispatch_latency_seconds"
E2E_METRIC = "prime_scheduler_end_to_end_seconds"
VERSIONS_OF = ("aiohttp", "pydantic", "cryptography", "sqlalchemy", "aiosqlite")
PROMPT = list(range(10, 26))  # 16 prompt tokens
SAMPLING = SamplingParams(temperature=1.0, max_tokens=8)
console = Console(width=None if sys.stdout.isatty() else 160)


# --- Processes -------------------------------------------------------------------------
@dataclass
class Deployment:
    """The scheduler and load-test node processes of one run, the trainer identity, and the
    scheduler's own key (read from its key file: the direct calls of the overhead test)."""

    workdir: Path
    trainer: Identity
    scheduler_key: Identity
    scheduler: ManagedProcess
    scheduler_url: str
    nodes: ManagedProcess
    nodes_url: str
    pool: PoolConfig
    scheduler_cmd: list[str] = field(default_factory=list)  # to start it again (a restart)

    def stop(self) -> None:
        self.nodes.stop()
        self.scheduler.stop()


def _run(cmd: list[str], what: str) -> str:
    res = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"{what} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res.stdout


def create_pool(workdir: Path, args: argparse.Namespace) -> tuple[Path, Identity]:
    """`scheduler.cli pool create`: an open pool whose trainer key this process holds."""
    owner_key, trainer_key = workdir / "owner.key", workdir / "trainer.key"
    trainer = Identity.load_or_create(trainer_key)
    Identity.load_or_create(owner_key)
    pool_file = workdir / "pool.msgpack"
    _run(
        [
            sys.executable,
            "-m",
            "scheduler.cli",
            "pool",
            "create",
            "--pool-id",
            "bench",
            "--model",
            args.model,
            "--owner-key",
            str(owner_key),
            "--trainer",
            str(trainer_key),
            "--out",
            str(pool_file),
            # The load-test nodes' engine: thresholds matter nothing to them.
            "--verification.engine-mixes",
            '[{"engine": "loadtest", "dtype": "float32", "device": "cpu"}]',
        ],
        "scheduler.cli pool create",
    )
    return pool_file, trainer


def raise_fd_limit() -> None:
    """N channels are N sockets in the scheduler: lift the soft open-files limit to the hard
    one here, before the children start (they inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def start_deployment(workdir: Path, args: argparse.Namespace) -> Deployment:
    pool_file, trainer = create_pool(workdir, args)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    console.print(f"starting the scheduler on {url}")
    scheduler_cmd = [
        sys.executable,
        *(["-m", "cProfile", "-o", str(args.scheduler_profile)] if args.scheduler_profile else []),
        "-m",
        "scheduler.cli",
        "serve",
        "--pool-file",
        str(pool_file),
        "--key-file",
        str(workdir / "scheduler.key"),
        "--log-dir",
        str(workdir / "scheduler-logs"),
        "--database.url",
        f"sqlite+aiosqlite:///{workdir / 'scheduler.db'}",
        "--server.port",
        str(port),
        "--lifecycle.heartbeat_interval_s",
        str(args.heartbeat_s),
        "--lifecycle.unhealthy_after_s",
        str(args.heartbeat_s * 2.5),
        "--lifecycle.dead_after_s",
        str(args.heartbeat_s * 4.5),
        "--channel.ping_interval_s",
        str(args.channel_ping_s),
        "--rate_limits.exempt_addresses",
        '["127.0.0.1"]',
        *args.scheduler_arg,
    ]
    scheduler = ManagedProcess.start(
        "scheduler",
        scheduler_cmd,
        f"{url}/health",
        workdir / "scheduler.log",
        cwd=REPO_ROOT,
        env=dict(kv.split("=", 1) for kv in args.scheduler_env),
        timeout_s=120,
    )
    with urllib.request.urlopen(f"{url}/v1/pool", timeout=10) as resp:
        pool = open_envelope(resp.read(), PoolConfig, check_expiry=False).message
    nport = free_port()
    nodes_url = f"http://127.0.0.1:{nport}"
    console.print(
        f"starting {args.nodes} load-test nodes (HTTP for direct calls: {nodes_url}/n/<i>)"
    )
    t0 = time.perf_counter()
    try:
        nodes = ManagedProcess.start(
            "loadtest-nodes",
            [
                sys.executable,
                str(LOADTEST),
                "--scheduler",
                url,
                "--nodes",
                str(args.nodes),
                "--port",
                str(nport),
                "--heartbeat-s",
                str(args.heartbeat_s),
                "--channel-ping-s",
                str(args.channel_ping_s),
                "--completion-tokens",
                str(SAMPLING.max_tokens),
            ],
            f"{nodes_url}/ready",
            workdir / "loadtest-nodes.log",
            cwd=REPO_ROOT,
            timeout_s=600,
        )
    except BaseException:
        scheduler.stop()
        raise
    console.print(
        f"{args.nodes} nodes registered, channels open, in {time.perf_counter() - t0:.1f} s"
    )
    scheduler_key = Identity.load_or_create(workdir / "scheduler.key")
    return Deployment(
        workdir, trainer, scheduler_key, scheduler, url, nodes, nodes_url, pool, scheduler_cmd
    )


@dataclass
class TinyDeployment:
    """A second pool for the real-node overhead: its scheduler and two `prime-node join`
    processes on the tiny model (tests/pools.py), with real generation and verification."""

    pool: Any  # tests.pools.Pool
    scheduler_key: Identity
    node_urls: list[str]

    def stop(self) -> None:
        self.pool.close()


def start_tiny(workdir: Path) -> TinyDeployment:
    from tests.pools import make_pool

    pool = make_pool(workdir / "tiny", pool_id="bench-tiny")
    try:
        console.print("starting a scheduler and two tiny-model nodes (prime-node join)")
        pool.start_scheduler("--rate_limits.exempt_addresses", '["127.0.0.1"]')
        pool.join_many(["tiny-a", "tiny-b"])
    except BaseException:
        pool.close()
        raise
    urls = [pool.nodes[n].health_url.removesuffix("/health") for n in ("tiny-a", "tiny-b")]
    key = Identity.load_or_create(pool.workdir / "scheduler.key")
    return TinyDeployment(pool, key, urls)


async def bench_tiny(tiny: TinyDeployment, n: int) -> dict[str, Any]:
    pool = tiny.pool
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        orch = Orchestrator(pool.url, pool.trainer, pool.pool_id, session)
        poller = asyncio.create_task(orch.results_loop())
        try:
            console.print(f"overhead with tiny-model nodes: {n} sequential requests x 3 paths")
            out = await run_overhead(orch, tiny.scheduler_key, *tiny.node_urls, n)
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
    out["nodes"] = "2 x prime-node join, tiny model, torch engine on CPU (OMP_NUM_THREADS=1)"
    return out


# --- Resource sampling -----------------------------------------------------------------
def _tree(pid: int) -> list[psutil.Process]:
    """A child process and its own children; this process alone (its children are the
    scheduler and the nodes, counted apart)."""
    p = psutil.Process(pid)
    return [p] if pid == os.getpid() else [p, *p.children(recursive=True)]


def rss_bytes(pid: int) -> int:
    total = 0
    for p in _tree(pid):
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def cpu_seconds(pid: int) -> float:
    total = 0.0
    for p in _tree(pid):
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _machine_busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def _steal_s() -> float:
    return getattr(psutil.cpu_times(), "steal", 0.0)


class Sampler:
    """CPU seconds and peak RSS of the three processes over a window, and the CPU time of
    everything else on the machine ("others": other tenants of a shared box)."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.cpu0: dict[str, float] = {}
        self.busy0 = self.steal0 = 0.0
        self.t0 = 0.0
        self.peak_rss: dict[str, int] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.cpu0 = {k: cpu_seconds(p) for k, p in self.pids.items()}
        self.busy0, self.steal0 = _machine_busy_s(), _steal_s()
        self.peak_rss = {k: rss_bytes(p) for k, p in self.pids.items()}
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            for k, p in self.pids.items():
                self.peak_rss[k] = max(self.peak_rss[k], rss_bytes(p))

    async def stop(self) -> dict[str, Any]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        dt = time.perf_counter() - self.t0
        cpu = {k: 100 * (cpu_seconds(p) - self.cpu0[k]) / dt for k, p in self.pids.items()}
        machine = 100 * (_machine_busy_s() - self.busy0) / dt
        cpu["others"] = max(0.0, machine - sum(cpu.values()))
        return {
            "seconds": dt,
            "cpu_percent": cpu,
            "machine_cpu_percent": machine,
            "steal_percent": 100 * (_steal_s() - self.steal0) / dt,
            "peak_rss_bytes": dict(self.peak_rss),
            "rss_bytes": {k: rss_bytes(p) for k, p in self.pids.items()},
        }


# --- Prometheus histogram --------------------------------------------------------------
def parse_histogram(text: str, name: str) -> dict[float, float] | None:
    """Cumulative bucket counts {le: count} of histogram `name` (summed over labels)."""
    buckets: dict[float, float] = {}
    prefix = name + "_bucket{"
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        labels, _, value = line[len(prefix) :].rpartition("} ")
        le = next(
            (p.split("=", 1)[1].strip('"') for p in labels.split(",") if p.startswith("le=")),
            None,
        )
        if le is None:
            continue
        bound = float("inf") if le == "+Inf" else float(le)
        buckets[bound] = buckets.get(bound, 0.0) + float(value.split()[0])
    return buckets or None


def histogram_quantile(
    before: dict[float, float] | None, after: dict[float, float] | None, q: float
) -> float | None:
    """q-quantile of the observations between two scrapes (Prometheus interpolation)."""
    if not after:
        return None
    bounds = sorted(after)
    counts = [after[b] - (before or {}).get(b, 0.0) for b in bounds]
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for b, c in zip(bounds, counts, strict=True):
        if c >= rank:
            if b == float("inf"):
                return prev_bound  # beyond the last finite bucket: its bound is a floor
            width = c - prev_count
            return prev_bound + (b - prev_bound) * ((rank - prev_count) / width if width else 1)
        prev_bound, prev_count = b, c
    return prev_bound


def histogram_count(before: dict[float, float] | None, after: dict[float, float] | None) -> int:
    if not after:
        return 0
    top = max(after)
    return int(after[top] - (before or {}).get(top, 0.0))


# --- Orchestrator ----------------------------------------------------------------------
def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 10) - 1]


@dataclass
class Released:
    t: float
    status: str


@dataclass
class StepResult:
    offered_rate: float
    warmup_s: float
    measure_s: float
    submitted: int = 0  # requests accepted by the scheduler in the measured window
    refused: int = 0  # requests in batches answered 503/429/other errors (whole step)
    refused_statuses: dict[str, int] = field(default_factory=dict)
    released_in_window: int = 0  # results released during the measured window (any step)
    achieved_rate: float = 0.0  # released_in_window / measure_s
    window_released: int = 0  # measured-window requests released by the end of the drain
    window_not_accepted: int = 0  # of those, status other than accepted
    window_missing: int = 0  # measured-window requests never released within --drain-s
    e2e_p50_s: float | None = None
    e2e_p99_s: float | None = None
    e2e_max_s: float | None = None
    submit_p50_s: float | None = None  # SubmitRollouts round trip (the batch's POST)
    submit_p99_s: float | None = None
    dispatch_count: int = 0
    dispatch_p50_s: float | None = None  # scheduler histogram (bucket interpolation)
    dispatch_p99_s: float | None = None
    dispatch_p99_censored: bool = False  # beyond the histogram's last finite bucket: a floor
    sched_e2e_p50_s: float | None = None  # scheduler's own submit -> released histogram
    sched_e2e_p99_s: float | None = None
    resources: dict[str, Any] = field(default_factory=dict)
    sustained: bool = False
    p99_for_target_s: float | None = None  # dispatch p99 (scheduler) or e2e p99 if absent
    meets_target: bool = False


class Orchestrator:
    """The trainer side: submits with the trainer key and reads the results stream."""

    def __init__(self, url: str, trainer: Identity, pool_id: str, session: aiohttp.ClientSession):
        self.url = url
        self.trainer = trainer
        self.pool_id = pool_id
        self.session = session
        self.cursor = 0
        self.released: dict[str, Released] = {}
        self.waiters: dict[str, asyncio.Future] = {}
        self.poll_errors = 0

    async def submit(self, specs: list[RolloutSpec]) -> SubmitAck:
        msg = SubmitRollouts(pool_id=self.pool_id, requests=specs)
        opened, _ = await call(
            self.session, f"{self.url}/v1/rollouts/submit", self.trainer, msg, SubmitAck
        )
        return opened.message

    async def results_loop(self) -> None:
        """Long-poll the results stream forever, stamping each release on arrival."""
        while True:
            try:
                opened, _ = await call(
                    self.session,
                    f"{self.url}/v1/rollouts/results",
                    self.trainer,
                    ResultsQuery(after=self.cursor, limit=10_000, wait_s=2.0),
                    ResultsPage,
                )
            except (TimeoutError, RemoteError, aiohttp.ClientError, OSError):
                self.poll_errors += 1
                await asyncio.sleep(0.05)
                continue
            now = time.perf_counter()
            page = opened.message
            for r in page.results:
                self.released[r.request_id] = Released(now, r.status)
                fut = self.waiters.pop(r.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(r.status)
            self.cursor = max(self.cursor, page.last_seq)

    async def metrics_text(self) -> str:
        async with self.session.get(f"{self.url}/metrics") as resp:
            return await resp.text() if resp.status == 200 else ""

    async def through(self, request_id: str, timeout_s: float = 60) -> float:
        """One request through the scheduler: submit, wait for its release; seconds."""
        fut = asyncio.get_running_loop().create_future()
        self.waiters[request_id] = fut
        t0 = time.perf_counter()
        await self.submit(
            [RolloutSpec(request_id=request_id, prompt_ids=PROMPT, sampling=SAMPLING)]
        )
        status = await asyncio.wait_for(fut, timeout_s)
        dt = time.perf_counter() - t0
        if status != "accepted":
            raise RuntimeError(f"{request_id} released as {status}")
        return dt


async def run_overhead(
    orch: Orchestrator, scheduler_key: Identity, gen_url: str, ver_url: str, n: int
) -> dict[str, Any]:
    """Direct to one node, direct + verify on a second, and through the scheduler.

    The direct calls are signed with the scheduler's own key (a node in a pool takes work
    only from the scheduler that admitted it), so the nodes see the very same messages."""
    s = orch.session
    times: dict[str, list[float]] = {"direct": [], "direct_verify": [], "through": []}

    def request(i: int, kind: str) -> RolloutRequest:
        return RolloutRequest(
            request_id=f"ovh-{kind}-{i}",
            pool_id=orch.pool_id,
            prompt_ids=PROMPT,
            sampling=SAMPLING,
            seed=i,
        )

    async def direct(i: int) -> float:
        t0 = time.perf_counter()
        req = request(i, "d")
        opened, _ = await call(s, f"{gen_url}/v1/rollouts", scheduler_key, req, Rollout)
        assert opened.message.request_id == req.request_id
        return time.perf_counter() - t0

    async def direct_verify(i: int) -> float:
        t0 = time.perf_counter()
        req = request(i, "dv")
        rollout, raw = await call(s, f"{gen_url}/v1/rollouts", scheduler_key, req, Rollout)
        vreq = VerifyRequest(
            rollout_envelope=raw,
            expected_weights_hash=rollout.message.weights_hash,
            request=req,
        )
        verdict, _ = await call(s, f"{ver_url}/v1/verify", scheduler_key, vreq, Verdict)
        if not verdict.message.accepted:
            raise RuntimeError(f"direct verification rejected: {verdict.message.reasons}")
        return time.perf_counter() - t0

    warm = max(3, n // 10)
    tag = uuid.uuid4().hex[:6]
    for i in range(-warm, n):
        order = [("direct", direct), ("direct_verify", direct_verify), ("through", None)]
        if i % 2:
            order.reverse()  # alternate the order: drifts hit all three alike
        for kind, fn in order:
            k = i + warm
            dt = await (orch.through(f"ovh-t-{tag}-{k}") if fn is None else fn(k))
            if i >= 0:
                times[kind].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "n": n,
        "median_s": med,
        "p90_s": {k: pct(v, 90) for k, v in times.items()},
        "ratio_through_over_direct": med["through"] / med["direct"],
        "ratio_through_over_direct_verify": med["through"] / med["direct_verify"],
    }


async def run_step(
    orch: Orchestrator,
    index: int,
    rate: float,
    args: argparse.Namespace,
    pids: dict[str, int],
) -> StepResult:
    res = StepResult(offered_rate=rate, warmup_s=args.warmup_s, measure_s=args.measure_s)
    sent_at: dict[str, float] = {}
    submit_rtts: list[tuple[float, float]] = []  # (sent at, round trip)
    tasks: set[asyncio.Task] = set()
    refused: dict[str, int] = {}

    async def send(specs: list[RolloutSpec], t: float) -> None:
        try:
            await orch.submit(specs)
        except RemoteError as exc:
            refused[str(exc.status)] = refused.get(str(exc.status), 0) + len(specs)
            for s in specs:
                sent_at.pop(s.request_id, None)
            return
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            key = type(exc).__name__
            refused[key] = refused.get(key, 0) + len(specs)
            for s in specs:
                sent_at.pop(s.request_id, None)
            return
        submit_rtts.append((t, time.perf_counter() - t))

    gap = args.batch_ms / 1000
    t0 = time.perf_counter()
    t_measure, t_end = t0 + args.warmup_s, t0 + args.warmup_s + args.measure_s
    sampler = Sampler(pids)
    metrics_before: str | None = None
    sent = 0
    while (now := time.perf_counter()) < t_end:
        if metrics_before is None and now >= t_measure:
            metrics_before = await orch.metrics_text()
            sampler.start()
            released_before = len(orch.released)
        due = int((now - t0) * rate)
        if due > sent:
            specs = [
                RolloutSpec(request_id=f"s{index}-{k}", prompt_ids=PROMPT, sampling=SAMPLING)
                for k in range(sent, due)
            ]
            for sp in specs:
                sent_at[sp.request_id] = now
            sent = due
            task = asyncio.create_task(send(specs, now))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.sleep(max(0.0, gap - (time.perf_counter() - now)))
    metrics_after = await orch.metrics_text()
    res.released_in_window = len(orch.released) - released_before
    res.resources = await sampler.stop()
    res.achieved_rate = res.released_in_window / args.measure_s
    # Drain: wait for the measured window's requests (and the in-flight submits).
    if tasks:
        await asyncio.wait(tasks, timeout=args.drain_s)
    window = {rid: t for rid, t in sent_at.items() if t_measure <= t < t_end}
    deadline = time.perf_counter() + args.drain_s
    while time.perf_counter() < deadline and any(r not in orch.released for r in window):
        await asyncio.sleep(0.1)
    lat, statuses = [], []
    for rid, t in window.items():
        rel = orch.released.get(rid)
        if rel is None:
            res.window_missing += 1
            continue
        lat.append(rel.t - t)
        statuses.append(rel.status)
    lat.sort()
    res.submitted = len(window)
    res.window_released = len(lat)
    res.window_not_accepted = sum(s != "accepted" for s in statuses)
    res.refused = sum(refused.values())
    res.refused_statuses = refused
    res.e2e_p50_s, res.e2e_p99_s = pct(lat, 50), pct(lat, 99)
    res.e2e_max_s = lat[-1] if lat else None
    rtts = sorted(d for t, d in submit_rtts if t_measure <= t < t_end)
    res.submit_p50_s, res.submit_p99_s = pct(rtts, 50), pct(rtts, 99)
    hb = parse_histogram(metrics_before or "", DISPATCH_METRIC)
    ha = parse_histogram(metrics_after, DISPATCH_METRIC)
    res.dispatch_count = histogram_count(hb, ha)
    res.dispatch_p50_s = histogram_quantile(hb, ha, 0.5)
    res.dispatch_p99_s = histogram_quantile(hb, ha, 0.99)
    finite = [b for b in (ha or {}) if b != float("inf")]
    res.dispatch_p99_censored = bool(
        finite and res.dispatch_p99_s is not None and res.dispatch_p99_s >= max(finite)
    )
    eb, ea = (
        parse_histogram(metrics_before or "", E2E_METRIC),
        parse_histogram(metrics_after, E2E_METRIC),
    )
    res.sched_e2e_p50_s = histogram_quantile(eb, ea, 0.5)
    res.sched_e2e_p99_s = histogram_quantile(eb, ea, 0.99)
    res.sustained = (
        res.achieved_rate >= 0.95 * rate
        and res.window_missing == 0
        and res.window_not_accepted == 0
        and res.refused == 0
        and res.submitted > 0
    )
    res.p99_for_target_s = res.dispatch_p99_s if res.dispatch_p99_s is not None else res.e2e_p99_s
    res.meets_target = res.sustained and (
        res.p99_for_target_s is not None and res.p99_for_target_s < P99_TARGET_S
    )
    return res


async def scheduler_health(orch: Orchestrator) -> dict[str, Any]:
    async with orch.session.get(f"{orch.url}/health") as resp:
        return await resp.json()


async def loadtest_stats(dep: Deployment, session: aiohttp.ClientSession) -> dict[str, Any]:
    async with session.get(f"{dep.nodes_url}/stats") as resp:
        return await resp.json()


async def wait_all_healthy(orch: Orchestrator, n: int, timeout_s: float) -> dict[str, Any]:
    deadline = time.perf_counter() + timeout_s
    health: dict[str, Any] = {}
    while time.perf_counter() < deadline:
        health = await scheduler_health(orch)
        if health.get("nodes", {}).get("healthy", 0) >= n:
            return health
        await asyncio.sleep(0.5)
    console.print(f"[yellow]not all nodes healthy after {timeout_s:.0f} s: {health}[/yellow]")
    return health


async def _get_json(session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    """GET `url` as JSON; None when it does not answer 200 (a scheduler still starting)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
            return await resp.json() if resp.status == 200 else None
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return None


async def stop_task(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def measure_restart(
    dep: Deployment, cursor: int, args: argparse.Namespace, k: int
) -> tuple[dict[str, Any], int]:
    """kill -9 the scheduler, start it again on the same database, key and port; time until
    /health reports N healthy nodes AND the load-test process has all N channels open (see
    the module docstring, step 5), then check that a batch of requests is served. Returns
    the figures and the results cursor after the check."""
    n = args.nodes
    url = dep.scheduler_url
    # A fresh session: the pooled connections to the killed process are dead.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        before = await loadtest_stats(dep, session)
        old_pid = dep.scheduler.proc.pid
        console.print(f"restart {k + 1}/{args.restarts}: kill -9 the scheduler (pid {old_pid})")
        dep.scheduler.kill9()
        t0 = time.perf_counter()
        dep.scheduler = ManagedProcess.start(
            "scheduler",
            dep.scheduler_cmd,
            f"{url}/health",
            dep.workdir / f"scheduler-restart{k + 1}.log",
            cwd=REPO_ROOT,
            env=dict(kv.split("=", 1) for kv in args.scheduler_env),
            wait=False,
        )
        up = healthy_at = channels_at = whole_at = None
        first_health: dict[str, Any] | None = None
        channels_at_first_health = None
        dropped = False  # the nodes saw their channels close (the kill reached them)
        timeline: list[tuple[float, int | None, int | None]] = []
        deadline = t0 + args.restart_timeout_s
        while time.perf_counter() < deadline:
            health, stats = await asyncio.gather(
                _get_json(session, f"{url}/health"), _get_json(session, f"{dep.nodes_url}/stats")
            )
            now = time.perf_counter() - t0
            healthy = (health or {}).get("nodes", {}).get("healthy", 0) if health else None
            channels = stats["channels_open"] if stats else None
            timeline.append((now, healthy, channels))
            if channels is not None and channels < n:
                dropped = True
            if health is not None and health.get("status") == "ok" and up is None:
                up, first_health, channels_at_first_health = now, health, channels
            if up is not None and healthy is not None and healthy >= n and healthy_at is None:
                healthy_at = now
            if dropped and channels is not None and channels >= n and channels_at is None:
                channels_at = now
            if up is not None and dropped and (healthy or 0) >= n and (channels or 0) >= n:
                whole_at = now
                break
            if dep.scheduler.proc.poll() is not None:
                raise RuntimeError(f"the restarted scheduler exited:\n{dep.scheduler.log_tail()}")
            await asyncio.sleep(args.restart_poll_s)
        if whole_at is None:
            console.print(
                f"[yellow]  not whole {args.restart_timeout_s:.0f} s after the restart: "
                f"{timeline[-1] if timeline else None}[/yellow]"
            )
        await asyncio.sleep(1.0)
        health1, stats1 = await asyncio.gather(
            _get_json(session, f"{url}/health"), _get_json(session, f"{dep.nodes_url}/stats")
        )
        stable = bool(
            health1
            and stats1
            and health1.get("nodes", {}).get("healthy", 0) >= n
            and stats1["channels_open"] >= n
        )
        rss_after = rss_bytes(dep.scheduler.proc.pid)
        # The channels carry calls again: a batch through the restarted scheduler.
        orch = Orchestrator(url, dep.trainer, dep.pool.pool_id, session)
        orch.cursor = cursor
        poller = asyncio.create_task(orch.results_loop())
        check: dict[str, Any] = {"n": args.restart_check_n}
        try:
            ids = [f"restart{k}-{i}" for i in range(args.restart_check_n)]
            t1 = time.perf_counter()
            if ids:
                await orch.submit(
                    [RolloutSpec(request_id=r, prompt_ids=PROMPT, sampling=SAMPLING) for r in ids]
                )
            check_deadline = t1 + args.drain_s
            while time.perf_counter() < check_deadline and any(r not in orch.released for r in ids):
                await asyncio.sleep(0.05)
            check["released"] = sum(r in orch.released for r in ids)
            check["accepted"] = sum(
                orch.released[r].status == "accepted" for r in ids if r in orch.released
            )
            check["seconds"] = time.perf_counter() - t1
        finally:
            await stop_task(poller)
        after = await loadtest_stats(dep, session)
    out = {
        "nodes": n,
        "old_pid": old_pid,
        "new_pid": dep.scheduler.proc.pid,
        "scheduler_up_s": up,
        "all_channels_open_s": channels_at,
        "health_all_healthy_s": healthy_at,
        "recovery_s": whole_at,
        "whole_and_stable_1s_later": stable,
        "healthy_at_first_health": None
        if first_health is None
        else first_health.get("nodes", {}).get("healthy", 0),
        "channels_open_at_first_health": channels_at_first_health,
        "scheduler_rss_after_bytes": rss_after,
        "check": check,
        "channel_closes": {
            code: c - before["channel_closes"].get(code, 0)
            for code, c in after["channel_closes"].items()
            if c != before["channel_closes"].get(code, 0)
        },
        "channel_opens": after["channel_opens"] - before["channel_opens"],
        "reregistered": after["reregistered"] - before["reregistered"],
        "timeline": [[round(t, 3), h, c] for t, h, c in timeline],
    }
    console.print(
        f"  scheduler up {_s(up)}, all {n} channels open {_s(channels_at)}, /health {n} healthy "
        f"{_s(healthy_at)}: whole again {_s(whole_at)} after the restart's start "
        f"(first /health said {out['healthy_at_first_health']} healthy with "
        f"{channels_at_first_health} channels open); check batch: "
        f"{check.get('accepted')}/{check['n']} accepted"
    )
    return out, orch.cursor


async def bench(dep: Deployment, args: argparse.Namespace) -> dict[str, Any]:
    pids = {"scheduler": dep.scheduler.proc.pid, "nodes": dep.nodes.proc.pid, "bench": os.getpid()}
    connector = aiohttp.TCPConnector(limit=256)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        orch = Orchestrator(dep.scheduler_url, dep.trainer, dep.pool.pool_id, session)
        poller = asyncio.create_task(orch.results_loop())
        try:
            health = await wait_all_healthy(orch, args.nodes, timeout_s=args.heartbeat_s * 2 + 30)
            console.print(f"scheduler health: {health.get('nodes')}")
            console.print(f"idle for {args.idle_s:.0f} s: {args.nodes} nodes heartbeating")
            sampler = Sampler(pids)
            sampler.start()
            await asyncio.sleep(args.idle_s)
            idle = await sampler.stop()
            idle["heartbeats"] = await loadtest_stats(dep, session)
            idle["scheduler_health"] = await scheduler_health(orch)
            idle["scheduler_rss_bytes"] = idle["rss_bytes"]["scheduler"]
            idle["channels_open"] = idle["heartbeats"]["channels_open"]
            if idle["channels_open"] < args.nodes:
                console.print(
                    f"[yellow]only {idle['channels_open']} of {args.nodes} channels open "
                    "while idle[/yellow]"
                )

            overhead = None
            if args.overhead_n > 0:
                console.print(f"overhead: {args.overhead_n} sequential requests x 3 paths")
                n0, n1 = f"{dep.nodes_url}/n/0", f"{dep.nodes_url}/n/1"
                overhead = await run_overhead(orch, dep.scheduler_key, n0, n1, args.overhead_n)

            steps: list[StepResult] = []
            misses = 0
            for i, rate in enumerate(args.rates):
                console.print(
                    f"step {i + 1}/{len(args.rates)}: {rate:.0f} req/s "
                    f"({args.warmup_s:.0f} s warm-up + {args.measure_s:.0f} s)"
                )
                st = await run_step(orch, i, rate, args, pids)
                steps.append(st)
                p99 = st.p99_for_target_s
                console.print(
                    f"  achieved {st.achieved_rate:.0f}/s, e2e p99 "
                    f"{_ms(st.e2e_p99_s)}, dispatch p99 {_ms(st.dispatch_p99_s)}, "
                    f"sched CPU {st.resources['cpu_percent']['scheduler']:.0f}%"
                    + ("" if st.sustained else "  [red]not sustained[/red]")
                )
                misses = 0 if st.sustained else misses + 1
                if misses >= 2 or (p99 is not None and p99 > args.give_up_p99_s):
                    console.print("  stopping: the scheduler no longer keeps up")
                    break
                await asyncio.sleep(args.pause_s)
            final_stats = await loadtest_stats(dep, session)
            final_health = await scheduler_health(orch)
        finally:
            await stop_task(poller)
        restarts = []
        for k in range(args.restarts):
            figures, orch.cursor = await measure_restart(dep, orch.cursor, args, k)
            restarts.append(figures)
    return {
        "idle": idle,
        "overhead": overhead,
        "steps": [asdict(s) for s in steps],
        "loadtest_stats_end": final_stats,
        "scheduler_health_end": final_health,
        "results_poll_errors": orch.poll_errors,
        "restarts": restarts,
    }


# --- Reporting -------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{1000 * x:.1f} ms"


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def _mib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:.0f} MiB"


PROCS = ("scheduler", "nodes", "bench")


def add_cpu_per_request(report: dict[str, Any]) -> None:
    """Per step and process: CPU ms per released request, over the idle (heartbeat) CPU.

    Other tenants of a shared box take cores away but hardly change the CPU a request
    costs, so this carries over where the rates do not."""
    idle = report["idle"]["cpu_percent"]
    for st in report["steps"]:
        cpu, rate = st["resources"]["cpu_percent"], st["achieved_rate"]
        st["cpu_ms_per_request"] = {
            k: max(0.0, cpu[k] - idle[k]) * 10 / rate if rate > 0 else None for k in PROCS
        }


def cpu_capacity(report: dict[str, Any]) -> dict[str, Any]:
    """Scheduler CPU ms per request (median over sustained steps, else the first step) and
    the rate that would fill one core beside the idle load: its event loop is one thread."""
    steps = report["steps"]
    basis = [s for s in steps if s["sustained"]] or steps[:1]
    if not basis:
        return {}
    out: dict[str, Any] = {"basis_rates": [s["offered_rate"] for s in basis]}
    for k in PROCS:
        vals = [s["cpu_ms_per_request"][k] for s in basis if s["cpu_ms_per_request"][k]]
        out[f"{k}_cpu_ms_per_request"] = statistics.median(vals) if vals else None
    ms = out["scheduler_cpu_ms_per_request"]
    idle = report["idle"]["cpu_percent"]["scheduler"]
    out["scheduler_one_core_rate_estimate"] = (100 - idle) * 10 / ms if ms else None
    return out


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    steps = report["steps"]
    good = [s for s in steps if s["meets_target"]]
    best = max(good, key=lambda s: s["offered_rate"]) if good else None
    peak_rss = max(
        [report["idle"]["peak_rss_bytes"]["scheduler"]]
        + [s["resources"]["peak_rss_bytes"]["scheduler"] for s in steps]
    )
    idle_rss = report["idle"]["scheduler_rss_bytes"]
    ov, tv = report["overhead"], report.get("overhead_tiny")
    restarts = report.get("restarts") or []

    def restart_median(key: str) -> float | None:
        vals = [r[key] for r in restarts if r[key] is not None]
        return statistics.median(vals) if vals and len(vals) == len(restarts) else None

    return {
        "nodes": report["settings"]["nodes"],
        "channels_open_idle": report["idle"].get("channels_open"),
        "restarts": len(restarts),
        # Median over the restarts; None if any restart never got whole again.
        "restart_recovery_s": restart_median("recovery_s"),
        "restart_recovery_max_s": max(
            (r["recovery_s"] for r in restarts if r["recovery_s"] is not None), default=None
        ),
        "restart_scheduler_up_s": restart_median("scheduler_up_s"),
        "restart_all_channels_open_s": restart_median("all_channels_open_s"),
        "restart_health_all_healthy_s": restart_median("health_all_healthy_s"),
        "restart_healthy_at_first_health": [r["healthy_at_first_health"] for r in restarts],
        "restart_check_accepted": sum(r["check"].get("accepted", 0) for r in restarts),
        "restart_check_sent": sum(r["check"]["n"] for r in restarts),
        "restart_ok": bool(restarts)
        and all(
            r["recovery_s"] is not None
            and r["whole_and_stable_1s_later"]
            and r["check"].get("accepted") == r["check"]["n"]
            for r in restarts
        ),
        "best_sustained_rate": best["offered_rate"] if best else None,
        "best_achieved_rate": best["achieved_rate"] if best else None,
        "best_dispatch_p50_s": best["dispatch_p50_s"] if best else None,
        "best_dispatch_p99_s": best["dispatch_p99_s"] if best else None,
        "best_e2e_p50_s": best["e2e_p50_s"] if best else None,
        "best_e2e_p99_s": best["e2e_p99_s"] if best else None,
        "p99_measure": "scheduler dispatch histogram"
        if any(s["dispatch_p99_s"] is not None for s in steps)
        else "client end-to-end (no dispatch histogram at /metrics)",
        "rate_target": RATE_TARGET,
        "rate_target_met": bool(best and best["offered_rate"] >= RATE_TARGET),
        "scheduler_rss_idle_bytes": idle_rss,
        "scheduler_rss_peak_bytes": peak_rss,
        "rss_target_bytes": RSS_TARGET_BYTES,
        "rss_target_met": peak_rss < RSS_TARGET_BYTES,
        "idle_scheduler_cpu_percent": report["idle"]["cpu_percent"]["scheduler"],
        "cpu_per_request": cpu_capacity(report),
        "heartbeat_p50_s": report["idle"]["heartbeats"]["heartbeat_latency_s"]["p50"],
        "heartbeat_p99_s": report["idle"]["heartbeats"]["heartbeat_latency_s"]["p99"],
        "overhead_ratio_through_over_direct": ov["ratio_through_over_direct"] if ov else None,
        "overhead_ratio_through_over_direct_verify": ov["ratio_through_over_direct_verify"]
        if ov
        else None,
        "tiny_overhead_ratio_through_over_direct": tv["ratio_through_over_direct"] if tv else None,
        "tiny_overhead_ratio_through_over_direct_verify": tv["ratio_through_over_direct_verify"]
        if tv
        else None,
    }


def restart_notes(report: dict[str, Any]) -> list[str]:
    notes = []
    for i, r in enumerate(report.get("restarts") or []):
        first, channels = r["healthy_at_first_health"], r["channels_open_at_first_health"]
        if first and channels is not None and first > channels:
            notes.append(
                f"restart {i + 1}: the restarted scheduler's first /health reported {first} "
                f"healthy nodes while only {channels} channels were open (it reloads the "
                "nodes' last state from its database without their channels: /health alone "
                "cannot tell when the pool is whole again, nor may the dispatcher trust it)"
            )
        if r["recovery_s"] is None:
            notes.append(f"restart {i + 1}: the pool was not whole again within the timeout")
        elif not r["whole_and_stable_1s_later"]:
            notes.append(f"restart {i + 1}: whole, but no longer 1 s later")
        if r["check"].get("accepted") != r["check"]["n"]:
            notes.append(
                f"restart {i + 1}: only {r['check'].get('accepted')} of {r['check']['n']} "
                "requests sent after the restart came back accepted"
            )
    return notes


def print_tables(report: dict[str, Any]) -> None:
    st = report["settings"]
    t = Table(
        title=f"scheduler bench: {st['nodes']} load-test nodes, heartbeat {st['heartbeat_s']:.0f} s, "
        f"{report['env']['device_name']}",
        caption="e2e = batch sent -> result page received (generate + verify + commit + "
        "long-poll); dispatch = scheduler histogram (submit -> sent to a generator)",
    )
    cols = [
        "offered/s",
        "achieved/s",
        "e2e p50",
        "e2e p99",
        "dispatch p50",
        "dispatch p99",
        "submit p99",
        "refused",
        "missing",
        "CPU % sched / nodes / bench / others",
        "sched RSS",
        "ok",
    ]
    for c in cols:
        t.add_column(c, justify="right", no_wrap=True)
    for s in report["steps"]:
        cpu, rss = s["resources"]["cpu_percent"], s["resources"]["peak_rss_bytes"]
        t.add_row(
            f"{s['offered_rate']:.0f}",
            f"{s['achieved_rate']:.0f}",
            _ms(s["e2e_p50_s"]),
            _ms(s["e2e_p99_s"]),
            _ms(s["dispatch_p50_s"]),
            (">= " if s["dispatch_p99_censored"] else "") + _ms(s["dispatch_p99_s"]),
            _ms(s["submit_p99_s"]),
            str(s["refused"]),
            str(s["window_missing"]),
            " / ".join(f"{cpu[k]:.0f}" for k in ("scheduler", "nodes", "bench", "others")),
            _mib(rss["scheduler"]),
            "yes" if s["meets_target"] else ("sustained" if s["sustained"] else "no"),
        )
    console.print(t)
    s, ov, idle = report["summary"], report["overhead"], report["idle"]
    best = s["best_sustained_rate"]
    rows = {
        f"highest sustained rate with p99 < {P99_TARGET_S * 1000:.0f} ms ({s['p99_measure']})": (
            "none" if best is None else f"{best:.0f}/s (achieved {s['best_achieved_rate']:.0f}/s)"
        )
        + ("  ok" if s["rate_target_met"] else f"  MISSED (target {RATE_TARGET:.0f}/s)"),
        "  at that rate: dispatch p50 / p99": f"{_ms(s['best_dispatch_p50_s'])} / "
        f"{_ms(s['best_dispatch_p99_s'])}",
        "  at that rate: e2e p50 / p99": f"{_ms(s['best_e2e_p50_s'])} / {_ms(s['best_e2e_p99_s'])}",
        f"scheduler RSS at {s['nodes']} connected nodes: idle / peak (target < 300 MiB)": (
            f"{_mib(s['scheduler_rss_idle_bytes'])} / {_mib(s['scheduler_rss_peak_bytes'])}"
            + ("  ok" if s["rss_target_met"] else "  MISSED")
            + f"  ({s['channels_open_idle']} channels open)"
        ),
        "idle CPU % (heartbeats only): sched / nodes / bench / others": " / ".join(
            f"{idle['cpu_percent'][k]:.0f}" for k in ("scheduler", "nodes", "bench", "others")
        ),
        "heartbeat latency p50 / p99": f"{_ms(s['heartbeat_p50_s'])} / {_ms(s['heartbeat_p99_s'])}",
    }
    if s["restarts"]:
        many = f", median of {s['restarts']}" if s["restarts"] > 1 else ""
        rows[
            f"time until all {s['nodes']} nodes are healthy again after kill -9 + restart{many}"
        ] = _s(s["restart_recovery_s"]) + ("  ok" if s["restart_ok"] else "  PROBLEM (see notes)")
        rows["  scheduler up / all channels open / /health says all healthy"] = (
            f"{_s(s['restart_scheduler_up_s'])} / {_s(s['restart_all_channels_open_s'])} / "
            f"{_s(s['restart_health_all_healthy_s'])}"
        )
        rows["  requests through the restarted scheduler: accepted / sent"] = (
            f"{s['restart_check_accepted']} / {s['restart_check_sent']}"
        )
    cap = s["cpu_per_request"]
    if cap:
        rows["CPU ms per request: sched / nodes / bench (over idle)"] = " / ".join(
            "n/a"
            if cap[f"{k}_cpu_ms_per_request"] is None
            else f"{cap[f'{k}_cpu_ms_per_request']:.1f}"
            for k in PROCS
        )
        est = cap["scheduler_one_core_rate_estimate"]
        rows["scheduler rate if it had one core to itself (estimate)"] = (
            "n/a" if est is None else f"{est:.0f}/s"
        )
    for label, o in (("load-test", ov), ("tiny-model", report.get("overhead_tiny"))):
        if not o:
            continue
        m = o["median_s"]
        rows[f"overhead, {label} nodes: median direct / direct+verify / through"] = (
            f"{_ms(m['direct'])} / {_ms(m['direct_verify'])} / {_ms(m['through'])}"
        )
        rows[f"overhead ratio, {label} nodes: through / direct (/ direct+verify)"] = (
            f"{o['ratio_through_over_direct']:.1f}x ({o['ratio_through_over_direct_verify']:.1f}x)"
        )
    t2 = Table(title="summary", show_header=False)
    t2.add_column("what")
    t2.add_column("value", justify="right")
    for k, v in rows.items():
        t2.add_row(k, v)
    console.print(t2)
    for note in report["notes"]:
        console.print(f"note: {note}")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = report["steps"]
    if not steps:
        return
    x = [s["offered_rate"] for s in steps]

    def ms(key: str) -> list[float]:
        return [float("nan") if s[key] is None else 1000 * s[key] for s in steps]

    restarts = report.get("restarts") or []
    fig, ax = plt.subplots(1, 4 if restarts else 3, figsize=(21 if restarts else 16, 4.8))
    a = ax[0]
    a.plot(x, ms("e2e_p50_s"), "o-", label="end-to-end p50 (client)")
    a.plot(x, ms("e2e_p99_s"), "o--", label="end-to-end p99 (client)")
    a.plot(x, ms("dispatch_p50_s"), "s-", label="dispatch p50 (scheduler)")
    a.plot(x, ms("dispatch_p99_s"), "s--", label="dispatch p99 (scheduler)")
    a.axhline(P99_TARGET_S * 1000, color="red", lw=0.8, ls=":", label="p99 target 50 ms")
    a.set_yscale("log")
    a.set_title("latency vs offered rate")
    a.set_ylabel("ms")
    a = ax[1]
    a.plot(x, [s["achieved_rate"] for s in steps], "o-", label="released/s")
    a.plot(x, x, color="gray", lw=0.8, ls=":", label="offered")
    if max(x) >= RATE_TARGET / 2:
        a.axvline(RATE_TARGET, color="red", lw=0.8, ls=":", label="target 500/s")
    a.set_title("throughput")
    a.set_ylabel("requests/s")
    a = ax[2]
    for k in ("scheduler", "nodes", "bench", "others"):
        a.plot(x, [s["resources"]["cpu_percent"][k] for s in steps], "o-", label=k)
    a.axhline(100 * (os.cpu_count() or 2), color="gray", lw=0.8, ls=":", label="all cores")
    a.set_title("CPU % per process (100% = one core)")
    for a in ax[:3]:
        a.set_xlabel("offered requests/s")
    if restarts:
        a = ax[3]
        for i, r in enumerate(restarts):
            t = [p[0] for p in r["timeline"]]
            a.step(
                t, [p[1] for p in r["timeline"]], where="post", label=f"/health healthy #{i + 1}"
            )
            a.step(
                t,
                [p[2] for p in r["timeline"]],
                "--",
                where="post",
                label=f"channels open #{i + 1}",
            )
            if r["recovery_s"] is not None:
                a.axvline(r["recovery_s"], color="gray", lw=0.8, ls=":")
        a.set_title("after kill -9 + restart of the scheduler")
        a.set_xlabel("seconds since the restart's start")
        a.set_ylabel("nodes")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    s, st = report["summary"], report["settings"]
    best = s["best_sustained_rate"]
    fig.suptitle(
        f"scheduler bench: {st['nodes']} load-test nodes on {report['env']['device_name']}; "
        f"best sustained rate with p99 < 50 ms: {'none' if best is None else f'{best:.0f}/s'}; "
        f"scheduler RSS idle {_mib(s['scheduler_rss_idle_bytes'])}, peak "
        f"{_mib(s['scheduler_rss_peak_bytes'])}"
        + (f"; whole again {_s(s['restart_recovery_s'])} after a restart" if restarts else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- Main ------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = ap.add_argument
    add("--nodes", type=int, help="load-test nodes (default 1000; --quick 100)")
    add("--rates", help="offered req/s steps (default 25,50,75,...,1000; --quick 50,100)")
    add("--warmup-s", type=float, help="per step, not measured (default 3; --quick 1)")
    add("--measure-s", type=float, help="per step, measured (default 12; --quick 3)")
    add("--drain-s", type=float, default=20.0, help="wait this long for a step's last results")
    add("--pause-s", type=float, default=2.0, help="between steps")
    add("--idle-s", type=float, help="idle window (default: one heartbeat period; --quick 3)")
    add("--batch-ms", type=float, default=20.0, help="submit a batch this often")
    add("--heartbeat-s", type=float, default=10.0, help="node heartbeat period")
    add(
        "--channel-ping-s",
        type=float,
        default=5.0,
        help="WebSocket ping period of the node channels, both ends (the defaults of "
        "scheduler channel.ping_interval_s and node channel.ping_interval_s)",
    )
    add("--restarts", type=int, default=1, help="scheduler kill -9 + restarts to time (0: none)")
    add("--restart-timeout-s", type=float, default=120.0, help="give a restart this long")
    add("--restart-poll-s", type=float, default=0.05, help="poll /health this often meanwhile")
    add(
        "--restart-check-n",
        type=int,
        help="requests sent through the restarted scheduler (default 100; --quick 20)",
    )
    add("--overhead-n", type=int, help="sequential requests per path (default 100; --quick 10)")
    add("--tiny-n", type=int, help="the same with two tiny-model nodes (default 30; --quick 0)")
    add("--give-up-p99-s", type=float, default=10.0, help="stop the steps past this p99")
    add("--model", default="loadtest", help="model name in the pool config")
    add("--scheduler-arg", action="append", default=[], help="extra flag for scheduler serve")
    add("--scheduler-env", action="append", default=[], help="KEY=VALUE for the scheduler")
    add("--scheduler-profile", type=Path, help="run the scheduler under cProfile, write here")
    add("--wait-quiet-s", type=float, default=0.0, help="wait up to this for an idle machine")
    add("--keep", action="store_true", help="keep the work folder (logs, DB)")
    add("--quick", action="store_true", help="100 nodes, two short steps (a smoke test, < 60 s)")
    add("--out", help="output stem (default tests/bench/results/scheduler_cpu)")
    args = ap.parse_args(argv)
    q = args.quick
    args.nodes = args.nodes or (100 if q else 1000)
    rates = args.rates or ("50,100" if q else "25,50,75,100,150,200,300,500,700,1000")
    args.rates = [float(r) for r in str(rates).split(",") if r.strip()]
    args.warmup_s = args.warmup_s if args.warmup_s is not None else (1.0 if q else 3.0)
    args.measure_s = args.measure_s if args.measure_s is not None else (3.0 if q else 12.0)
    args.idle_s = args.idle_s if args.idle_s is not None else (3.0 if q else args.heartbeat_s)
    args.overhead_n = args.overhead_n if args.overhead_n is not None else (10 if q else 100)
    args.tiny_n = args.tiny_n if args.tiny_n is not None else (0 if q else 30)
    args.restart_check_n = (
        args.restart_check_n if args.restart_check_n is not None else (20 if q else 100)
    )
    if q:
        args.drain_s = min(args.drain_s, 5.0)
        args.pause_s = min(args.pause_s, 0.5)
    if args.nodes < 2 or not args.rates or min(args.rates) <= 0:
        ap.error("need at least 2 nodes and positive rates")
    if args.restarts < 0 or args.channel_ping_s <= 0:
        ap.error("--restarts must be >= 0 and --channel-ping-s positive")
    args.out = Path(args.out) if args.out else RESULTS_DIR / "scheduler_cpu"
    return args


def wait_quiet(timeout_s: float, busy_below: float = 25.0) -> float:
    """Wait up to `timeout_s` for the machine to be under `busy_below` % busy (2 s samples,
    % of all cores); return the last sample."""
    deadline = time.monotonic() + timeout_s
    said = 0.0
    while True:
        busy = psutil.cpu_percent(interval=2.0)
        if busy < busy_below or time.monotonic() >= deadline:
            return busy
        if time.monotonic() - said > 30:
            console.print(f"machine {busy:.0f}% busy (other tenants): waiting for a quieter moment")
            said = time.monotonic()


def _git(*args: str) -> str:
    try:
        res = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)
    except OSError:
        return ""
    return res.stdout.strip() if res.returncode == 0 else ""


def env_info(load_start: float, busy_start: float) -> dict[str, Any]:
    versions = {}
    for k in VERSIONS_OF:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[k] = importlib.metadata.version(k)
    return {
        "device_name": f"CPU x{os.cpu_count()} ({platform.processor() or platform.machine()})",
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        **versions,
        "platform": platform.platform(),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "scheduler_dirty": bool(_git("status", "--porcelain", "scheduler", "protocol")),
        "loadavg_1m_at_start": load_start,
        "machine_cpu_percent_at_start": busy_start,
        "loadavg_1m_at_end": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_start = os.getloadavg()[0]
    busy_start = wait_quiet(args.wait_quiet_s)
    notes = []
    if busy_start >= 25:
        notes.append(
            f"machine {busy_start:.0f}% busy before the start (other tenants): "
            "rates are lower than on an idle box (see cpu_percent.others per step)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    raise_fd_limit()
    workdir = Path(tempfile.mkdtemp(prefix="bench-scheduler-"))
    t_start = time.perf_counter()
    try:
        dep = start_deployment(workdir, args)
        try:
            body = asyncio.run(bench(dep, args))
        finally:
            dep.stop()
        body["overhead_tiny"] = None
        if args.tiny_n > 0:  # after the load-test deployment is gone: a quiet box again
            tiny = start_tiny(workdir)
            try:
                body["overhead_tiny"] = asyncio.run(bench_tiny(tiny, args.tiny_n))
            finally:
                tiny.stop()
    except BaseException:
        console.print(f"[red]failed; logs kept in {workdir}[/red]")
        args.keep = True
        raise
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    report: dict[str, Any] = {
        "bench": "scheduler",
        "schema": 2,
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "env": env_info(load_start, busy_start),
        "settings": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("keep",)
        }
        | {
            "prompt_tokens": len(PROMPT),
            "completion_tokens": SAMPLING.max_tokens,
            "engine": "loadtest (instant, verifies nothing)",
            "rate_limits": "loopback exempt per address (the trainer key is never limited)",
            "database": "sqlite+aiosqlite (file in a temp folder)",
            "node_calls": "over each node's channel (WebSocket it opened to the scheduler)",
        },
        **body,
        "wall_s": time.perf_counter() - t_start,
        "notes": notes,
    }
    if args.keep:
        report["workdir"] = str(workdir)
    add_cpu_per_request(report)
    report["summary"] = summarize(report)
    report["notes"] += restart_notes(report)
    json_path, png_path = args.out.with_suffix(".json"), args.out.with_suffix(".png")
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    print_tables(report)
    plot(report, png_path)
    console.print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
