#!/usr/bin/env python
"""OpenAI front benchmark: a chat call through the scheduler's endpoint against a direct
call to one node, for any checkout of the code ("One signed path": before and after).

Starts real processes on loopback, all run from `--code-dir` (their cwd and PYTHONPATH;
default: this repository), so the same script measures an old checkout too:

- a pool: an owner-signed pool file with the tiny fp32 thresholds
  (configs/verification/tiny-torch-cpu-fp32.toml), written by the code dir's own
  `tests.pools.make_pool`; a `prime-scheduler serve` (SQLite, loopback exempt from the
  per-address rate limit) and two `prime-node join` workers on the tiny model, each its
  own operator, so every rollout can be verified by the other;
- one standalone `prime-node serve --engine.model tiny`: the direct path (at HEAD a pool
  node's own OpenAI routes are closed, so the direct call cannot go to a pool worker).

Then the same small chat request (official `openai` client, `--max-tokens` tokens with
`ignore_eos` so every answer has the same length, temperature 1, no retries) is sent
`--n` times per path, sequentially and interleaved after `--warmup` calls per path: direct
(the standalone node) and through (the scheduler). By default (`--order flip`) the order
of the two flips every round (direct, through, through, direct, ...), so drifts of a
shared box hit both alike and each path follows each path equally often; `--order
alternate` is direct, through, direct, through. Reported per path: median, p90, mean, min
and max latency (client side: call sent -> answer parsed), the median split by the path of
the call just before (`by_previous_call`), and the ratio of medians through / direct.
`--pause-ms` leaves time after each call, so that what a call leaves running behind its
answer no longer meets the next one (label such runs apart, e.g. `after+pause30`).

What "through" contains depends on the code dir, detected from its source:

- signed front (scheduler/config.py has `class OpenAIConfig`, commit d426f8e and later):
  the scheduler tokenizes the chat (`--openai.tokenizer`, the tiny model's folder), sends
  a signed `RolloutRequest` to one node, has a second node verify the signed rollout and
  renders the answer from it; the call carries an owner-issued API key
  (`Authorization: Bearer psk-...`).
- JSON proxy (older code, e.g. 309a035): the scheduler forwards the JSON call to one
  node, fetches that node's signed rollout, answers, and verifies behind the answer (that
  verification then runs on the second node while the next call is measured: a call right
  after a through call meets it, which `by_previous_call` shows). It ignores the
  Authorization header; the same key is sent anyway.

How to read it: absolute milliseconds belong to this machine (the recorded runs: a
shared 2-core box; the children run with OMP_NUM_THREADS=1); the ratio is measured side
by side in one run and carries over better. The direct path is the same engine on the
same model in both runs, but its HTTP/OpenAI layer is the code dir's own (it was rewritten
with the signed front), and the box may be busier in one run (`cpu` in the JSON: "others"
is every process not started here): compare ratios across runs, milliseconds only
within one. The JSON keeps every
latency; one file holds several runs by label (`--label`, default `after` for a signed
front and `before` otherwise; `before#2` is a repeat grouped with `before`), a new run
replacing only its own label; `comparison` gives per group every run's ratio, their
median and the ratio over the pooled latencies, and the PNG compares the groups. On a
shared box read the spread of the per-run ratios before any one figure.

    python tests/bench/bench_openai_front.py                            # HEAD -> label after
    git -C . worktree add /tmp/before 309a035
    python tests/bench/bench_openai_front.py --code-dir /tmp/before     # label before
    python tests/bench/bench_openai_front.py --code-dir /tmp/before --label 'before#2'
    python tests/bench/bench_openai_front.py --quick --out /tmp/front   # smoke, 4 calls/path
    python tests/bench/bench_openai_front.py --replot tests/bench/results/openai_front_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
if str(REPO_ROOT) not in sys.path:  # runs from a checkout, installed or not
    sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from protocol.identity import Identity  # noqa: E402
from protocol.processes import ManagedProcess, free_port  # noqa: E402

RESULTS_DIR = HERE / "results"
POOL_ID = "bench-front"
MODEL = "tiny"
PATHS = ("direct", "through")
MESSAGES = [{"role": "user", "content": "Reverse this text: hello world"}]
VERSIONS_OF = ("openai", "httpx", "aiohttp", "pydantic", "torch", "transformers")
CODE_DIRS = ("scheduler", "node", "protocol", "verifier")  # what the children run
console = Console(width=None if sys.stdout.isatty() else 200)

# Run inside the code dir (cwd + PYTHONPATH): its own pool file writer and tiny model.
PREPARE = """
import json, sys
from pathlib import Path
import scheduler, node
from tests.pools import make_pool
from verifier.models import resolve_model
pool = make_pool(Path(sys.argv[1]), pool_id=sys.argv[2])
print(json.dumps({
    "pool_file": str(pool.pool_file),
    "model_dir": str(resolve_model("tiny")),
    "scheduler_module": scheduler.__file__,
    "node_module": node.__file__,
}))
"""


# --- The code under test ---------------------------------------------------------------
def _git(cwd: Path, *args: str, strip: bool = True) -> str:
    try:
        res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    except OSError:
        return ""
    if res.returncode != 0:
        return ""
    return res.stdout.strip() if strip else res.stdout


@dataclass
class CodeDir:
    """The checkout whose processes are started, and what its scheduler's front is."""

    path: Path
    commit: str
    subject: str
    dirty: list[str]
    signed_front: bool  # d426f8e and later: tokenizer flag, API key, verified answers

    @classmethod
    def inspect(cls, path: Path) -> CodeDir:
        path = path.resolve()
        config = path / "scheduler" / "config.py"
        if not config.is_file():
            raise SystemExit(f"{path} is not a prime-swarm checkout (no scheduler/config.py)")
        status = _git(path, "status", "--porcelain", "--", *CODE_DIRS, strip=False)
        return cls(
            path=path,
            commit=_git(path, "rev-parse", "--short", "HEAD"),
            subject=_git(path, "log", "-1", "--format=%s")[:120],
            dirty=[line[3:] for line in status.splitlines() if line.strip()],
            signed_front="class OpenAIConfig" in config.read_text(),
        )

    def env(self) -> dict[str, str]:
        """Children import the code dir first (before the venv's editable install)."""
        extra = os.environ.get("PYTHONPATH", "")
        return {
            "PYTHONPATH": str(self.path) + (os.pathsep + extra if extra else ""),
            "OMP_NUM_THREADS": "1",
        }


def prepare(code: CodeDir, workdir: Path) -> dict[str, str]:
    """Pool file (owner and trainer keys beside it) and the tiny model's folder, written by
    the code dir's own code; also says which files its `scheduler` and `node` come from."""
    res = subprocess.run(
        [sys.executable, "-c", PREPARE, str(workdir), POOL_ID],
        cwd=code.path,
        env={**os.environ, **code.env()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if res.returncode != 0:
        raise RuntimeError(f"preparing the pool failed:\n{res.stdout}\n{res.stderr}")
    info = json.loads(res.stdout.strip().splitlines()[-1])
    for mod in ("scheduler_module", "node_module"):
        if not Path(info[mod]).resolve().is_relative_to(code.path):
            raise RuntimeError(f"children would import {info[mod]}, not {code.path}")
    return info


# --- Processes -------------------------------------------------------------------------
@dataclass
class Deployment:
    code: CodeDir
    workdir: Path
    info: dict[str, str]
    scheduler_url: str = ""
    direct_url: str = ""
    procs: dict[str, ManagedProcess] = field(default_factory=dict)
    start_s: float = 0.0

    def stop(self) -> None:
        for name in ("standalone", "node-b", "node-a", "scheduler"):
            child = self.procs.get(name)
            if child is not None:
                with contextlib.suppress(Exception):
                    child.stop()


def _node_state(url: str, node_id: str) -> str | None:
    try:
        state = httpx.get(f"{url}/v1/dashboard/state", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None
    return next((n["state"] for n in state.get("nodes", []) if n["node_id"] == node_id), None)


def start(code: CodeDir, workdir: Path, args: argparse.Namespace) -> Deployment:
    t0 = time.perf_counter()
    info = prepare(code, workdir)
    dep = Deployment(code, workdir, info)
    env = code.env()
    port = free_port()
    dep.scheduler_url = f"http://127.0.0.1:{port}"
    front = ["--openai.tokenizer", info["model_dir"]] if code.signed_front else []
    console.print(
        f"code {code.commit} ({'signed front' if code.signed_front else 'JSON proxy'}) from "
        f"{code.path}: scheduler on {dep.scheduler_url}"
    )
    try:
        dep.procs["scheduler"] = ManagedProcess.start(
            "scheduler",
            [
                sys.executable,
                "-m",
                "scheduler.cli",
                "serve",
                "--pool-file",
                info["pool_file"],
                "--key-file",
                str(workdir / "scheduler.key"),
                "--database.url",
                f"sqlite+aiosqlite:///{workdir / 'scheduler.db'}",
                "--server.port",
                str(port),
                "--log-dir",
                str(workdir / "scheduler-logs"),
                "--rate_limits.exempt_addresses",
                '["127.0.0.1"]',
                *front,
            ],
            f"{dep.scheduler_url}/health",
            workdir / "scheduler.log",
            cwd=code.path,
            env=env,
            timeout_s=120,
        )
        node_ids = {}
        for name in ("node-a", "node-b"):  # start-up is mostly imports: overlap them
            key = workdir / f"{name}.key"
            node_ids[name] = Identity.load_or_create(key).node_id
            nport = free_port()
            dep.procs[name] = ManagedProcess.start(
                name,
                [
                    sys.executable,
                    "-m",
                    "node.cli",
                    "join",
                    "--pool",
                    POOL_ID,
                    "--scheduler",
                    dep.scheduler_url,
                    "--key-file",
                    str(key),
                    "--log-dir",
                    str(workdir / name),
                    "--server.port",
                    str(nport),
                    "--operator",
                    name,
                    "--weights.folder",
                    str(workdir / "weights"),
                ],
                f"http://127.0.0.1:{nport}/health",
                workdir / f"{name}.log",
                cwd=code.path,
                env=env,
                wait=False,
            )
        sport = free_port()
        dep.direct_url = f"http://127.0.0.1:{sport}"
        dep.procs["standalone"] = ManagedProcess.start(
            "standalone",
            [
                sys.executable,
                "-m",
                "node.cli",
                "serve",
                "--engine.model",
                MODEL,
                "--server.port",
                str(sport),
                "--key-file",
                str(workdir / "standalone.key"),
                "--log-dir",
                str(workdir / "standalone"),
            ],
            f"{dep.direct_url}/health",
            workdir / "standalone.log",
            cwd=code.path,
            env=env,
            wait=False,
        )
        console.print("starting two prime-node join workers and one standalone prime-node serve")
        for name in ("node-a", "node-b", "standalone"):
            dep.procs[name].wait_healthy(args.start_timeout_s)
        deadline = time.time() + 60
        for name, node_id in node_ids.items():
            while (state := _node_state(dep.scheduler_url, node_id)) != "healthy":
                if time.time() > deadline:
                    raise TimeoutError(f"{name} is {state} at the scheduler after 60 s")
                time.sleep(0.3)
    except BaseException:
        dep.stop()
        raise
    dep.start_s = time.perf_counter() - t0
    console.print(f"all up in {dep.start_s:.1f} s")
    return dep


# --- Measurement -----------------------------------------------------------------------
def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def cpu_seconds(pid: int) -> float:
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


def machine_busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def measure(dep: Deployment, args: argparse.Namespace, api_key: str) -> dict[str, Any]:
    from openai import OpenAI

    clients = {
        "direct": OpenAI(
            base_url=f"{dep.direct_url}/v1", api_key="unused", max_retries=0, timeout=120
        ),
        "through": OpenAI(
            base_url=f"{dep.scheduler_url}/v1", api_key=api_key, max_retries=0, timeout=120
        ),
    }
    first: dict[str, Any] = {}

    def one(path: str) -> float:
        t0 = time.perf_counter()
        r = clients[path].chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=args.max_tokens,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        dt = time.perf_counter() - t0
        used = r.usage.completion_tokens if r.usage else None
        if used != args.max_tokens:
            raise RuntimeError(f"{path}: {used} completion tokens, asked {args.max_tokens}")
        if path not in first:
            first[path] = {
                "model": r.model,
                "prompt_tokens": r.usage.prompt_tokens if r.usage else None,
                "completion_tokens": used,
                "finish_reason": r.choices[0].finish_reason,
                "extra": sorted((r.model_extra or {}).keys()),
                "verified": (r.model_extra or {}).get("verified"),
            }
        return dt

    previous = "through"  # the path of the call before: warm-up rounds end with through
    console.print(f"warm-up: {args.warmup} calls per path")
    for _ in range(args.warmup):
        for path in PATHS:
            one(path)
    pids = {name: p.proc.pid for name, p in dep.procs.items()} | {"bench": os.getpid()}
    cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
    busy0, t0 = machine_busy_s(), time.perf_counter()
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    follows: dict[str, list[str]] = {p: [] for p in PATHS}
    console.print(f"measuring: {args.n} calls per path, interleaved ({args.order})")
    for i in range(args.n):
        order = PATHS if args.order == "alternate" or i % 2 == 0 else PATHS[::-1]
        for path in order:
            times[path].append(one(path))
            follows[path].append(previous)
            previous = path
            if args.pause_ms:
                time.sleep(args.pause_ms / 1000)
    wall = time.perf_counter() - t0
    cpu = {k: 100 * (cpu_seconds(p) - cpu0[k]) / wall for k, p in pids.items()}
    machine = 100 * (machine_busy_s() - busy0) / wall
    cpu["others"] = max(0.0, machine - sum(cpu.values()))

    def split(p: str) -> dict[str, Any]:
        """Median by the path of the call just before (JSON proxy: a call right after a
        through call meets that call's verification, still running behind its answer)."""
        out: dict[str, Any] = {}
        for prev in PATHS:
            v = [t for t, f in zip(times[p], follows[p], strict=True) if f == prev]
            out[f"after_{prev}"] = {"n": len(v), "median_s": statistics.median(v) if v else None}
        return out

    paths = {
        p: {
            "median_s": statistics.median(v),
            "p90_s": pct(v, 90),
            "mean_s": statistics.fmean(v),
            "min_s": min(v),
            "max_s": max(v),
            "by_previous_call": split(p),
            "latencies_s": v,
            "previous_call": follows[p],
        }
        for p, v in times.items()
    }
    return {
        "paths": paths,
        **ratios(paths),
        "measure_wall_s": wall,
        "cpu": {
            "percent_per_process": cpu,
            "machine_percent": machine,
            "cores": os.cpu_count(),
            "note": "over the measured loop; 100% = one core",
        },
        "first_answer": first,
    }


def ratios(paths: dict[str, Any]) -> dict[str, float | None]:
    """Through over direct: of medians (the headline), of p90s and of means, and of the
    through calls right after a direct / a through call over the direct median."""
    d, t = paths["direct"], paths["through"]
    split = t["by_previous_call"]
    return {
        "ratio_through_over_direct": t["median_s"] / d["median_s"],
        "ratio_p90_through_over_direct": (t["p90_s"] or 0.0) / (d["p90_s"] or 1.0),
        "ratio_mean_through_over_direct": t["mean_s"] / d["mean_s"],
        **{
            f"ratio_through_after_{p}_over_direct": None
            if split[f"after_{p}"]["median_s"] is None
            else split[f"after_{p}"]["median_s"] / d["median_s"]
            for p in PATHS
        },
    }


# --- Reporting -------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{1000 * x:.1f}"


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


def env_info() -> dict[str, Any]:
    versions = {}
    for k in VERSIONS_OF:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[k] = importlib.metadata.version(k)
    return {
        "device_name": f"CPU x{os.cpu_count()} ({platform.processor() or platform.machine()})",
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **versions,
        "bench_git_commit": _git(REPO_ROOT, "rev-parse", "--short", "HEAD"),
    }


def group(label: str) -> str:
    """`before#2` is a repeat of `before`: runs are grouped by the label before '#'."""
    return label.split("#", 1)[0]


def comparison(runs: dict[str, Any]) -> dict[str, Any] | None:
    """Before against after: per group, every run's ratio and their median, and the ratio
    of medians over the group's pooled latencies."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for label, r in runs.items():
        groups.setdefault(group(label), []).append(r)
    if "before" not in groups or "after" not in groups:
        return None
    out: dict[str, Any] = {}
    keys = (
        "ratio_through_over_direct",
        "ratio_mean_through_over_direct",
        "ratio_through_after_direct_over_direct",
        "ratio_through_after_through_over_direct",
    )
    for g in ("before", "after"):
        rs = groups[g]
        pooled = {p: [x for r in rs for x in r["paths"][p]["latencies_s"]] for p in PATHS}
        med = {p: statistics.median(v) for p, v in pooled.items()}
        out[g] = {
            "runs": len(rs),
            "run_ratios": [r["ratio_through_over_direct"] for r in rs],
            "median_of_run_ratios": statistics.median(r["ratio_through_over_direct"] for r in rs),
            "pooled_median_s": med,
            "pooled_ratio_through_over_direct": med["through"] / med["direct"],
            "pooled_added_ms": 1000 * (med["through"] - med["direct"]),
            **{
                f"median_of_run_{k}": statistics.median(r[k] for r in rs if r.get(k) is not None)
                for k in keys
                if any(r.get(k) is not None for r in rs)
            },
        }
    out["after_over_before"] = (
        out["after"]["median_of_run_ratios"] / out["before"]["median_of_run_ratios"]
    )
    return out


def print_tables(report: dict[str, Any]) -> None:
    t = Table(
        title=f"OpenAI front bench: {report['env']['device_name']}",
        caption="latency per call, client side (ms); ratio = median through / median direct; "
        "after d / t: through calls right after a direct / a through call",
    )
    for c in (
        "run",
        "code",
        "front",
        "n",
        "direct p50",
        "direct p90",
        "through p50",
        "through p90",
        "through p50 after d / t",
        "ratio",
        "CPU % all / others",
        "run s",
    ):
        t.add_column(c, justify="right", no_wrap=True)
    for label, r in report["runs"].items():
        d, th = r["paths"]["direct"], r["paths"]["through"]
        t.add_row(
            label,
            r["code"]["commit"] + ("+dirty" if r["code"]["dirty"] else ""),
            "signed" if r["code"]["signed_front"] else "JSON proxy",
            str(r["settings"]["n"]),
            _ms(d["median_s"]),
            _ms(d["p90_s"]),
            _ms(th["median_s"]),
            _ms(th["p90_s"]),
            " / ".join(_ms(th["by_previous_call"][f"after_{p}"]["median_s"]) for p in PATHS),
            f"{r['ratio_through_over_direct']:.2f}x",
            f"{r['cpu']['machine_percent']:.0f} / {r['cpu']['percent_per_process']['others']:.0f}",
            f"{r['wall_s']:.0f}",
        )
    console.print(t)
    c = report.get("comparison")
    if c:
        t2 = Table(title="before / after (groups of runs: label before '#')")
        for col in (
            "group",
            "runs",
            "ratio per run",
            "median ratio",
            "pooled p50 direct / through ms",
            "pooled ratio",
            "ratio of means",
            "through after d / t over direct",
        ):
            t2.add_column(col, justify="right", no_wrap=True)
        for g in ("before", "after"):
            x = c[g]
            m = x["pooled_median_s"]
            t2.add_row(
                g,
                str(x["runs"]),
                ", ".join(f"{v:.2f}" for v in x["run_ratios"]),
                f"{x['median_of_run_ratios']:.2f}x",
                f"{_ms(m['direct'])} / {_ms(m['through'])}",
                f"{x['pooled_ratio_through_over_direct']:.2f}x",
                f"{x.get('median_of_run_ratio_mean_through_over_direct', float('nan')):.2f}x",
                " / ".join(
                    f"{x[k]:.2f}x"
                    if (k := f"median_of_run_ratio_through_after_{p}_over_direct") in x
                    else "n/a"
                    for p in PATHS
                ),
            )
        console.print(t2)
        console.print(f"median ratio after / before: {c['after_over_before']:.2f}")
    for label, r in report["runs"].items():
        for note in r.get("notes", []):
            console.print(f"note ({label}): {note}")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    # before, after, then variants (before+pause30, after+pause30, ...), repeats in order
    labels = sorted(
        runs, key=lambda k: ("+" in group(k), group(k).split("+")[0] != "before", group(k), k)
    )
    groups = list(dict.fromkeys(group(k) for k in labels))
    fig, ax = plt.subplots(1, 3, figsize=(19, 5.5), gridspec_kw={"width_ratios": [1.5, 0.8, 1.3]})
    palette = {"direct": "#4c72b0", "through": "#dd8452"}
    data, names, colors = [], [], []
    for g in groups:
        for p in PATHS:
            data.append(
                [
                    1000 * x
                    for k in labels
                    if group(k) == g
                    for x in runs[k]["paths"][p]["latencies_s"]
                ]
            )
            names.append(f"{g.replace('+', chr(10) + '+')}\n{p}")
            colors.append(palette[p])
    a = ax[0]
    box = a.boxplot(data, patch_artist=True, showfliers=False, whis=(10, 90))
    for patch, col in zip(box["boxes"], colors, strict=True):
        patch.set_facecolor(col)
        patch.set_alpha(0.5)
    for i, vals in enumerate(data, start=1):
        a.scatter([i + (k % 7 - 3) * 0.03 for k in range(len(vals))], vals, s=5, c="k", alpha=0.3)
    a.set_xticks(range(1, len(names) + 1), names, fontsize=8)
    top = max(max(v) for v in data)
    for j in range(len(groups)):
        d, t = statistics.median(data[2 * j]), statistics.median(data[2 * j + 1])
        a.text(2 * j + 1.5, top * 1.03, f"{t / d:.2f}x", ha="center", fontsize=10, weight="bold")
    a.set_ylim(0, top * 1.1)
    a.set_ylabel("ms per call (box: quartiles, whiskers p10-p90)")
    a.set_title("latency per path, all runs of a group; ratio of medians")
    a.grid(alpha=0.3, axis="y")
    a = ax[1]
    kinds = (
        ("ratio_through_over_direct", "o", "of medians"),
        ("ratio_through_after_direct_over_direct", "^", "through after a direct"),
        ("ratio_through_after_through_over_direct", "v", "through after a through"),
    )
    for off, (key, marker, what) in zip((-0.15, 0.0, 0.15), kinds, strict=True):
        xs, ys = [], []
        for j, g in enumerate(groups):
            for k in labels:
                if group(k) == g and runs[k].get(key) is not None:
                    xs.append(j + off)
                    ys.append(runs[k][key])
        a.scatter(xs, ys, marker=marker, s=40, label=what, alpha=0.8)
    a.axhline(1.0, color="gray", lw=0.8, ls=":")
    a.set_xticks(range(len(groups)), [g.replace("+", "\n+") for g in groups], fontsize=8)
    a.set_xlim(-0.5, len(groups) - 0.5)
    a.set_ylim(bottom=0)
    a.set_ylabel("through / direct median")
    a.set_title("ratio per run")
    a.grid(alpha=0.3, axis="y")
    a.legend(fontsize=8)
    a = ax[2]
    styles = {"direct": "-", "through": "--"}
    main = [g for g in groups if g in ("before", "after")] or groups[:2]
    for g in main:
        k = next(k for k in labels if group(k) == g)
        for p in PATHS:
            v = [1000 * x for x in runs[k]["paths"][p]["latencies_s"]]
            a.plot(range(len(v)), v, styles[p], marker=".", lw=0.8, label=f"{k} {p}")
    a.xaxis.get_major_locator().set_params(integer=True)
    a.set_xlabel("round (measured calls, in order)")
    a.set_ylabel("ms")
    a.set_title(f"latency per round, first run of {' and '.join(main)} (drift check)")
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    codes = ", ".join(
        f"{g}: {runs[k]['code']['commit']} "
        f"({'signed front' if runs[k]['code']['signed_front'] else 'JSON proxy'})"
        for g in groups
        for k in [next(k for k in labels if group(k) == g)]
    )
    fig.suptitle(
        f"chat call through the scheduler's OpenAI endpoint vs direct to one tiny node, "
        f"{report['env']['device_name']}; {codes}",
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
    add("--code-dir", type=Path, default=REPO_ROOT, help="checkout whose processes are started")
    add("--n", type=int, help="measured calls per path (default 40; --quick 4)")
    add("--warmup", type=int, help="warm-up calls per path (default 5; --quick 1)")
    add("--max-tokens", type=int, default=8, help="completion tokens per call (ignore_eos)")
    add("--pause-ms", type=float, default=0.0, help="pause after each call")
    add(
        "--order",
        choices=("flip", "alternate"),
        default="flip",
        help="flip: direct, through, through, direct, ... (each path follows each path "
        "equally often); alternate: direct, through, direct, through, ...",
    )
    add(
        "--label",
        help="run name in the JSON (default: after for a signed front, else before); "
        "before#2 etc. are repeats, grouped with before",
    )
    add("--start-timeout-s", type=float, default=240.0, help="per node start-up")
    add("--wait-quiet-s", type=float, default=0.0, help="wait up to this for an idle machine")
    add("--fresh", action="store_true", help="drop the other runs kept in the output JSON")
    add("--keep", action="store_true", help="keep the work folder (logs, DB)")
    add("--quick", action="store_true", help="smoke run: 4 calls per path, 1 warm-up")
    add("--out", help="output stem (default tests/bench/results/openai_front_cpu)")
    add("--replot", type=Path, help="only redraw the PNG (and tables) of this JSON")
    args = ap.parse_args(argv)
    args.n = args.n if args.n is not None else (4 if args.quick else 40)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    if args.n < 1 or args.warmup < 0 or args.max_tokens < 1:
        ap.error("need n >= 1, warmup >= 0, max-tokens >= 1")
    args.out = Path(args.out) if args.out else RESULTS_DIR / "openai_front_cpu"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        report = json.loads(args.replot.read_text())
        for r in report["runs"].values():  # files written before a ratio was added
            r.update({k: v for k, v in ratios(r["paths"]).items() if k not in r})
        report["comparison"] = comparison(report["runs"])
        print_tables(report)
        plot(report, args.replot.with_suffix(".png"))
        console.print(f"wrote {args.replot.with_suffix('.png')}")
        return 0
    code = CodeDir.inspect(args.code_dir)
    label = args.label or ("after" if code.signed_front else "before")
    notes: list[str] = []
    if code.dirty:
        notes.append(f"code dir has uncommitted changes in {', '.join(code.dirty)}")
    load_start = os.getloadavg()[0]
    busy_start = wait_quiet(args.wait_quiet_s) if args.wait_quiet_s > 0 else None
    if busy_start is not None and busy_start >= 25:
        notes.append(f"machine {busy_start:.0f}% busy before the start (other tenants)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-openai-front-"))
    t_start = time.perf_counter()
    try:
        dep = start(code, workdir, args)
        try:
            from scheduler.pool import make_api_key

            owner = Identity.load_or_create(workdir / "owner.key")
            api_key = make_api_key(owner, POOL_ID, "bench", 3600.0, 1000.0, 1000)
            body = measure(dep, args, api_key)
        finally:
            dep.stop()
    except BaseException:
        console.print(f"[red]failed; logs kept in {workdir}[/red]")
        args.keep = True
        raise
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    run: dict[str, Any] = {
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "code": {
            "dir": str(code.path),
            "commit": code.commit,
            "subject": code.subject,
            "dirty": code.dirty,
            "signed_front": code.signed_front,
            "scheduler_module": dep.info["scheduler_module"],
        },
        "settings": {
            "n": args.n,
            "warmup": args.warmup,
            "max_tokens": args.max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "messages": MESSAGES,
            "model": MODEL,
            "pause_ms": args.pause_ms,
            "order": args.order,
            "client": "openai.OpenAI, max_retries=0, one client per path (keep-alive)",
            "through": "signed front: tokenize, signed RolloutRequest, verified by a second "
            "node, answer rendered from the rollout (API key sent)"
            if code.signed_front
            else "JSON proxy: forwarded to one node, signed rollout fetched, answered, "
            "verified behind the answer (Authorization ignored)",
            "direct": "standalone prime-node serve --engine.model tiny (open OpenAI routes)",
            "pool": "2 x prime-node join (tiny, torch CPU, OMP_NUM_THREADS=1, one operator "
            "each), tiny-torch-cpu-fp32 thresholds, SQLite, loopback rate-limit exempt",
            "scheduler_flags": ["--openai.tokenizer", "<tiny model folder>"]
            if code.signed_front
            else [],
        },
        "env": env_info(),
        "start_s": dep.start_s,
        **body,
        "loadavg_1m_at_start": load_start,
        "machine_cpu_percent_at_start": busy_start,
        "loadavg_1m_at_end": os.getloadavg()[0],
        "wall_s": time.perf_counter() - t_start,
        "notes": notes,
    }
    if args.keep:
        run["workdir"] = str(workdir)
    json_path, png_path = args.out.with_suffix(".json"), args.out.with_suffix(".png")
    runs: dict[str, Any] = {}
    if json_path.exists() and not args.fresh:
        with contextlib.suppress(ValueError, KeyError):
            runs = json.loads(json_path.read_text())["runs"]
    runs[label] = run
    report = {
        "bench": "openai_front",
        "schema": 1,
        "env": env_info(),
        "runs": runs,
        "comparison": comparison(runs),
    }
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    print_tables(report)
    plot(report, png_path)
    console.print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
