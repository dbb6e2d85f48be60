#!/usr/bin/env python
"""Trainer scaling benchmark: tokens/s, MFU and scaling efficiency of one RL step on N ranks.

What it measures: the project's real `Trainer.step(samples, "rl")` (trainer/train.py; the
AIPO loss, gradient clipping, AdamW, as in tests/bench/bench_trainer.py) run under
`torchrun --standalone --nproc-per-node=N` on one host, for every N of `--ranks`. With
N > 1 the trainer shards the policy with FSDP2 itself (`apply_fsdp`: every decoder layer,
then the root; bf16 parameters, fp32 gradient reduction); with N = 1 it trains one
unsharded process under bf16 autocast on fp32 master weights (trainer/parallel.py: a
single rank is never wrapped in FSDP), so the scaling efficiency compares what a user
gets on N GPUs against what the same trainer does on one.

Per N: the median time of `--steps` steps after `--warmup` steps, each step timed on
rank 0 between two (cuda synchronize + dist.barrier) points, so the step is over on every
rank. tokens/s = global tokens per step / median step time. MFU per GPU = bench_trainer's
formula, (6 x N_params + 12 x layers x hidden x seq_len) x tokens/s / ranks / 989e12
(N_params from `build_model`, the same count as the trainer's `_matmul_params`, which
the JSON carries next to it, with the trainer's own `mfu` metric). Scaling efficiency =
tokens/s(N) / (N x tokens/s(1)). Each row also keeps the loss and gradient norm of the
first step and the peak memory of every rank (CUDA: max_memory_allocated while the model
loads and, reset after that, during the steps; CPU: peak RSS).

Invariants: every N trains the same weights and the same global batch: the parent builds
the random Qwen2 (bench_trainer's `build_model`, on CPU, fixed seed) once into a temporary
folder that every rank of every run loads (`ModelConfig.name`), and every rank builds the
same global batch (bench_trainer's `make_samples`, fixed seed) and passes all of it to
`Trainer.step`, which takes this rank's share itself (pack_samples, then split_for_rank
deals the packed rows round-robin: rank r trains rows r, r + N, ...; the loss is
normalised by the loss tokens of all ranks). So the first-step loss and gradient norm
must agree across N (exactly in fp32 on CPU; within bf16 tolerance on GPU, where N = 1
runs under autocast and N > 1 under FSDP2 mixed precision). Only rank 0 writes the
run's result (a JSON file the parent reads); the parent writes the report.

Defaults of the real run: Qwen2-1.5B shape (hidden 1536, 28 layers, vocab 151936, tied
embeddings; bf16 compute as bench_trainer), samples of 4096 tokens (one per micro-batch,
the trainer's defaults: eager, micro_batch_rows 1), 2 warm-up and 6 timed steps, ranks
"1,2". The global batch is 4 x N_max samples, N_max the largest N that runs (e.g. 8 x 4096
tokens for "1,2"; 32 x 4096 for "1,2,4,8"), so that every N trains the same global batch
and the largest N still gets 4 samples per rank, as bench_trainer's one GPU does. On CUDA
an N above torch.cuda.device_count() is recorded as "skipped: only K GPUs".

    python tests/bench/bench_trainer_ranks.py                          # 1 and 2 H200s
    python tests/bench/bench_trainer_ranks.py --ranks 1,2,4,8          # an 8-GPU host
    python tests/bench/bench_trainer_ranks.py --ranks 1,2,4,8 --rows 4 --compile --warmup 3
    python tests/bench/bench_trainer_ranks.py --replot tests/bench/results/trainer_ranks.json
    .venv/bin/python tests/bench/bench_trainer_ranks.py --tiny --out /tmp/trainer_ranks_tiny

`--tiny` is a CPU smoke mode: bench_trainer's tiny Qwen2 (hidden 64, 2 layers, vocab
1024), ranks "1,2" on gloo (the backend follows the device; OMP_NUM_THREADS=1), 128
tokens per sample, 1 warm-up and 2 timed steps. Its figures are only smoke (the JSON meta
says so): they show that every N runs, trains the same batch (equal first-step loss) and
reports positive figures. Absolute tokens/s, MFU and efficiency count only on GPUs.

Outputs: a rich table (one row per N), <out>.json and <out>.png (tokens/s and efficiency
against N); default stem tests/bench/results/trainer_ranks. `--worker` is the mode each
torchrun rank runs in; it is started by the parent, not by hand.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from bench_trainer import (  # noqa: E402
    PEAK_FLOPS,
    QWEN2_1_5B,
    REPO_ROOT,
    RESULTS_DIR,
    TINY,
    build_model,
    console,
    flops_per_token,
    make_samples,
    peak_rss_gib,
    sync,
    versions,
)
from rich.table import Table  # noqa: E402

SCRIPT = Path(__file__).resolve()


# --- Worker: one torchrun rank -----------------------------------------------------------
def worker(args: argparse.Namespace) -> int:
    """Train `--warmup` + `--steps` steps with the real Trainer; rank 0 writes the result."""
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    from trainer.config import ModelConfig, MonitorConfig, TrainerConfig
    from trainer.parallel import end_rank, is_distributed
    from trainer.train import Trainer

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    shape = TINY if args.tiny else QWEN2_1_5B
    cfg = TrainerConfig(
        run_dir=args.run_dir,
        device=args.device,
        seed=args.seed,
        max_steps=100_000,
        micro_batch_tokens=args.seq,  # one sample per packed row, as bench_trainer
        micro_batch_rows=args.rows,
        model=ModelConfig(name=str(args.model_dir), compile=args.compile),
        monitor=MonitorConfig(progress=False, plot=False),
        peak_flops=PEAK_FLOPS,
    )
    t0 = time.perf_counter()
    trainer = Trainer(cfg)  # joins the process group under torchrun; FSDP2 when world > 1
    setup_s = time.perf_counter() - t0
    device, rank, world = trainer.device, trainer.rank, trainer.world
    cuda = device.type == "cuda"
    mem: dict[str, Any] = {"rank": rank}
    if cuda:
        mem["peak_mem_load_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    # The same global batch on every rank: Trainer.step takes this rank's share itself.
    samples = make_samples(args.samples, args.seq, shape["vocab_size"], args.prompt, args.seed)

    def barrier() -> None:
        sync(device)
        if is_distributed():
            dist.barrier()

    first: dict = {}
    warm_times: list[float] = []
    times: list[float] = []
    for i in range(args.warmup + args.steps):
        barrier()
        t = time.perf_counter()
        m = trainer.step(samples, "rl")
        barrier()
        (warm_times if i < args.warmup else times).append(time.perf_counter() - t)
        if i == 0:  # same weights and global batch for every N: these must agree
            first = {"first_loss": m["loss"], "first_grad_norm": m["grad_norm"]}
        if rank == 0:
            print(f"ranks {world} step {i + 1}: {times[-1] if times else warm_times[-1]:.3f} s")
    if cuda:
        mem["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        mem["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    mem["peak_rss_gib"] = peak_rss_gib()
    mem["micro_batches"] = m["micro_batches"]
    per_rank = [mem]
    if is_distributed():
        per_rank = [None] * world
        dist.all_gather_object(per_rank, mem)
    if rank == 0:
        result = {
            "ranks": world,
            "fsdp_applied": bool(trainer.fsdp),
            "backend": dist.get_backend() if is_distributed() else None,
            "device": device.type,
            "device_name": torch.cuda.get_device_name(device)
            if cuda
            else f"CPU x{os.cpu_count()} ({platform.machine()})",
            "compute_dtype": str(trainer.dtype),
            "trainer_matmul_params": trainer.flops_params,
            "setup_s": setup_s,
            "warmup_times_s": warm_times,
            "step_times_s": times,
            **first,
            "loss": m["loss"],
            "grad_norm": m["grad_norm"],
            "tokens_per_step": m["tokens"],
            "loss_tokens_per_step": m["loss_tokens"],
            "trainer_mfu": m["mfu"],
            "trainer_step_time_s": m["step_time_s"],
            "per_rank": per_rank,
        }
        Path(args.result).write_text(json.dumps(result, indent=1, default=str) + "\n")
    trainer.monitor.close()
    if is_distributed():
        end_rank(0)
    return 0


# --- Parent: one torchrun per N ----------------------------------------------------------
def worker_argv(args: argparse.Namespace, n: int, tmp: Path, model_dir: Path) -> list[str]:
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
        str(SCRIPT), "--worker",
        "--model-dir", str(model_dir), "--result", str(tmp / f"result_{n}.json"),
        "--run-dir", str(tmp / f"run_{n}"), "--device", args.device,
        "--seq", str(args.seq), "--samples", str(args.samples), "--prompt", str(args.prompt),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed),
        "--rows", str(args.rows),
    ]  # fmt: skip
    return argv + (["--tiny"] if args.tiny else []) + (["--compile"] if args.compile else [])


def child_env(args: argparse.Namespace) -> dict[str, str]:
    path = os.pathsep.join(x for x in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if x)
    env = {**os.environ, "PYTHONPATH": path}
    if args.device == "cpu":
        # gloo ranks (the backend follows TrainerConfig.device): one thread each.
        env.update(OMP_NUM_THREADS="1")
    return env


def launch(args: argparse.Namespace, n: int, tmp: Path, model_dir: Path) -> dict:
    """Run N ranks under torchrun; the row of N (status ok, or the error and log tail)."""
    row: dict[str, Any] = {"ranks": n, "status": "ok"}
    log_path = tmp / f"log_{n}.txt"
    console.print(f"[bold]{n} rank(s)[/]: torchrun --nproc-per-node={n}")
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            worker_argv(args, n, tmp, model_dir), cwd=REPO_ROOT, env=child_env(args),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            rc = proc.wait(timeout=args.run_timeout_s)
        except subprocess.TimeoutExpired:
            # torchrun (its own session); its ranks die with it (trainer.parallel).
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    row["wall_s"] = time.perf_counter() - t0
    result = tmp / f"result_{n}.json"
    if rc != 0 or not result.exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        why = f"timed out after {args.run_timeout_s:.0f} s" if rc is None else f"rc={rc}"
        row.update(status=f"error: {why}", log_tail=tail)
        console.print(f"  [red]failed ({why})[/]:\n{tail[-1500:]}")
        return row
    row.update(json.loads(result.read_text()))
    t = statistics.median(row["step_times_s"])
    tps = row["tokens_per_step"] / t
    row.update(
        step_time_s=t,
        step_time_min_s=min(row["step_times_s"]),
        tokens_per_s=tps,
        mfu=args.flops_per_token * tps / n / PEAK_FLOPS,
    )
    console.print(f"  step {t * 1e3:.0f} ms  {tps:,.0f} tok/s  MFU {row['mfu'] * 100:.2f}%")
    return row


def add_efficiency(rows: list[dict]) -> None:
    """Scaling efficiency = tokens/s(N) / (N x tokens/s(1)), where N = 1 ran."""
    one = next((r for r in rows if r["ranks"] == 1 and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] == "ok":
            r["efficiency"] = (
                r["tokens_per_s"] / (r["ranks"] * one["tokens_per_s"]) if one else None
            )


def peak_gib(row: dict) -> float | None:
    """The largest peak over the ranks: CUDA allocated during the steps, else RSS."""
    per = row.get("per_rank") or []
    vals = [p.get("peak_mem_gib", p.get("peak_rss_gib")) for p in per]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def print_table(report: dict) -> None:
    m = report["meta"]
    t = Table(
        title=f"trainer RL step over ranks: {m['shape_name']}, {m['global_samples_per_step']} x "
        f"{m['seq_len']} tokens per step, {m['device_name']}"
        + (" (smoke only)" if m["smoke_only"] else "")
    )
    mem_col = "peak GiB/rank" if m["device"] == "cuda" else "peak RSS GiB/rank"
    cols = ("ranks", "status", "tokens/s", "MFU %/GPU", "efficiency", "step ms", "loss@1",
            "gn@1", mem_col)  # fmt: skip
    for col in cols:
        t.add_column(col, justify="left" if col == "status" else "right")
    for r in report["runs"]:
        if r["status"] != "ok":
            t.add_row(str(r["ranks"]), r["status"], *[""] * (len(cols) - 2))
            continue
        eff, mem = r.get("efficiency"), peak_gib(r)
        t.add_row(
            str(r["ranks"]),
            r["status"] + ("" if r["ranks"] == 1 or r["fsdp_applied"] else " (no FSDP?)"),
            f"{r['tokens_per_s']:,.0f}",
            f"{r['mfu'] * 100:.2f}",
            f"{eff:.3f}" if eff is not None else "",
            f"{r['step_time_s'] * 1e3:.0f}",
            f"{r['first_loss']:.6f}",
            f"{r['first_grad_norm']:.4f}",
            f"{mem:.2f}" if mem is not None else "",
        )
    console.print(t)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["runs"] if r["status"] == "ok"]
    if not ok:
        return
    ns = [r["ranks"] for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    axes[0].plot(ns, [r["tokens_per_s"] for r in ok], "o-", label="measured")
    one = next((r for r in ok if r["ranks"] == 1), None)
    if one:
        axes[0].plot(ns, [n * one["tokens_per_s"] for n in ns], "--", c="gray", label="N x 1 rank")
    axes[0].set_ylabel("tokens/s (global)")
    axes[0].legend(fontsize=8)
    eff = [(r["ranks"], r["efficiency"]) for r in ok if r.get("efficiency") is not None]
    if eff:
        axes[1].plot([e[0] for e in eff], [e[1] for e in eff], "o-", c="tab:green")
        for n, e in eff:
            axes[1].annotate(f"{e:.2f}", (n, e), textcoords="offset points", xytext=(4, 4))
    axes[1].axhline(1.0, c="gray", ls="--")
    axes[1].set_ylim(0, max([1.1] + [e[1] * 1.1 for e in eff]))
    axes[1].set_ylabel("scaling efficiency  tok/s(N) / (N x tok/s(1))")
    for a in axes:
        a.set_xlabel("ranks N")
        a.set_xticks(ns)
        a.grid(alpha=0.3)
    m = report["meta"]
    fig.suptitle(
        f"trainer RL step, FSDP2 over N ranks: {m['shape_name']}, {m['global_samples_per_step']}"
        f" x {m['seq_len']} tokens, {m['device_name']}"
        + ("  (smoke only: CPU)" if m["smoke_only"] else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_all(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cuda = args.device == "cuda"
    n_gpu = torch.cuda.device_count() if cuda else None  # NVML: no CUDA context here
    runnable = [n for n in args.ranks if not cuda or n <= n_gpu]
    args.samples = args.samples or 4 * max(runnable, default=1)
    shape = TINY if args.tiny else QWEN2_1_5B
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    report: dict[str, Any] = {"meta": {}, "runs": []}
    with tempfile.TemporaryDirectory(prefix="bench-trainer-ranks-") as tmp_s:
        tmp = Path(tmp_s)
        model_dir = tmp / "model"
        t0 = time.perf_counter()
        # On CPU, once: the parent stays off the GPUs, and every run loads the same weights.
        params = build_model(model_dir, shape, torch.device("cpu"), args.seed)
        build_s = time.perf_counter() - t0
        args.flops_per_token = flops_per_token(params, shape, args.seq)
        meta = report["meta"] = {
            "bench": "trainer_ranks",
            "schema": 1,
            "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "argv": sys.argv,
            "device": args.device,
            "device_name": None,  # from rank 0 of the first run that finishes
            "gpus_visible": n_gpu,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            **{f"version_{k}": v for k, v in versions().items()},
            "smoke_only": args.tiny,
            "note": (
                "tiny CPU/gloo smoke run: only the presence, positivity and agreement of the "
                "figures mean anything; absolute numbers count only on GPUs"
                if args.tiny
                else "absolute numbers count only on GPUs"
            ),
            "shape_name": "tiny Qwen2" if args.tiny else "Qwen2-1.5B shape (random init)",
            "shape": shape,
            "params": params,
            "ranks_asked": args.ranks,
            "seq_len": args.seq,
            "global_samples_per_step": args.samples,
            "global_tokens_per_step": args.samples * args.seq,
            "global_batch_rule": "4 x the largest N that runs, the same for every N",
            "batch_split": (
                "every rank passes the whole global batch to Trainer.step; pack_samples then "
                "split_for_rank deal the packed rows round-robin (rank r: rows r, r+N, ...)"
            ),
            "prompt_tokens_masked": args.prompt,
            "micro_batch_rows": args.rows,
            "compile": args.compile,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "flops_per_token": args.flops_per_token,
            "peak_flops_per_gpu": PEAK_FLOPS,
            "mfu_formula": (
                "(6*N_params + 12*layers*hidden*seq_len) * tokens_per_s / ranks / 989e12 "
                "(bench_trainer's formula, per GPU)"
            ),
            "efficiency_formula": "tokens_per_s(N) / (N * tokens_per_s(1))",
            "model_build_s": build_s,
        }
        out_json = args.out.with_suffix(".json")

        def save() -> None:
            add_efficiency(report["runs"])
            meta["wall_s"] = time.perf_counter() - t_start
            out_json.write_text(json.dumps(report, indent=1, default=str) + "\n")

        for n in args.ranks:
            if n not in runnable:
                report["runs"].append({"ranks": n, "status": f"skipped: only {n_gpu} GPUs"})
                continue
            row = launch(args, n, tmp, model_dir)
            if row["status"] == "ok" and meta["device_name"] is None:
                meta["device_name"] = row["device_name"]
            report["runs"].append(row)
            save()
    meta["device_name"] = meta["device_name"] or args.device
    save()
    print_table(report)
    plot(report, args.out.with_suffix(".png"))
    console.print(f"wrote {out_json} and {args.out.with_suffix('.png')}")
    return 0 if any(r["status"] == "ok" for r in report["runs"]) else 1


# --- Main --------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = ap.add_argument
    add("--tiny", action="store_true", help="tiny model, 128 tokens, 2 steps, CPU/gloo (smoke)")
    add("--ranks", help="comma-separated rank counts N (default 1,2)")
    add("--device", default="auto", help="cpu | cuda | auto (tiny: cpu)")
    add("--seq", type=int, help="tokens per sample (default 4096; tiny 128)")
    add("--samples", type=int, help="global samples per step (default 4 x the largest N)")
    add("--prompt", type=int, help="masked prompt tokens per sample (default seq/16)")
    add("--steps", type=int, help="timed steps per N (default 6; tiny 2)")
    add("--warmup", type=int, help="warm-up steps per N (default 2; tiny 1)")
    add("--rows", type=int, default=1, help="TrainerConfig.micro_batch_rows (default 1)")
    add("--compile", action="store_true", help="ModelConfig.compile (per-layer torch.compile)")
    add("--seed", type=int, default=0)
    add("--run-timeout-s", type=float, default=900.0, help="give one N's torchrun this long")
    add("--out", type=Path, help="output stem (default tests/bench/results/trainer_ranks)")
    add("--replot", type=Path, help="only print the table and redraw the PNG of this JSON")
    # the worker mode, started by the parent under torchrun
    add("--worker", action="store_true", help=argparse.SUPPRESS)
    add("--model-dir", type=Path, help=argparse.SUPPRESS)
    add("--result", type=Path, help=argparse.SUPPRESS)
    add("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    tiny = args.tiny
    if args.device == "auto":
        args.device = "cpu" if tiny or not torch.cuda.is_available() else "cuda"
    if args.compile and args.device == "cpu":
        ap.error("--compile needs CUDA here (CPU inductor builds take minutes)")
    args.ranks = sorted({int(x) for x in (args.ranks or "1,2").split(",") if x.strip()})
    if not args.ranks or min(args.ranks) < 1:
        ap.error("--ranks needs positive integers")
    args.seq = args.seq or (128 if tiny else 4096)
    args.prompt = args.prompt if args.prompt is not None else args.seq // 16
    args.steps = args.steps or (2 if tiny else 6)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 2)
    args.out = args.out or RESULTS_DIR / "trainer_ranks"
    if args.worker and not (args.model_dir and args.result and args.run_dir and args.samples):
        ap.error("--worker needs --model-dir, --result, --run-dir and --samples")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.replot:
        report = json.loads(args.replot.read_text())
        print_table(report)
        plot(report, args.replot.with_suffix(".png"))
        return 0
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
