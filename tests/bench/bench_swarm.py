"""Weight broadcast over the swarm: one trainer seed, N downloaders on loopback, swarm vs star.

Per run: a fresh temporary folder, a file of S random bytes, one `prime-trainer publish`
(the trainer's seed) and N `prime-node fetch` downloaders, each a separate process, every
one of them (seed included) capped at the same upload rate B. Two topologies:

- swarm: downloaders trade pieces with each other (they learn of each other from the
  seed by peer exchange) and keep seeding until the last one is done;
- star: `--swarm.share false`, pure leechers; only the trainer uploads. A leecher that has
  finished becomes a seed by design (`share` governs uploads while downloading only), so
  star downloaders are started with `--seed_after_s 0` and leave as soon as they are done:
  otherwise the first finished ones would help the rest and the star would not be a star.

Each process rewrites a JSON status file (`TorrentStatus`) every half second; everything
below is read from those files, not from logs:

- last done s: max over downloaders of `finished` minus min over downloaders of `started`
  (the time from the first torrent start to the last completion). All processes share one
  clock (one machine).
- x S/B: last done over the physical limit S/B (the trainer must upload every byte at least
  once at rate B). 1.0 is the limit for any N; a star needs about N x S/B. Per-message and
  start-up costs put even N = 1 a little above 1.
- x N=1: last done over the same topology's N = 1 time. Target for the swarm at N = 16:
  at most 1.5.
- trainer up /S: bytes the seed uploaded in that run (a fresh seed per run), in units of S.
  A star needs N; target for the swarm: at most 2 at any N.
- mean dl up /S: mean bytes each downloader uploaded, in units of S (0 in a star).
- identical: every downloaded file has the source's SHA-256 (else how many were missing or
  differed); bad: sum of `bad_pieces` (pieces that failed their hash) over all processes,
  which must be 0.
- start spread s: max minus min of the downloaders' `started` (process start-up skew: on a
  small box N processes importing libp2p at once start seconds apart; it is inside last
  done).
- CPU busy: fraction of the machine's CPU time in use while the downloaders ran
  (/proc/stat). Near 100% the figures measure the box, not the protocol: on the 2-core
  box 17 processes share two cores.
- others: the machine's CPU use over the whole run minus the share this run's own
  processes used (their rusage): other tenants of a shared box. Well above 0 means the
  run competed with something else (`--wait-quiet-s S` waits up to S before each run for
  the box to be under 25% busy).

    .venv/bin/python tests/bench/bench_swarm.py --out tests/bench/results/swarm_cpu
    .venv/bin/python tests/bench/bench_swarm.py --size-mib 4 --rate-mib 4 --ns 1,3 \
        --piece-kib 256 --out /tmp/swarm_tiny      # smoke (tests/integration)

Children run as `sys.executable -m trainer.cli publish` / `-m node.cli fetch` from the
repository root with the root on PYTHONPATH, so the bench also runs where the project is
not pip-installed (its dependencies importable). It never imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from protocol.identity import Identity  # noqa: E402
from protocol.processes import ManagedProcess, free_port  # noqa: E402

MiB = 2**20
SOURCE_NAME = "weights.bin"
POLL_S = 0.5
SEED_START_TIMEOUT_S = 120.0
SWARM_TIME_LIMIT = 1.5  # swarm last done at the largest N over N = 1
TRAINER_UPLOAD_LIMIT = 2.0  # swarm trainer upload over S, any N


# -- helpers -------------------------------------------------------------------------
def child_env() -> dict[str, str]:
    """The repository root first on PYTHONPATH (the project need not be installed)."""
    parts = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(parts), "OMP_NUM_THREADS": "1"}


def write_source(path: Path, size: int) -> str:
    """Write `size` random bytes to `path`; returns their SHA-256."""
    h = hashlib.sha256()
    with path.open("wb") as f:
        left = size
        while left:
            chunk = os.urandom(min(left, 4 * MiB))
            h.update(chunk)
            f.write(chunk)
            left -= len(chunk)
    return h.hexdigest()


def sha256_file(path: Path) -> str | None:
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


def read_status(path: Path) -> dict[str, Any] | None:
    """The last status a process wrote (atomically replaced), or None before the first."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def cpu_times() -> tuple[int, int] | None:
    """(total, idle) jiffies of the whole machine, or None off Linux."""
    try:
        vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return sum(vals), vals[3] + vals[4]


def cpu_busy(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    if before is None or after is None or after[0] <= before[0]:
        return None
    return 1 - (after[1] - before[1]) / (after[0] - before[0])


def wait_quiet(
    timeout_s: float, show: Callable[[str], None], busy_below: float = 0.25
) -> float | None:
    """Wait up to `timeout_s` for the machine to be under `busy_below` busy (2 s samples of
    all cores, /proc/stat); returns the last sample (None off Linux)."""
    deadline = time.monotonic() + timeout_s
    while True:
        before = cpu_times()
        time.sleep(2.0)
        busy = cpu_busy(before, cpu_times())
        if busy is None or busy < busy_below or time.monotonic() >= deadline:
            return busy
        show(f"machine {100 * busy:.0f}% busy (other tenants): waiting for a quieter moment")


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process so far, or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def children_cpu_s() -> float | None:
    """CPU seconds of every reaped child of this process so far (Unix), or None."""
    try:
        import resource
    except ImportError:
        return None
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def stop_all(procs: list[ManagedProcess]) -> None:
    """SIGTERM every child at once, then wait for each (SIGKILL after the grace)."""
    for p in procs:
        if p.alive():
            p.proc.terminate()
    for p in procs:
        p.stop(grace_s=10)


def git_state() -> dict[str, Any]:
    """The commit the children ran and whether the swarm code had local edits (or {})."""

    def git(*a: str) -> str | None:
        try:
            res = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True)
        except OSError:
            return None
        return res.stdout.strip() if res.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    if commit is None:
        return {}
    dirty = git("status", "--porcelain", "--", "protocol", "node", "trainer")
    return {"commit": commit, "swarm_code_dirty": bool(dirty)}


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
    }
    with contextlib.suppress(AttributeError):
        info["cpu_affinity"] = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError):
        info["loadavg_at_start"] = list(os.getloadavg())
    return info


# -- one run -------------------------------------------------------------------------
class RunFailed(Exception):
    pass


def start_seed(
    source: Path,
    key: Path,
    run_dir: Path,
    piece_size: int,
    rate: float,
    env: dict[str, str],
    procs: list[ManagedProcess],
    step: int = 0,
) -> tuple[ManagedProcess, str]:
    """`prime-trainer publish` of `source` (a file or folder) capped at `rate`, added to
    `procs` (the caller stops them); returns it and its full multiaddr once it seeds."""
    port = free_port()
    seed_status = run_dir / "seed.json"
    seed = ManagedProcess.start(
        "seed",
        [
            sys.executable, "-m", "trainer.cli", "publish",
            "--source", str(source),
            "--step", str(step),
            "--trainer_key", str(key),
            "--swarm.piece_size", str(piece_size),
            "--swarm.upload_rate", str(rate),
            "--swarm.listen", json.dumps([f"/ip4/127.0.0.1/tcp/{port}"]),
            "--status_file", str(seed_status),
            "--progress", "false",
        ],
        "",
        run_dir / "seed.log",
        cwd=REPO,
        env=env,
        wait=False,
    )  # fmt: skip
    procs.append(seed)
    deadline = time.time() + SEED_START_TIMEOUT_S
    while read_status(seed_status) is None:
        if not seed.alive():
            raise RunFailed(f"seed exited with {seed.proc.returncode}:\n{seed.log_tail(1500)}")
        if time.time() > deadline:
            raise RunFailed(f"seed wrote no status in {SEED_START_TIMEOUT_S:.0f} s")
        time.sleep(0.1)
    return seed, f"/ip4/127.0.0.1/tcp/{port}/p2p/{Identity.load_or_create(key).node_id}"


def run_once(
    args: argparse.Namespace,
    topology: str,
    n: int,
    source: Path,
    source_sha: str,
    work: Path,
    show: Callable[[str], None],
) -> dict[str, Any]:
    """One seed and `n` downloaders in a fresh folder; the row for (topology, n)."""
    size, rate = source.stat().st_size, args.rate_mib * MiB
    ideal_s = size / rate
    run_dir = Path(tempfile.mkdtemp(prefix=f"{topology}{n}-", dir=work))
    env = child_env()
    procs: list[ManagedProcess] = []
    row: dict[str, Any] = {"topology": topology, "n": n, "ok": False, "reason": None}
    t0, cpu_run0, own0 = time.time(), cpu_times(), children_cpu_s()
    try:
        src = run_dir / SOURCE_NAME
        try:
            os.link(source, src)
        except OSError:
            shutil.copyfile(source, src)
        trainer_key = run_dir / "keys" / "trainer.key"
        trainer_id = Identity.load_or_create(trainer_key).node_id
        show(f"{topology} N={n}: starting the seed")
        seed, seed_addr = start_seed(
            src, trainer_key, run_dir, args.piece_kib * 1024, rate, env, procs
        )
        seed_status = run_dir / "seed.json"  # written by the seed (start_seed)
        manifest = src.with_name(src.name + ".manifest")
        # Swarm downloaders serve each other until killed at the end; star ones leave when
        # done (a finished leecher would otherwise seed the rest).
        extra = ["--swarm.share", "false"] if topology == "star" else []
        linger = "0" if topology == "star" else str(args.timeout_s + 600)
        dl_status = [run_dir / f"d{i}.json" for i in range(n)]
        cpu0, launched = cpu_times(), time.time()
        for i in range(n):
            procs.append(
                ManagedProcess.start(
                    f"d{i}",
                    [
                        sys.executable, "-m", "node.cli", "fetch",
                        "--manifest", str(manifest),
                        "--trusted_key", trainer_id,
                        "--peers", json.dumps([seed_addr]),
                        "--dest", str(run_dir / f"d{i}"),
                        "--key_file", str(run_dir / "keys" / f"d{i}.key"),
                        "--swarm.upload_rate", str(rate),
                        "--status_file", str(dl_status[i]),
                        "--progress", "false",
                        "--seed_after_s", linger,
                        *extra,
                    ],
                    "",
                    run_dir / f"d{i}.log",
                    cwd=REPO,
                    env=env,
                    wait=False,
                )
            )  # fmt: skip
        downloaders = procs[1:]
        deadline = launched + args.timeout_s
        while True:
            statuses = [read_status(p) for p in dl_status]
            done = sum(bool(s and s["complete"]) for s in statuses)
            have = sum((s["total"] - s["left"]) if s else 0 for s in statuses)
            show(
                f"{topology} N={n}: {done}/{n} done, {have / MiB:.0f}/{n * size / MiB:.0f} MiB,"
                f" {time.time() - launched:.1f} s (S/B = {ideal_s:.1f} s)"
            )
            if done == n:
                break
            if not seed.alive():
                raise RunFailed(f"seed exited with {seed.proc.returncode}:\n{seed.log_tail(1500)}")
            for p, path in zip(downloaders, dl_status, strict=True):
                if not p.alive():
                    s = read_status(path)  # its last write precedes its exit
                    if not (s and s["complete"]):
                        raise RunFailed(
                            f"{p.name} exited with {p.proc.returncode} before completing:\n"
                            f"{p.log_tail(1500)}"
                        )
            if time.time() > deadline:
                lagging = {
                    f"d{i}": (f"{s['have']}/{s['pieces']} pieces, {len(s['peers'])} peers" if s else "no status")
                    for i, s in enumerate(statuses)
                    if not (s and s["complete"])
                }  # fmt: skip
                raise RunFailed(f"timeout after {args.timeout_s} s, {done}/{n} done: {lagging}")
            time.sleep(POLL_S)
        cpu1, all_done = cpu_times(), time.time()
        # Let every process write its final counters (they rewrite every 0.5 s).
        time.sleep(2.5 * POLL_S)
        seed_cpu_s = process_cpu_s(seed.proc.pid)
        load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        seed_s = read_status(seed_status)
        statuses = [read_status(p) for p in dl_status]
        stop_all(procs)
        assert seed_s is not None and all(statuses)
        started = [s["started"] for s in statuses]
        finished = [s["finished"] for s in statuses]
        t_start = min(started)
        done_s = [f - t_start for f in finished]
        shas = [sha256_file(run_dir / f"d{i}" / SOURCE_NAME) for i in range(n)]
        # What a downloader left on disk: the final folder, a `.partial` one, or nothing.
        on_disk = [
            [f for f in (f"d{i}", f"d{i}.partial") if (run_dir / f).is_dir()] for i in range(n)
        ]
        row.update(
            ok=True,
            last_done_s=max(done_s),
            first_done_s=min(done_s),
            median_done_s=statistics.median(done_s),
            ratio_to_ideal=max(done_s) / ideal_s,
            ratio_to_n1=None,  # filled in once the N = 1 run is known
            trainer_upload_S=seed_s["uploaded"] / size,
            mean_downloader_upload_S=statistics.fmean(s["uploaded"] for s in statuses) / size,
            max_downloader_upload_S=max(s["uploaded"] for s in statuses) / size,
            identical=all(sha == source_sha for sha in shas),
            bad_pieces=seed_s["bad_pieces"] + sum(s["bad_pieces"] for s in statuses),
            errors=[e for s in [seed_s, *statuses] for e in s["errors"]],
            start_spread_s=max(started) - t_start,
            cpu_busy=cpu_busy(cpu0, cpu1),
            load1_at_end=load1,
            seed_cpu_s=seed_cpu_s,
            downloaders_wall_s=all_done - launched,
            downloaders=[
                {
                    "done_s": d,
                    "started_s": s["started"] - t_start,
                    "downloaded_S": s["downloaded"] / size,
                    "uploaded_S": s["uploaded"] / size,
                    "peers_seen": len(s["per_peer"]),
                    "from_seed_S": s["per_peer"].get(trainer_id, {}).get("downloaded", 0) / size,
                    "bad_pieces": s["bad_pieces"],
                    "identical": sha == source_sha,
                    "file": "missing" if sha is None else "ok" if sha == source_sha else "differs",
                    "folders": folders,
                }
                for d, s, sha, folders in zip(done_s, statuses, shas, on_disk, strict=True)
            ],
        )
    except RunFailed as exc:
        row["reason"] = str(exc)
    except Exception as exc:  # a bench bug or a malformed status file: record, go on
        row["reason"] = f"{type(exc).__name__}: {exc}"
    finally:
        stop_all(procs)  # reaps every child: their CPU time lands in RUSAGE_CHILDREN
        row["run_wall_s"] = wall = time.time() - t0
        # The whole run (seed start to the last child stopped): the machine's CPU use, and
        # the share of it this run's processes used; the rest is other tenants of the box.
        row["machine_busy_run"] = busy = cpu_busy(cpu_run0, cpu_times())
        own1 = children_cpu_s()
        row["children_cpu_s"] = own = None if own0 is None or own1 is None else own1 - own0
        share = None if own is None else own / (wall * (os.cpu_count() or 1))
        row["own_cpu_share_run"] = share
        row["others_cpu_share_run"] = (
            None if busy is None or share is None else max(busy - share, 0.0)
        )
        if args.keep:
            row["kept"] = str(run_dir)
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    return row


# -- summary -------------------------------------------------------------------------
def fill_ratios(rows: list[dict[str, Any]]) -> None:
    n1 = {r["topology"]: r["last_done_s"] for r in rows if r["n"] == 1 and r["ok"]}
    for r in rows:
        if r["ok"] and r["topology"] in n1:
            r["ratio_to_n1"] = r["last_done_s"] / n1[r["topology"]]


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    swarm = {r["n"]: r for r in rows if r["topology"] == "swarm"}
    out: dict[str, Any] = {}
    if not swarm:
        return out
    n_max = max(swarm)
    ratio = swarm[n_max].get("ratio_to_n1") if n_max != 1 else None
    out["swarm_time_max_n_over_n1"] = {
        "what": f"swarm last done at N = {n_max} over N = 1",
        "n": n_max,
        "measured": ratio,
        "limit": SWARM_TIME_LIMIT,
        "met": ratio is not None and ratio <= SWARM_TIME_LIMIT,
    }
    per_n = {n: (r["trainer_upload_S"] if r["ok"] else None) for n, r in swarm.items()}
    known = [v for v in per_n.values() if v is not None]
    worst = max(known) if known and len(known) == len(per_n) else None
    out["swarm_trainer_upload_over_S"] = {
        "what": "largest trainer upload over S among the swarm runs (a star needs N)",
        "per_n": per_n,
        "measured": worst,
        "limit": TRAINER_UPLOAD_LIMIT,
        "met": worst is not None and worst <= TRAINER_UPLOAD_LIMIT,
    }
    return out


def checks(rows: list[dict[str, Any]]) -> dict[str, bool]:
    ok = [r for r in rows if r["ok"]]
    return {
        "all_complete": len(ok) == len(rows),
        "all_identical": all(r["identical"] for r in ok) and len(ok) == len(rows),
        "no_bad_pieces": all(r["bad_pieces"] == 0 for r in ok),
    }


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def identical_cell(r: dict[str, Any]) -> str:
    """'yes', or how many files were missing / differed."""
    if r["identical"]:
        return "yes"
    bad = [d["file"] for d in r["downloaders"] if d["file"] != "ok"]
    kinds = ", ".join(f"{bad.count(k)} {k}" for k in sorted(set(bad)))
    return f"[red]NO: {kinds}[/red]"


def print_table(console: Console, rows: list[dict[str, Any]], title: str) -> None:
    table = Table(title=title)
    table.add_column("topology")
    for col in ("N", "last done s", "x S/B", "x N=1", "trainer up/S", "mean dl up/S"):
        table.add_column(col, justify="right")
    for col in ("identical", "bad", "start spread s", "CPU busy", "others"):
        table.add_column(col, justify="right")
    for r in rows:
        if not r["ok"]:
            reason = (r["reason"] or "").splitlines()[0][:60]
            table.add_row(r["topology"], str(r["n"]), f"[red]FAILED: {reason}[/red]")
            continue
        table.add_row(
            r["topology"],
            str(r["n"]),
            fmt(r["last_done_s"], ".1f"),
            fmt(r["ratio_to_ideal"]),
            fmt(r["ratio_to_n1"]),
            fmt(r["trainer_upload_S"]),
            fmt(r["mean_downloader_upload_S"]),
            identical_cell(r),
            str(r["bad_pieces"]),
            fmt(r["start_spread_s"], ".1f"),
            pct(r["cpu_busy"]),
            pct(r["others_cpu_share_run"]),
        )
    console.print(table)


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, rows = result["config"], result["rows"]
    ideal = cfg["size_mib"] / cfg["rate_mib"]
    all_n = sorted({r["n"] for r in rows}) or [1]
    fig, (ax_t, ax_u) = plt.subplots(1, 2, figsize=(11, 4))
    for topo, marker in (("swarm", "o"), ("star", "s")):
        ok = sorted((r for r in rows if r["topology"] == topo and r["ok"]), key=lambda r: r["n"])
        if ok:
            ns = [r["n"] for r in ok]
            ax_t.plot(ns, [r["last_done_s"] for r in ok], marker=marker, label=topo)
            ax_u.plot(ns, [r["trainer_upload_S"] for r in ok], marker=marker, label=topo)
    ax_t.axhline(ideal, color="grey", ls="--", label="S/B (limit)")
    ax_t.plot(all_n, [n * ideal for n in all_n], color="grey", ls=":", label="N x S/B (star)")
    ax_t.set(
        title=f"last downloader done (S = {cfg['size_mib']} MiB, B = {cfg['rate_mib']} MiB/s)",
        xlabel="downloaders N",
        ylabel="s",
    )
    ax_u.axhline(TRAINER_UPLOAD_LIMIT, color="red", ls="--", label="2 x S (target)")
    ax_u.plot(all_n, all_n, color="grey", ls=":", label="N x S (star)")
    ax_u.set(title="trainer (seed) upload", xlabel="downloaders N", ylabel="bytes / S")
    for ax in (ax_t, ax_u):
        ax.set_xticks(all_n)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


# -- main ----------------------------------------------------------------------------
def parse_ns(text: str) -> list[int]:
    ns = [int(x) for x in text.split(",") if x.strip()]
    if not ns or min(ns) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers like 1,4,8")
    return ns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=64, help="S: bytes broadcast, in MiB")
    ap.add_argument("--rate-mib", type=float, default=8.0, help="B: every node's upload cap")
    ap.add_argument("--ns", type=parse_ns, default=parse_ns("1,4,8,16"), help="downloaders")
    ap.add_argument("--star-ns", type=parse_ns, default=None, help="N for the star (def. --ns)")
    ap.add_argument("--topologies", default="swarm,star")
    ap.add_argument("--piece-kib", type=int, default=1024)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    ap.add_argument("--out", type=Path, default=Path("tests/bench/results/swarm_cpu"))
    ap.add_argument("--keep", action="store_true", help="keep each run's folder (logs, status)")
    ap.add_argument(
        "--wait-quiet-s",
        type=float,
        default=0.0,
        help="before each run, wait up to this for the machine to be under 25%% busy",
    )
    args = ap.parse_args()
    topologies = [t.strip() for t in args.topologies.split(",") if t.strip()]
    if bad := set(topologies) - {"swarm", "star"}:
        ap.error(f"unknown topologies {sorted(bad)}: use swarm,star")
    # Wide enough for the table when the output is a file or a pipe (rich assumes 80).
    console = Console(width=None if sys.stdout.isatty() else 140)
    info = machine_info()
    config = {
        "size_mib": args.size_mib,
        "rate_mib": args.rate_mib,
        "ideal_s": args.size_mib / args.rate_mib,
        "ns": args.ns,
        "star_ns": args.star_ns or args.ns,
        "topologies": topologies,
        "piece_kib": args.piece_kib,
        "timeout_s": args.timeout_s,
        "wait_quiet_s": args.wait_quiet_s,
    }
    console.print(
        f"S = {args.size_mib} MiB, B = {args.rate_mib} MiB/s (S/B = {config['ideal_s']:.1f} s),"
        f" pieces {args.piece_kib} KiB, {info['cpu_count']} CPUs, load {info.get('loadavg_at_start')}"
    )
    work = Path(tempfile.mkdtemp(prefix="bench-swarm-"))
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    try:
        source = work / SOURCE_NAME
        source_sha = write_source(source, args.size_mib * MiB)
        for topo in topologies:
            for n in config["star_ns"] if topo == "star" else args.ns:
                with console.status(f"{topo} N={n}") as status:
                    show = status.update
                    busy_before = wait_quiet(args.wait_quiet_s, show) if args.wait_quiet_s else None
                    row = run_once(args, topo, n, source, source_sha, work, show)
                row["busy_before"] = busy_before
                rows.append(row)
                if row["ok"]:
                    console.print(
                        f"{topo:5} N={n:<3} last done {row['last_done_s']:6.1f} s"
                        f" ({row['ratio_to_ideal']:.2f} x S/B), trainer up"
                        f" {row['trainer_upload_S']:.2f} S, identical {row['identical']}, CPU busy"
                        f" {pct(row['cpu_busy'])} (others {pct(row['others_cpu_share_run'])})"
                    )
                else:
                    console.print(f"[red]{topo} N={n} failed:[/red] {row['reason']}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    fill_ratios(rows)
    result = {
        "config": config,
        "machine": info,
        "git": git_state(),
        "bench_wall_s": time.time() - t0,
        "rows": rows,
        "targets": targets(rows),
        "checks": checks(rows),
    }
    print_table(
        console,
        rows,
        f"Swarm broadcast: S = {args.size_mib} MiB, B = {args.rate_mib} MiB/s per node,"
        f" {info['cpu_count']} CPUs",
    )
    for name, t in result["targets"].items():
        mark = "[green]met[/green]" if t["met"] else "[red]NOT met[/red]"
        console.print(
            f"target {name}: {t['what']} = {fmt(t['measured'])} (limit {t['limit']}) {mark}"
        )
    console.print(f"checks: {result['checks']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, args.out)
    console.print(
        f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}"
        f" in {result['bench_wall_s']:.0f} s"
    )


if __name__ == "__main__":
    main()
