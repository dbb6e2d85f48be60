"""The main job on one GPU, measured: `prime-trainer rl` through a local verifying pool, in
time slots, then one report of the whole run.

A device machine runs a command for at most 10 minutes, so the run goes in segments: each
call of this script runs (or, when the run directory already holds a run, continues with
`--ckpt.resume`) the same `rl` command for at most `--budget-s` seconds, stops it with
SIGTERM (the launcher stops every child and writes `summary.json`), keeps that segment's
summary in `<run_dir>/segments/`, and writes the report of everything so far:

- per step: mean reward (orchestrator), loss, trainer MFU and idle seconds (trainer), the
  pool's completion tokens per second while the orchestrator waited for that step;
- the trainer's wall clock per step split into waiting for a batch, the optimizer step, and
  the rest (gathering, writing and seeding the weights, checkpoints): the idle fraction
  (idle over idle + step) alone hides the last;
- the run: mean reward of the first and last fifth of the steps and their difference, pool
  tokens/s, trainer MFU and idle fraction, the share of worker time spent verifying
  (summed over segments: each worker reports its own busy seconds), rollouts accepted and
  rejected (summed over segments), nodes banned at the end;
- a table, `<out>.json` and `<out>.png` (reward, loss, pool tokens/s per step).

    python tests/bench/bench_rl_gpu.py --config configs/rl/reverse-text-smollm2-h200.toml \\
        --run-dir /opt/run --budget-s 540 --out tests/bench/results/rl_smollm2_h200

Extra `rl` flags go after `--`. Absolute figures count only on the GPU.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from protocol.processes import free_port  # noqa: E402
from trainer.monitor import read_metrics  # noqa: E402


def run_segment(
    config: Path, run_dir: Path, budget_s: float, extra: list[str], adversary: str = ""
) -> dict:
    """One slot of the run; returns its summary (also kept in `<run_dir>/segments/`).
    With `adversary`, a `tests.adversary_node` of that kind joins the local pool as soon
    as its scheduler answers (the scheduler on a fixed port, the node's key kept in the
    run directory, so a banned one stays banned in later segments)."""
    resume = (run_dir / "rollouts").exists()
    cmd = [sys.executable, "-m", "trainer.cli", "rl", "@", str(config)]
    cmd += ["--run-dir", str(run_dir), "--monitor.progress", "false", *extra]
    if resume:
        cmd += ["--ckpt.resume", "true"]
    port = free_port()
    if adversary:
        cmd += ["--local-swarm.scheduler-port", str(port)]
    segments = run_dir / "segments"
    segments.mkdir(parents=True, exist_ok=True)
    n = len(list(segments.glob("*.json")))
    log = segments / f"{n}.log"
    t0 = time.monotonic()
    cheat: subprocess.Popen | None = None
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        try:
            if adversary:
                cheat = start_adversary(config, run_dir, adversary, port, proc, n)
            proc.wait(timeout=max(1.0, budget_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # the launcher stops the pool and summarises
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        finally:
            if cheat is not None and cheat.poll() is None:
                cheat.terminate()
                cheat.wait(30)
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    summary.update(segment=n, resumed=resume, exit_code=proc.returncode)
    if cheat is not None:
        summary["adversary_exit_code"] = cheat.returncode  # 3: banned
    summary["segment_wall_s"] = round(time.monotonic() - t0, 1)
    (segments / f"{n}.json").write_text(json.dumps(summary, indent=2))
    summary_file.unlink(missing_ok=True)  # the next segment writes its own
    return summary


def start_adversary(
    config: Path, run_dir: Path, kind: str, port: int, run: subprocess.Popen, segment: int
) -> subprocess.Popen | None:
    """Start a dishonest node of `kind` against the run's local pool once the scheduler
    answers; None if the run ended first. It generates with the pool's engine mix."""
    import tomllib
    import urllib.request

    from protocol.identity import Identity

    cfg = tomllib.loads(config.read_text())
    ls = cfg.get("local_swarm", {})
    verification = tomllib.loads((ROOT / ls["verification"]).read_text())["verification"]
    (mix,) = verification["engine_mixes"]
    url = f"http://127.0.0.1:{port}"
    while run.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                break
        except OSError:
            time.sleep(2)
    else:
        return None
    home = (run_dir / "adversary" / f"segment{segment}").resolve()  # a newcomer each slot
    home.mkdir(parents=True, exist_ok=True)
    Identity.load_or_create(home / "node.key")  # trust() finds it even if the node fails
    cmd = [
        sys.executable, "-m", "tests.adversary_node", kind,
        "--pool", ls.get("pool_id", "local"), "--scheduler", url,
        "--key-file", str(home / "node.key"), "--operator", "adversary",
        "--server.port", str(free_port()), "--log-dir", str(home),
        "--weights.folder", str(home / "weights"), "--drain-timeout-s", "5",
        "--engine.kind", mix["engine"], "--engine.dtype", mix["dtype"],
        "--engine.device", mix["device"], *ls.get("worker_args", []),
    ]  # fmt: skip
    out = (home / "node.log").open("w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def trust(run_dir: Path) -> dict:
    """What the scheduler's database says about trust over the whole run: verdicts about
    honest workers' rollouts and how many rejected, and each adversary's fate (one per
    segment: its state, its rollouts rejected, accepting verdicts, rollouts released)."""
    import sqlite3

    from protocol.identity import Identity

    db = run_dir / "swarm" / "scheduler.db"
    if not db.is_file():
        return {}
    keys = sorted((run_dir / "adversary").glob("segment*/node.key"))
    cheats = {k.parent.name: Identity.load_or_create(k).node_id for k in keys}
    marks = ",".join("?" * len(cheats)) or "''"
    with sqlite3.connect(db) as conn:
        honest = conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(accepted = 0), 0) FROM verdicts "
            f"WHERE generator_id NOT IN ({marks})",
            list(cheats.values()),
        ).fetchone()
        out: dict = {"honest_verdicts": honest[0], "honest_rejections": honest[1]}
        for seg, cheat in cheats.items():
            state = conn.execute(
                "SELECT state, reason FROM nodes WHERE node_id = ?", (cheat,)
            ).fetchone()
            rejected, accepted = conn.execute(
                "SELECT COUNT(DISTINCT CASE WHEN accepted = 0 THEN request_id END), "
                "COALESCE(SUM(accepted = 1), 0) FROM verdicts WHERE generator_id = ?",
                (cheat,),
            ).fetchone()
            released = conn.execute(
                "SELECT COUNT(*) FROM results WHERE generator_id = ? AND status = 'accepted'",
                (cheat,),
            ).fetchone()[0]
            out.setdefault("adversaries", {})[seg] = {
                "state": state[0] if state else None,
                "reason": state[1] if state else None,
                "rollouts_rejected": rejected,
                "accepting_verdicts": accepted,
                "rollouts_released": released,
            }
    return out


def _fmean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def report(run_dir: Path, config: Path, device: str) -> dict:
    orch = read_metrics(run_dir, "orchestrator")
    train = {r["step"]: r for r in read_metrics(run_dir, "trainer")}
    segments = [
        json.loads(p.read_text())
        for p in sorted((run_dir / "segments").glob("*.json"), key=lambda p: int(p.stem))
    ]
    steps = []
    for o in orch:
        t = train.get(o["step"], {})
        steps.append(
            {
                "step": o["step"],
                "reward_mean": o["reward_mean"],
                "reward_std": o.get("reward_std"),
                "pool_tokens_per_s": o.get("pool_tokens_per_s"),
                "generate_s": o.get("generate_s"),
                "loss": t.get("loss"),
                "trainer_mfu": t.get("mfu"),
                "trainer_idle_s": t.get("idle_s"),
                "trainer_step_s": t.get("step_time_s"),
                "samples": o.get("samples"),
                "rollouts_generated": o.get("rollouts_generated"),
            }
        )
    rewards = [s["reward_mean"] for s in steps]
    fifth = max(1, len(rewards) // 5)
    first, last = _fmean(rewards[:fifth]), _fmean(rewards[-fifth:])
    trained = [train[k] for k in sorted(train)][1:]  # step 1 includes compile and warm-up
    idle = sum(r.get("idle_s", 0.0) for r in trained)
    busy = sum(r.get("step_time_s", 0.0) for r in trained)
    # The trainer's wall clock between logged steps: waiting for a batch (idle), the
    # optimizer step, and the rest (gathering, writing, signing and seeding the weights,
    # checkpoints), within one segment (a resume restarts the clock).
    walls = [
        (b["time"] - a["time"], b)
        for a, b in zip(trained, trained[1:], strict=False)
        if "time" in a and "time" in b and b["step"] == a["step"] + 1
    ]
    wall = sum(w for w, _ in walls)
    w_idle = sum(b.get("idle_s", 0.0) for _, b in walls)
    w_step = sum(b.get("step_time_s", 0.0) for _, b in walls)
    # What the trainer itself spent on weights and checkpoints (hand-off, waits, saves).
    w_weights = sum(b["weights_s"] for _, b in walls if "weights_s" in b)
    gen = sum(s.get("worker_generate_s", 0.0) for s in segments)
    ver = sum(s.get("worker_verify_s", 0.0) for s in segments)
    last_seg = segments[-1] if segments else {}
    tokens = sum(o.get("completion_tokens", 0) for o in orch)
    gen_wall = sum(o.get("generate_s", 0.0) for o in orch)
    made = sum(o.get("rollouts_generated", 0) for o in orch)
    evals = read_metrics(run_dir, "eval")
    return {
        "device": device,
        "config": str(config),
        "steps": len(steps),
        "segments": len(segments),
        "wall_s": sum(s.get("segment_wall_s", 0.0) for s in segments),
        "reward_first_fifth": first,
        "reward_last_fifth": last,
        "reward_gain": None if first is None or last is None else last - first,
        "pool_tokens_per_s": tokens / gen_wall if gen_wall else None,
        "trainer_mfu": _fmean([r["mfu"] for r in trained if "mfu" in r]),
        "trainer_tokens_per_s": _fmean([r["tokens_per_s"] for r in trained if "tokens_per_s" in r]),
        "trainer_idle_fraction": idle / (idle + busy) if busy else None,
        "trainer_wall_s_per_step": wall / len(walls) if walls else None,
        "trainer_wall_shares": {
            "idle": w_idle / wall,
            "step": w_step / wall,
            "weights_and_checkpoints": 1 - (w_idle + w_step) / wall,
        }
        if wall
        else None,
        "trainer_weights_share": w_weights / wall
        if wall and any("weights_s" in b for _, b in walls)
        else None,
        "trainer_publish_background_s": trained[-1].get("publish_s_total") if trained else None,
        "worker_generate_s": gen,
        "worker_verify_s": ver,
        "worker_verify_share": ver / (gen + ver) if gen + ver else None,
        # Each segment's scheduler counts its own (a resumed pool's counters start at 0).
        "rollouts": {
            k.removeprefix("rollouts_"): sum(seg.get(k, 0) for seg in segments)
            for k in last_seg
            if k.startswith("rollouts_")
        },
        "nodes_banned": last_seg.get("nodes_banned"),
        # Rollouts the trainer got over those the pool generated for it (issue 30).
        "trained_share": sum(o.get("samples", 0) for o in orch) / made if made else None,
        "evals": [
            {"version": e["step"], **{k: v for k, v in e.items() if k.startswith("eval")}}
            for e in evals
        ],
        "trust": trust(run_dir),
        "nodes": last_seg.get("nodes"),
        "per_step": steps,
        "per_segment": segments,
    }


def plot(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = res["per_step"]
    x = [s["step"] for s in steps]
    fig, (ax_r, ax_l, ax_t) = plt.subplots(1, 3, figsize=(14, 3.8))
    ax_r.plot(x, [s["reward_mean"] for s in steps], marker=".", lw=1)
    if res["reward_first_fifth"] is not None:
        n = max(1, len(x) // 5)
        ax_r.hlines(res["reward_first_fifth"], x[0], x[n - 1], colors="C1", label="first fifth")
        ax_r.hlines(res["reward_last_fifth"], x[-n], x[-1], colors="C2", label="last fifth")
        ax_r.legend()
    ax_r.set(title=f"mean reward per step ({res['device']})", xlabel="step", ylabel="reward")
    lx = [s["step"] for s in steps if s["loss"] is not None]
    ax_l.plot(lx, [s["loss"] for s in steps if s["loss"] is not None], marker=".", lw=1)
    ax_l.set(title="trainer loss", xlabel="step")
    ax_t.plot(x, [s["pool_tokens_per_s"] or 0 for s in steps], marker=".", lw=1)
    ax_t.set(title="pool completion tokens/s", xlabel="step", ylabel="tok/s")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def table(res: dict) -> Table:
    t = Table(title=f"RL through a verifying pool: {res['config']} on {res['device']}")
    t.add_column("figure")
    t.add_column("value", justify="right")
    rows = [
        ("steps (segments)", f"{res['steps']} ({res['segments']})"),
        ("wall s", f"{res['wall_s']:.0f}"),
        ("reward first fifth", _f(res["reward_first_fifth"])),
        ("reward last fifth", _f(res["reward_last_fifth"])),
        ("reward gain", _f(res["reward_gain"])),
        ("pool tokens/s", _f(res["pool_tokens_per_s"], ".0f")),
        ("trainer MFU", _f(res["trainer_mfu"], ".4f")),
        ("trainer idle fraction", _f(res["trainer_idle_fraction"])),
        ("trainer wall s per step", _f(res["trainer_wall_s_per_step"], ".2f")),
        (
            "trainer wall: idle / step / weights+ckpt",
            " / ".join(f"{v:.2f}" for v in (res["trainer_wall_shares"] or {}).values()) or "-",
        ),
        ("trainer wall on weights+ckpt (its own timer)", _f(res["trainer_weights_share"])),
        ("worker time verifying", _f(res["worker_verify_share"])),
        ("honest verdicts (rejected)", _trust(res["trust"])),
        ("adversaries", json.dumps(res["trust"].get("adversaries")) if res["trust"] else "-"),
        ("rollouts", ", ".join(f"{k} {v}" for k, v in res["rollouts"].items())),
        ("nodes banned", str(res["nodes_banned"])),
        ("trained / generated rollouts", _f(res["trained_share"])),
        (
            "eval reward per version",
            " ".join(
                f"v{e['version']}:{v:.2f}"
                for e in res["evals"]
                for k, v in e.items()
                if k.endswith("/reward_mean")
            )
            or "-",
        ),
    ]
    for row in rows:
        t.add_row(*row)
    return t


def _trust(t: dict) -> str:
    return f"{t['honest_verdicts']} ({t['honest_rejections']})" if t else "-"


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--config", type=Path, default=Path("configs/rl/reverse-text-smollm2-h200.toml")
    )
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=540.0, help="this segment's time slot")
    ap.add_argument("--out", type=Path, default=Path("tests/bench/results/rl_smollm2_h200"))
    ap.add_argument("--report-only", action="store_true", help="no segment: report the run")
    ap.add_argument("--device", default="", help="device name in the report ('': this one's)")
    ap.add_argument(
        "--adversary",
        default="",
        help="a tests.adversary_node kind that joins the pool in every segment (e.g. "
        "launder-noise; PRIME_LAUNDER_SCALE and the like pass through the environment)",
    )
    ap.add_argument("extra", nargs="*", help="extra `rl` flags (after --)")
    args = ap.parse_args()
    console = Console()
    if not args.report_only:
        seg = run_segment(args.config, args.run_dir, args.budget_s, args.extra, args.adversary)
        console.print(f"segment {seg['segment']}: {seg.get('outcome')} (exit {seg['exit_code']})")
    res = report(args.run_dir, args.config, args.device or device_name())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    if res["per_step"]:
        plot(res, args.out.with_suffix(".png"))
    console.print(table(res))
    console.print(f"wrote {args.out}.json and .png")


if __name__ == "__main__":
    main()
