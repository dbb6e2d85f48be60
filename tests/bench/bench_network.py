"""The whole network on one machine (issue 6): RL through a real pool, weights over the swarm.

One SFT warm-up of the tiny model on reverse-text, then `prime-trainer rl`
(configs/rl/reverse-text-tiny.toml, `--weights.transport swarm`) through a fresh pool per
run (scheduler + `prime-node join` workers on loopback, every rollout verified by a second
worker). Three measurements, side by side in one run:

1. async_level 0, 1, 2, 4 on the same pool size and steps: wall-clock time per step (the rl
   command's seconds / steps, start-up included; "steady": first to last trainer step over
   steps - 1; and the trainer's own step_time + idle), the trainer's idle fraction (its wait
   for the next batch over wait + step, step 1 excluded), each as a ratio against async 0.
2. The share of worker time spent verifying: every worker's `GET /health` `busy_s`
   (seconds of generation work and of verification work, see node/worker.py), read at the
   end of each run before the pool closes; verify / (generate + verify) per node and overall.
3. Rollouts per second delivered to the trainer with 0%, 10% and 30% dishonest workers
   (default 10 workers, 0, 1 and 3 of them `tests.adversary_node KIND`), at async_level 2:
   samples in the batch files (`<run>/rollouts/step_<n>.pt`) of steps 2..N over the time
   from the first batch file to the last (start-up excluded), all samples over the rl
   command's seconds, and the pool's own pace (samples over the orchestrator's generate +
   verify time, its waits for a newer policy excluded: what the trainer could get at most);
   with each dishonest worker's ban time (the scheduler's dashboard state polled every
   0.5 s: seconds after the rl command started, and the step the orchestrator was
   producing) and the rejection / dispute counts (dashboard totals and the scheduler's
   SQLite `verdicts` table).

Absolute seconds are for this shared 2-core box only (the trainer, every worker, the
scheduler and the swarm share two cores); read the ratios measured in the same run.

    .venv/bin/python tests/bench/bench_network.py --out tests/bench/results/network_cpu
    .venv/bin/python tests/bench/bench_network.py --sft-steps 30 --steps 2 --levels 0,2 \\
        --workers 2 --pool-size 3 --dishonest 1 --out /tmp/net    # smoke, ~2-3 min
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tests.bench.bench_swarm import cpu_busy, cpu_times, wait_quiet  # noqa: E402
from tests.pools import Pool  # noqa: E402
from tests.rl_runs import REPO, run_rl, serving_pool, sft_warmup, summarize, worker_health  # noqa: E402
from trainer.batch import batch_path, read_batch  # noqa: E402
from trainer.monitor import read_metrics  # noqa: E402

SWARM = ("--weights.transport", "swarm", "--weights.swarm.piece-size", str(64 * 1024))
RATIO_KEYS = ("wall_per_step_s", "steady_wall_per_step_s", "step_plus_idle_s", "idle_fraction")


class StatePoller:
    """Polls the scheduler's dashboard state in a thread; keeps when each node was first
    seen banned (seconds after `start`, and the wall-clock time)."""

    def __init__(self, pool: Pool, period_s: float = 0.5):
        self.pool, self.period_s = pool, period_s
        self.names = {pool.node_id(name): name for name in pool.nodes}
        self.banned: dict[str, dict[str, float]] = {}
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with contextlib.suppress(Exception):  # a slow answer: try again next period
                for n in self.pool.state()["nodes"]:
                    name = self.names.get(n["node_id"], n["node_id"][:12])
                    if n["state"] == "banned" and name not in self.banned:
                        self.banned[name] = {
                            "t_s": time.monotonic() - self.t0,
                            "time": time.time(),
                            "generated": n["generated"],
                            "rejected": n["rejected"],
                        }

    def __enter__(self) -> StatePoller:
        self.t0, self.wall0 = time.monotonic(), time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Measured:
    """What one rl run on one pool left: its folder, seconds, and the pool's view of it."""

    run: Path
    rl_s: float
    health: dict[str, dict | None]
    state: dict
    verdicts: list[dict] = field(default_factory=list)
    banned: dict[str, dict[str, float]] = field(default_factory=dict)
    wall0: float = 0.0
    names: dict[str, str] = field(default_factory=dict)
    machine_busy: float | None = None


def read_verdicts(db: Path) -> list[dict]:
    """Every verdict the scheduler stored (kind, generator, verifier, accepted, time)."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute(
            "SELECT kind, generator_id, verifier_id, accepted, created_at FROM verdicts"
        ).fetchall()
    keys = ("kind", "generator_id", "verifier_id", "accepted", "created_at")
    return [dict(zip(keys, r, strict=True)) for r in rows]


def measure(
    workdir: Path, model: Path, level: int, steps: int, workers: int, dishonest: list[str],
    extra: tuple[str, ...],
) -> Measured:  # fmt: skip
    """One rl run at `level` on a fresh pool; reads /health, dashboard state and verdicts
    before the pool closes."""
    with serving_pool(workdir, model, workers, dishonest, async_level=level) as pool:
        run = workdir / "run"
        before = cpu_times()
        with StatePoller(pool) as poller:
            took = run_rl(
                pool, model, run, "--max-steps", str(steps), "--async-level", str(level), *extra
            )
        busy_cpu = cpu_busy(before, cpu_times())
        health = worker_health(pool)
        state = pool.state()
        time.sleep(0.5)  # the scheduler's group commit (20 ms) has flushed the last verdicts
        verdicts = read_verdicts(workdir / "scheduler.db")
        return Measured(
            run,
            took,
            health,
            state,
            verdicts,
            poller.banned,
            poller.wall0,
            poller.names,
            busy_cpu,
        )


# -- summaries -------------------------------------------------------------------------


def busy(health: dict[str, dict | None]) -> dict[str, Any]:
    """Seconds generating / verifying per answering worker, and verify / (generate + verify)."""
    nodes = {}
    for name, h in health.items():
        if h is None or "busy_s" not in h:
            continue
        g, v = h["busy_s"]["generate"], h["busy_s"]["verify"]
        nodes[name] = {
            "generate_s": g,
            "verify_s": v,
            "verify_share": v / (g + v) if g + v else 0.0,
            "generated": h["stats"]["generated"],
            "verified": h["stats"]["verified"],
        }
    g = sum(n["generate_s"] for n in nodes.values())
    v = sum(n["verify_s"] for n in nodes.values())
    return {
        "generate_s": g,
        "verify_s": v,
        "verify_share": v / (g + v) if g + v else 0.0,
        "answered": len(nodes),
        "nodes": nodes,
    }


def timing(m: Measured, steps: int) -> dict[str, Any]:
    """Step time and idle of one run (summarize's figures plus wall-clock per step)."""
    s = summarize(m.run)
    trained = read_metrics(m.run, "trainer")
    span = trained[-1]["time"] - trained[0]["time"]
    return {
        **s,
        "rl_s": m.rl_s,
        "wall_per_step_s": m.rl_s / steps,
        "steady_wall_per_step_s": span / (len(trained) - 1) if len(trained) > 1 else m.rl_s,
        "step_plus_idle_s": s["trainer_step_s"] + s["trainer_idle_s"],
        "idle_fraction": s["trainer_idle_fraction"],
        "machine_busy": m.machine_busy,
        "worker_versions": versions(m),
    }


def versions(m: Measured) -> list[int]:
    """The weights version each worker reported last (sorted): what it got over the swarm."""
    return sorted(n["weights_version"] for n in m.state["nodes"] if n["state"] != "banned")


def delivered(m: Measured, steps: int, level: int) -> dict[str, Any]:
    """Samples the trainer got (batch files) per second, start-up excluded and included."""
    sizes = [len(read_batch(m.run, n, level)[0].samples) for n in range(1, steps + 1)]
    written = [batch_path(m.run, n).stat().st_mtime for n in range(1, steps + 1)]
    span = written[-1] - written[0]
    made = read_metrics(m.run, "orchestrator")
    episodes = sum(r["episodes"] for r in made[1:])
    generating = sum(r["generate_s"] for r in made[1:])
    return {
        "samples": sum(sizes),
        "samples_per_s": sum(sizes[1:]) / span if span > 0 else 0.0,
        "samples_per_s_with_startup": sum(sizes) / m.rl_s,
        "episodes_per_s": episodes / span if span > 0 else 0.0,
        # The pool's own pace: samples over the orchestrator's generate + verify time
        # (its waits for a newer policy excluded), i.e. what the trainer could get at most.
        "pool_samples_per_s": sum(sizes[1:]) / generating if generating > 0 else 0.0,
        "batch_span_s": span,
        "first_batch_s": written[0] - m.wall0,
    }


def dishonesty(m: Measured, kinds: dict[str, str]) -> dict[str, Any]:
    """Bans (when, during which step), rejections and disputes of one run."""
    made = read_metrics(m.run, "orchestrator")
    by_name = {v: k for k, v in m.names.items()}
    nodes = {n["node_id"]: n for n in m.state["nodes"]}
    out = []
    for name, kind in kinds.items():
        node_id = by_name[name]
        mine = [v for v in m.verdicts if v["generator_id"] == node_id]
        lost = sorted(v["created_at"] for v in mine if v["kind"] == "dispute" and not v["accepted"])
        ban = m.banned.get(name)
        row: dict[str, Any] = {
            "name": name,
            "kind": kind,
            "state": nodes.get(node_id, {}).get("state"),
            "rollouts_generated": nodes.get(node_id, {}).get("generated"),
            "rejected_by_verifier": sum(
                1 for v in mine if v["kind"] == "verify" and not v["accepted"]
            ),
            "accepted": sum(1 for v in mine if v["accepted"]),
            "lost_disputes": len(lost),
            "banned_at_s": ban["t_s"] if ban else None,
            "last_lost_dispute_s": lost[-1] - m.wall0 if lost else None,
            "banned_during_step": (1 + sum(1 for r in made if r["time"] <= ban["time"]))
            if ban
            else None,
        }
        out.append(row)
    totals = m.state["totals"]
    honest_rejected = sum(
        1 for v in m.verdicts if not v["accepted"] and m.names.get(v["generator_id"], "d")[0] == "w"
    )
    return {
        "dishonest_nodes": out,
        "banned": sum(1 for r in out if r["banned_at_s"] is not None),
        "totals": {k: totals[k] for k in ("accepted", "verifications", "rejections", "disputes", "banned", "failed")},
        "honest_rollouts_rejected": honest_rejected,
    }  # fmt: skip


def add_ratios(rows: dict[int, dict[str, Any]], base: int) -> None:
    for r in rows.values():
        r["ratio_vs_async0"] = {
            k: (r[k] / rows[base][k] if rows[base][k] else None) for k in RATIO_KEYS
        }


# -- output ----------------------------------------------------------------------------


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_tables(console: Console, result: dict[str, Any]) -> None:
    a = result["args"]
    t = Table(
        title=f"async levels: {a['workers']} workers, {a['steps']} steps, weights over the swarm"
    )
    for col in ("async", "rl s", "wall s/step", "x0", "steady s/step", "x0", "step+idle s",
                "x0", "idle frac", "x0", "verify share"):  # fmt: skip
        t.add_column(col, justify="right")
    for level, r in result["async_levels"].items():
        q = r["ratio_vs_async0"]
        t.add_row(
            str(level), fmt(r["rl_s"], ".1f"),
            fmt(r["wall_per_step_s"]), fmt(q["wall_per_step_s"]),
            fmt(r["steady_wall_per_step_s"]), fmt(q["steady_wall_per_step_s"]),
            fmt(r["step_plus_idle_s"]), fmt(q["step_plus_idle_s"]),
            f"{r['idle_fraction']:.1%}", fmt(q["idle_fraction"]),
            f"{r['busy']['verify_share']:.1%}",
        )  # fmt: skip
    console.print(t)
    v = result["verify_share"]
    console.print(
        f"worker time spent verifying: {v['overall']:.1%} overall "
        f"({v['verify_s']:.1f} s of {v['verify_s'] + v['generate_s']:.1f} s over "
        f"{v['node_readings']} node readings; per node {v['per_node_min']:.1%}-{v['per_node_max']:.1%})"
    )
    t = Table(
        title=f"rollouts delivered, {a['pool_size']} workers, async {a['dishonest_level']}, "
        f"dishonest kind {a['dishonest_kind']}"
    )
    for col in ("dishonest", "samples/s", "x honest", "with start-up", "pool samples/s",
                "idle frac", "rejections", "disputes", "banned (s after start, step)",
                "verify share"):  # fmt: skip
        t.add_column(col, justify="right")
    for r in result["dishonest"]:
        bans = ", ".join(
            f"{d['name']} {fmt(d['banned_at_s'], '.1f')} s (step {d['banned_during_step']})"
            if d["banned_at_s"] is not None
            else f"{d['name']} not banned"
            for d in r["dishonest_nodes"]
        )
        t.add_row(
            f"{r['dishonest']}/{a['pool_size']} ({r['fraction']:.0%})",
            fmt(r["samples_per_s"], ".1f"), fmt(r["ratio_vs_honest"]),
            fmt(r["samples_per_s_with_startup"], ".1f"), fmt(r["pool_samples_per_s"], ".1f"),
            f"{r['idle_fraction']:.1%}", str(r["totals"]["rejections"]),
            str(r["totals"]["disputes"]), bans or "-", f"{r['busy']['verify_share']:.1%}",
        )  # fmt: skip
    console.print(t)


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_a, ax_v, ax_d) = plt.subplots(1, 3, figsize=(15, 4.2))
    levels = list(result["async_levels"])
    labels = {"wall_per_step_s": "wall/step", "steady_wall_per_step_s": "steady wall/step",
              "step_plus_idle_s": "step+idle", "idle_fraction": "idle fraction"}  # fmt: skip
    width = 0.8 / len(labels)
    for i, (k, label) in enumerate(labels.items()):
        ys = [result["async_levels"][lv]["ratio_vs_async0"][k] or 0 for lv in levels]
        ax_a.bar([j + i * width for j in range(len(levels))], ys, width, label=label)
    ax_a.set_xticks(
        [j + 0.4 - width / 2 for j in range(len(levels))], [f"async {lv}" for lv in levels]
    )
    ax_a.axhline(1, color="gray", lw=0.8)
    ax_a.set(title="ratio against async_level 0", ylabel="x async 0", ylim=(0, 1.35))
    ax_a.legend(fontsize=8, ncol=2, loc="upper right")

    runs = [(f"async {lv}", r["busy"]) for lv, r in result["async_levels"].items()]
    runs += [(f"{r['fraction']:.0%} dish.", r["busy"]) for r in result["dishonest"]]
    for j, (_, b) in enumerate(runs):
        ax_v.bar(j, 100 * b["verify_share"], color="tab:blue")
        shares = [100 * n["verify_share"] for n in b["nodes"].values()]
        ax_v.scatter([j] * len(shares), shares, color="black", s=8, zorder=3)
    ax_v.set_xticks(range(len(runs)), [name for name, _ in runs], rotation=30, fontsize=8)
    ax_v.set(title="worker time spent verifying (bar: all, dots: nodes)", ylabel="%")

    d = result["dishonest"]
    xs = range(len(d))
    bars = [("samples_per_s", "to the trainer (steady)", "tab:green"),
            ("pool_samples_per_s", "pool while generating", "tab:olive"),
            ("samples_per_s_with_startup", "to the trainer, start-up incl.", "tab:gray")]  # fmt: skip
    for i, (key, label, color) in enumerate(bars):
        ax_d.bar([x + (i - 1) * 0.27 for x in xs], [r[key] for r in d], 0.27, label=label,
                 color=color)  # fmt: skip
    top = max((r[key] for r in d for key, _, _ in bars), default=1.0) or 1.0
    for x, r in zip(xs, d, strict=True):
        bans = [n["banned_at_s"] for n in r["dishonest_nodes"] if n["banned_at_s"] is not None]
        if bans:
            high = max(r[key] for key, _, _ in bars)
            ax_d.text(x, high + 0.02 * top, "banned at\n" + ", ".join(f"{b:.0f}" for b in bans)
                      + " s", ha="center", va="bottom", fontsize=7)  # fmt: skip
    ax_d.set_xticks(list(xs), [f"{r['dishonest']} ({r['fraction']:.0%})" for r in d])
    ax_d.set_ylim(0, 1.5 * top)
    ax_d.set(title="samples delivered", xlabel="dishonest workers", ylabel="samples/s")
    ax_d.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


def git_state() -> dict[str, Any]:
    """The commit the children ran, and the files that differed from it (or {})."""

    def git(*a: str) -> str | None:
        res = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True)
        return res.stdout.rstrip() if res.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    if commit is None:
        return {}
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "*.py") or ""
    return {"commit": commit, "modified": [line[3:] for line in dirty.splitlines()]}


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "python": platform.python_version()}
    with contextlib.suppress(OSError):
        info["loadavg_at_start"] = list(os.getloadavg())
    return info


@contextlib.contextmanager
def workspace(keep: bool) -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(prefix="bench-net-"))
    try:
        yield work
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="RL steps per run")
    ap.add_argument("--levels", default="0,1,2,4", help="async levels (the first is the base)")
    ap.add_argument("--workers", type=int, default=4, help="pool size of the async runs")
    ap.add_argument("--pool-size", type=int, default=10, help="pool size of the dishonest runs")
    ap.add_argument("--dishonest", default="0,1,3", help="dishonest workers per run")
    ap.add_argument("--dishonest-kind", default="forged-proof",
                    help="tests.adversaries.DISHONEST_WORKERS kind(s), comma-separated: cycled")  # fmt: skip
    ap.add_argument("--dishonest-level", type=int, default=2, help="async level of those runs")
    ap.add_argument("--transport", choices=("swarm", "filesystem"), default="swarm")
    ap.add_argument("--sft-steps", type=int, default=None, help="SFT steps (default: config's)")
    ap.add_argument("--model", type=Path, default=None, help="an SFT model folder (skips SFT)")
    ap.add_argument("--out", type=Path, default=Path("tests/bench/results/network_cpu"))
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, DBs)")
    ap.add_argument("--wait-quiet-s", type=float, default=0,
                    help="wait up to S before each run for the box to be under 25%% busy")  # fmt: skip
    ap.add_argument("--replot", type=Path, default=None, help="redraw the table and PNG of X.json")
    args = ap.parse_args()
    if args.replot is not None:
        result = json.loads(args.replot.read_text())
        print_tables(Console(width=None if sys.stdout.isatty() else 170), result)
        plot(result, args.replot)
        return
    levels = [int(x) for x in args.levels.split(",")]
    counts = [int(x) for x in args.dishonest.split(",")]
    kinds = args.dishonest_kind.split(",")
    extra = SWARM if args.transport == "swarm" else ("--weights.transport", "filesystem")
    console = Console(width=None if sys.stdout.isatty() else 170)
    started = time.monotonic()
    info = machine_info()
    with workspace(args.keep) as work:
        if args.keep:
            console.print(f"work folder: {work}")
        sft_s = 0.0
        model = args.model
        if model is None:
            with console.status("SFT warm-up"):
                sft = ("--max-steps", str(args.sft_steps)) if args.sft_steps else ()
                model, sft_s = sft_warmup(work / "sft", *sft)
        async_rows: dict[int, dict[str, Any]] = {}
        for level in levels:
            quiet = wait_quiet(args.wait_quiet_s, console.log) if args.wait_quiet_s else None
            with console.status(f"async_level {level}, {args.workers} workers"):
                m = measure(
                    work / f"async{level}", model, level, args.steps, args.workers, [], extra
                )
            async_rows[level] = {
                **timing(m, args.steps),
                "busy": busy(m.health),
                "machine_busy_before": quiet,
            }
            console.print(f"async {level}: {m.rl_s:.1f} s")
        add_ratios(async_rows, levels[0])
        dishonest_rows: list[dict[str, Any]] = []
        for k in counts:
            cheats = [kinds[i % len(kinds)] for i in range(k)]
            quiet = wait_quiet(args.wait_quiet_s, console.log) if args.wait_quiet_s else None
            with console.status(f"{k} dishonest of {args.pool_size} workers"):
                m = measure(work / f"dishonest{k}", model, args.dishonest_level, args.steps,
                            args.pool_size, cheats, extra)  # fmt: skip
            t = timing(m, args.steps)
            dishonest_rows.append(
                {
                    "dishonest": k,
                    "fraction": k / args.pool_size,
                    "kinds": cheats,
                    **delivered(m, args.steps, args.dishonest_level),
                    "rl_s": m.rl_s,
                    "idle_fraction": t["idle_fraction"],
                    "steady_wall_per_step_s": t["steady_wall_per_step_s"],
                    "machine_busy": m.machine_busy,
                    "machine_busy_before": quiet,
                    "worker_versions": versions(m),
                    **dishonesty(m, {f"d{i}": kind for i, kind in enumerate(cheats)}),
                    "busy": busy(m.health),
                }
            )
            console.print(f"{k} dishonest: {m.rl_s:.1f} s")
    base = next((r for r in dishonest_rows if r["dishonest"] == 0), None)
    for r in dishonest_rows:
        r["ratio_vs_honest"] = (
            r["samples_per_s"] / base["samples_per_s"] if base and base["samples_per_s"] else None
        )
    readings = [b for r in [*async_rows.values(), *dishonest_rows] for b in [r["busy"]]]
    node_shares = [n["verify_share"] for b in readings for n in b["nodes"].values()]
    gen = sum(b["generate_s"] for b in readings)
    ver = sum(b["verify_s"] for b in readings)
    result = {
        "git": git_state(),
        "machine": info,
        "args": {
            **{k: v for k, v in vars(args).items() if k not in ("out", "model")},
            "model": str(args.model) if args.model else None,
        },  # fmt: skip
        "sft_s": sft_s,
        "bench_s": time.monotonic() - started,
        "async_levels": {str(k): v for k, v in async_rows.items()},
        "verify_share": {
            "overall": ver / (gen + ver) if gen + ver else 0.0,
            "generate_s": gen,
            "verify_s": ver,
            "node_readings": len(node_shares),
            "per_node_min": min(node_shares, default=0.0),
            "per_node_max": max(node_shares, default=0.0),
            "per_node_median": statistics.median(node_shares) if node_shares else 0.0,
        },
        "dishonest": dishonest_rows,
    }
    print_tables(console, result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, args.out)
    console.print(
        f"bench took {result['bench_s']:.0f} s; wrote {args.out.with_suffix('.json')} and "
        f"{args.out.with_suffix('.png')}"
    )


if __name__ == "__main__":
    main()
