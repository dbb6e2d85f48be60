#!/usr/bin/env python
"""Trainer benchmark: MFU, tokens/s and peak memory of one RL optimizer step, side by side.

What one step is: the project's real `Trainer.step(samples, "rl")` (trainer/train.py):
pack the samples into micro-batches of `micro_batch_tokens`, forward every micro-batch
through `PolicyModel` (hidden states -> `chunked_logprobs` over the vocabulary, never the
full [tokens, vocab] logits), `aipo_loss` with random advantages and workers' logprobs mu,
backward, gradient clipping, fused AdamW. The model is a Qwen2-1.5B-shaped
`Qwen2ForCausalLM` (hidden 1536, 28 layers, MLP 8960, 12 heads, 2 KV heads, vocab 151936,
tied embeddings, rope theta 1e6) with random weights, built from a `Qwen2Config` in code
and saved to a temporary folder that `ModelConfig.name` points at: no hub download.
Each step trains on `--samples` sequences of `--seq` tokens (default 4 x 4096, bf16).

Variants (all in one process, one after the other; warm-up steps excluded, then
`--steps` steps each timed between two `torch.cuda.synchronize()`; the median counts).
Every trainer variant runs the trainer core as it is, through `TrainerConfig` only (no
run-time patches): one process trains unsharded (no FSDP) under bf16 autocast on fp32
master weights, TF32 on, `chunked_logprobs` in bf16 with fused elementwise work.

- `hf_baseline`: plain Hugging Face, the reference: `model(input_ids).logits` ->
  cross-entropy, fp32 master weights under bf16 autocast, sdpa, fused AdamW, clipping,
  no compile, one 4096-token sequence per micro-batch; `hf_baseline_batched`: the 4
  samples as one [4, 4096] batch.
- `trainer_default`: `Trainer` as its defaults build it on one GPU (eager, no activation
  checkpointing, logprob chunk 4096, micro_batch_rows 1: one [1, 4096] micro-batch per
  sample).
- `trainer_compile` (+ `model.compile`: torch.compile per decoder layer),
  `trainer_rows4` (eager, `micro_batch_rows=4`: the 4 samples as ONE [4, 4096]
  micro-batch), `trainer_tuned` (compile + `micro_batch_rows=4`, chunk 4096), and
  variations of it: activation checkpointing, chunk 1024, sdpa preferring cuDNN, and 4
  samples packed per 16384-token row (transformers then builds a block-diagonal mask and
  sdpa loses its causal kernel).

`--profile NAMES` runs one more step of those variants under torch.profiler and keeps GPU
kernel time by kind, the top kernels and the top CPU ops (not counted in the timings).
Every row also keeps the loss and gradient norm of its first step: all variants start
from the same weights and batch, so these must agree (the HF rows use plain CE).

Besides the steps, `logprob_micro` times `chunked_logprobs` alone (forward + backward
on one 4096-token micro-batch), with the weight in bf16 (as under FSDP2) or fp32 under
autocast (one process), chunk 1024 and 4096, next to the floor of its three unavoidable
[T, H] x [H, V] matmuls.

MFU (the issue's formula): (6 x N + 12 x layers x hidden x seq_len) x tokens / step time /
989e12, seq_len being each sample's length (4096). N = parameters that take part in a
matmul per token = all parameters - input embedding + the LM head (vocab x hidden). With
tied embeddings the head IS the embedding matrix used as a matmul, so N = all (unique)
parameters: 1,543,714,304 for this shape (embedding 233,373,696 counted once, as the
head). That is the same N as the trainer's own `mfu` metric (`_matmul_params`), which the
JSON also carries (`trainer_mfu`; it times the step inside `Trainer.step`). The 12 x L x
H x S attention term counts the full (non-causal) score matrix, as the issue does.
Tokens/s counts every token of the step; peak memory is `torch.cuda.max_memory_allocated`
from the variant's start (model, optimizer state and activations).

`--tiny` is a CPU smoke mode: a tiny Qwen2 (hidden 64, 2 layers, vocab 1024), 2 samples x
128 tokens, 1 warm-up and 2 timed steps; compile variants are recorded as skipped. Only
its presence and positivity of figures mean anything (MFU against an H100 peak on a CPU is
meaningless).

Outputs: a rich table, <out>.json and <out>.png (default stem
tests/bench/results/trainer_h200 on CUDA, tests/bench/results/trainer_cpu otherwise).

    python tests/bench/bench_trainer.py                      # one H200: every variant
    python tests/bench/bench_trainer.py --no-micro --time-budget-s 300 --variants ...
    python tests/bench/bench_trainer.py --variants hf_baseline,trainer_tuned --profile trainer_tuned
    .venv/bin/python tests/bench/bench_trainer.py --tiny --out /tmp/trainer_tiny
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
RESULTS_DIR = HERE / "results"
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

console = Console(width=None if sys.stdout.isatty() else 200)
PEAK_FLOPS = 989e12  # dense bf16 of one H100/H200 SXM, as the issue and the trainer use
TARGET_MFU = 0.55
VERSIONS_OF = ("torch", "transformers", "triton", "pydantic", "pydantic-settings", "safetensors")

QWEN2_1_5B = dict(
    hidden_size=1536,
    num_hidden_layers=28,
    intermediate_size=8960,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    rope_theta=1e6,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    tie_word_embeddings=True,
    rope_theta=1e6,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


# --- Variants --------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    name: str
    desc: str
    kind: str = "trainer"  # "trainer": Trainer.step; "hf": plain HF logits + CE
    compile: bool = False
    ac: bool = False
    chunk: int = 4096  # LossConfig.logprob_chunk
    packed_samples: int = 1  # samples per packed row (micro_batch_tokens = n x seq)
    attn: str = "default"  # "default": sdpa's own choice; "cudnn": cuDNN attention first
    rows: int = 1  # rows per micro-batch (trainer: micro_batch_rows; HF: batch size)


TUNED = dict(compile=True, rows=4)

VARIANTS: list[Variant] = [
    Variant("hf_baseline", "plain HF: logits -> CE, fp32 master + bf16 autocast, eager", "hf"),
    Variant("hf_baseline_batched", "plain HF, the 4 samples as one [4, 4096] batch", "hf", rows=4),
    Variant("trainer_default", "Trainer defaults: 1 GPU, no FSDP, eager, chunk 4096, rows 1"),
    Variant("trainer_compile", "defaults + compile per layer", compile=True),
    Variant("trainer_rows4", "defaults + micro_batch_rows=4 (one [4, 4096] forward)", rows=4),
    Variant("trainer_tuned", "compile, micro_batch_rows=4, chunk 4096", **TUNED),
    Variant("trainer_tuned_ac", "trainer_tuned + activation checkpointing", **TUNED, ac=True),
    Variant(
        "trainer_tuned_rows8",
        "compile, micro_batch_rows=8 (run with --samples 8)",
        compile=True,
        rows=8,
    ),
    Variant("trainer_tuned_chunk1024", "trainer_tuned, logprob chunk 1024", **TUNED, chunk=1024),
    Variant("trainer_tuned_cudnn_attn", "trainer_tuned, sdpa prefers cuDNN", **TUNED, attn="cudnn"),
    Variant(
        "trainer_packed16k",
        "compile, 4 samples packed per 16384-token row (block-diagonal mask)",
        compile=True,
        packed_samples=4,
    ),
]


# --- Helpers ---------------------------------------------------------------------------
def attn_backend(kind: str, device: torch.device) -> contextlib.AbstractContextManager:
    """sdpa backend preference for a whole variant ('cudnn': cuDNN first, then flash)."""
    if kind == "default" or device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return sdpa_kernel(order, set_priority=True)


def set_tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    from trainer.loss import COMPILED

    COMPILED.clear()


def build_model(folder: Path, shape: dict, device: torch.device, seed: int) -> dict:
    """Write a random Qwen2 of `shape` (bf16 safetensors) and a tokenizer to `folder`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verifier.models import build_tiny_tokenizer

    cfg = Qwen2Config(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    unique = {id(p): p for p in model.parameters()}
    n_all = sum(p.numel() for p in unique.values())
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    model.to(torch.bfloat16).save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)  # only pad/bos ids are read by the trainer
    del model
    n_embed = embed.numel()
    head = cfg.vocab_size * cfg.hidden_size
    n_matmul = n_all - n_embed + head  # tied: = n_all (the embedding counted once, as the head)
    return {
        "parameters_unique": n_all,
        "embedding": n_embed,
        "lm_head_matmul": head,
        "tied": tied,
        "matmul_params_N": n_matmul,
    }


def flops_per_token(params: dict, shape: dict, seq: int) -> float:
    """The MFU numerator per token: 6 x N (N = `build_model`'s matmul parameters) plus the
    full attention score matrix, 12 x layers x hidden x seq_len."""
    return (
        6 * params["matmul_params_N"] + 12 * shape["num_hidden_layers"] * shape["hidden_size"] * seq
    )


def make_samples(n: int, seq: int, vocab: int, prompt: int, seed: int):
    from trainer.batch import TrainingSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (seq,), generator=g).tolist()
        mask = [False] * prompt + [True] * (seq - prompt)
        # mu near a random model's logprob (-log V) so ratios stay near 1, as in real RL
        mu = (torch.randn(seq, generator=g) * 0.5 - float(torch.tensor(vocab).log())).tolist()
        mu = [m if keep else 0.0 for m, keep in zip(mu, mask, strict=True)]
        adv = float(torch.randn((), generator=g))
        out.append(TrainingSample(ids, mask, mu, adv))
    return out


@dataclass
class Ctx:
    device: torch.device
    model_dir: Path
    tmp: Path
    samples: list
    seq: int
    warmup: int
    steps: int
    compile_warmup: int
    flops_per_token: float
    profile: tuple[str, ...] = ()


def time_steps(ctx: Ctx, step: Callable[[], dict], warmup: int, profile: bool = False) -> dict:
    t0 = time.perf_counter()
    metrics: dict = {}
    first: dict = {}
    for i in range(warmup):
        metrics = step()
        sync(ctx.device)
        if i == 0:  # same weights, same batch in every variant: these must agree
            first = {"first_loss": metrics["loss"], "first_grad_norm": metrics["grad_norm"]}
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(ctx.steps):
        sync(ctx.device)
        t = time.perf_counter()
        metrics = step()
        sync(ctx.device)
        times.append(time.perf_counter() - t)
    out = {"warmup_s": warm_s, "step_times_s": times, "last_metrics": metrics, **first}
    if profile:
        out["profile"] = profile_step(step, ctx.device)
    return out


KERNEL_KINDS = (  # first match wins
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("optimizer", ("adam",)),
    ("nccl/fsdp copies", ("nccl", "chunk_cat", "split_with_sizes", "foreach_copy", "memcpy")),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "sm90", "ampere_bf16", "cublas")),
    ("triton (compiled)", ("triton",)),
)


def profile_step(step: Callable[[], dict], device: torch.device) -> dict:
    """One more step under torch.profiler: GPU kernel time by kind, top kernels and CPU ops.

    GPU busy time below the (unprofiled) step time means the GPU waits on the host."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        step()
        sync(device)
    wall = time.perf_counter() - t
    ev = prof.key_averages()
    # Device-side records only (kernels, memcpys): CPU ops also carry their kernels' device
    # time, and CUPTI's "Command Buffer Full" marks a full launch queue, not GPU work.
    per_kernel: dict[str, list] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.name == "Command Buffer Full":
            continue
        acc = per_kernel.setdefault(e.name, [0.0, 0])
        acc[0] += e.device_time_total / 1e3
        acc[1] += 1
    gpu = [(name, ms, n) for name, (ms, n) in per_kernel.items()]
    kinds: dict[str, float] = {}
    for name, ms, _ in gpu:
        low = name.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(x in low for x in keys)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + ms
    cpu = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {
        "profiled_wall_ms": wall * 1e3,
        "gpu_busy_ms": sum(ms for _, ms, _ in gpu),
        "gpu_ms_by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "top_kernels": [
            {"name": n[:120], "ms": ms, "count": c}
            for n, ms, c in sorted(gpu, key=lambda g: -g[1])[:15]
        ],
        "top_cpu_ops": [
            {"name": e.key[:120], "self_cpu_ms": e.self_cpu_time_total / 1e3, "count": e.count}
            for e in cpu
        ],
    }


def run_trainer(v: Variant, ctx: Ctx) -> dict:
    from trainer.config import LossConfig, ModelConfig, MonitorConfig, TrainerConfig
    from trainer.train import Trainer

    cfg = TrainerConfig(
        run_dir=ctx.tmp / f"run_{v.name}",
        device=ctx.device.type,
        max_steps=100_000,
        micro_batch_tokens=ctx.seq * v.packed_samples,
        micro_batch_rows=v.rows,
        model=ModelConfig(
            name=str(ctx.model_dir), compile=v.compile, activation_checkpointing=v.ac
        ),
        loss=LossConfig(logprob_chunk=v.chunk),
        monitor=MonitorConfig(progress=False, plot=False),
    )
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    setup_s = time.perf_counter() - t0
    warm = ctx.compile_warmup if v.compile else ctx.warmup
    res = time_steps(ctx, lambda: trainer.step(ctx.samples, "rl"), warm, v.name in ctx.profile)
    m = res.pop("last_metrics")
    res.update(
        setup_s=setup_s,
        fsdp_applied=bool(trainer.fsdp),
        loss=m["loss"],
        grad_norm=m["grad_norm"],
        trainer_mfu=m["mfu"],
        trainer_step_time_s=m["step_time_s"],
        micro_batches=m["micro_batches"],
    )
    return res


def run_hf(v: Variant, ctx: Ctx) -> dict:
    from trainer.config import ModelConfig
    from trainer.model import load_model

    t0 = time.perf_counter()
    hf, _ = load_model(ModelConfig(name=str(ctx.model_dir)), ctx.device)
    if v.compile:
        for layer in hf.model.layers:
            layer.compile()
    cuda = ctx.device.type == "cuda"
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, fused=cuda)
    rows = []
    for s in ctx.samples:
        ids = torch.tensor([s.input_ids], device=ctx.device)
        tgt = torch.tensor(s.input_ids[1:] + [0], device=ctx.device)
        keep = torch.tensor(s.loss_mask[1:] + [False], device=ctx.device)
        rows.append((ids, torch.where(keep, tgt, -100)))
    rows = [
        (
            torch.cat([r[0] for r in rows[i : i + v.rows]]),
            torch.cat([r[1] for r in rows[i : i + v.rows]]),
        )
        for i in range(0, len(rows), v.rows)
    ]
    n_loss = sum(int((t >= 0).sum()) for _, t in rows)
    setup_s = time.perf_counter() - t0
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext

    def step() -> dict:
        hf.train()
        total = torch.zeros((), device=ctx.device)
        for ids, tgt in rows:
            with amp():
                logits = hf(input_ids=ids, use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt, reduction="sum") / n_loss
            loss.backward()
            total += loss.detach()
            del logits
        gn = torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"loss": total.item(), "grad_norm": gn.item()}

    warm = ctx.compile_warmup if v.compile else ctx.warmup
    res = time_steps(ctx, step, warm, v.name in ctx.profile)
    m = res.pop("last_metrics")
    res.update(setup_s=setup_s, loss=m["loss"], grad_norm=m["grad_norm"], micro_batches=len(rows))
    return res


def run_variant(v: Variant, ctx: Ctx, skip: str | None) -> dict:
    row: dict[str, Any] = {**asdict(v), "status": "ok"}
    if skip:
        row.update(status="skipped", error=skip)
        return row
    cleanup(ctx.device)
    cuda = ctx.device.type == "cuda"
    if cuda:
        set_tf32(False)  # the HF rows run without TF32; `Trainer` turns it on itself
        torch.cuda.reset_peak_memory_stats(ctx.device)
        row["mem_at_start_gib"] = torch.cuda.memory_allocated(ctx.device) / 2**30
    console.print(f"[bold]{v.name}[/]: {v.desc}")
    try:
        with attn_backend(v.attn, ctx.device):
            res = run_hf(v, ctx) if v.kind == "hf" else run_trainer(v, ctx)
    except Exception as exc:  # one failing variant (OOM, compile error) must not end the run
        row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:2000])
        console.print(f"  [red]failed[/]: {row['error'][:400]}")
        traceback.print_exc()
        return row
    finally:
        if cuda:
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(ctx.device) / 2**30
            set_tf32(False)
        else:
            row["peak_rss_gib"] = peak_rss_gib()
        cleanup(ctx.device)
    times = res["step_times_s"]
    t = statistics.median(times)
    tokens = len(ctx.samples) * ctx.seq
    row.update(res)
    row.update(
        step_time_s=t,
        step_time_min_s=min(times),
        tokens_per_step=tokens,
        tokens_per_s=tokens / t,
        mfu=ctx.flops_per_token * tokens / t / PEAK_FLOPS,
    )
    console.print(
        f"  step {t * 1e3:.0f} ms  {row['tokens_per_s']:,.0f} tok/s  MFU {row['mfu'] * 100:.1f}%"
        + (f"  peak {row['peak_mem_gib']:.1f} GiB" if cuda else "")
    )
    return row


# --- logprob micro-benchmark ------------------------------------------------------------
def bench_logprob(device: torch.device, hidden: int, vocab: int, tokens: int, reps: int) -> list:
    """chunked_logprobs fwd+bwd alone on one micro-batch, per dtype set-up and chunk."""
    from trainer.loss import chunked_logprobs

    g = torch.Generator(device=device).manual_seed(0)
    w32 = (torch.randn(vocab, hidden, device=device, generator=g) * 0.02).requires_grad_()
    w16 = w32.detach().to(torch.bfloat16).requires_grad_()
    h32 = torch.randn(tokens, hidden, device=device, generator=g).requires_grad_()
    h16 = h32.detach().to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    adv = torch.randn(tokens, device=device, generator=g)

    def timed(fn: Callable[[], None]) -> float:
        for _ in range(2):
            fn()
        sync(device)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            sync(device)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e3

    rows = []
    cases = [
        ("bf16 weight (FSDP2)", h16, w16, False),
        ("fp32 weight + autocast (no FSDP)", h32, w32, True),
    ]
    for setup, h, w, amp in cases:
        for chunk in (1024, 4096):

            def fn(h=h, w=w, amp=amp, chunk=chunk) -> None:
                ctxm = (
                    torch.autocast(device.type, dtype=torch.bfloat16)
                    if amp
                    else contextlib.nullcontext()
                )
                with ctxm:
                    logp, _ent = chunked_logprobs(h, w, y, 1.0, chunk)
                (logp * adv).sum().backward()
                h.grad = w.grad = None

            try:
                ms = timed(fn)
            except Exception as exc:
                rows.append({"impl": "core", "setup": setup, "error": repr(exc)[:300]})
                continue
            rows.append({"impl": "core", "setup": setup, "chunk": chunk, "ms": ms})
    # floor: the three [T,H]x[H,V] bf16 matmuls the head needs (fwd, dgrad, wgrad) + recompute
    a, b = h16.detach(), w16.detach()

    def floor() -> None:
        zz = a @ b.t()
        _ = zz @ b
        _ = zz.t() @ a

    rows.append({"impl": "matmul floor (fwd, dgrad, wgrad)", "setup": "bf16", "ms": timed(floor)})
    flop = 2 * tokens * hidden * vocab
    for r in rows:
        if "ms" in r:
            r["head_matmul_tflops_equiv"] = 3 * flop / (r["ms"] / 1e3) / 1e12
    del w32, w16, h32, h16
    return rows


# --- Output -----------------------------------------------------------------------------
def all_rows(report: dict) -> list[dict]:
    """The run's variants, then those of a follow-up run merged in (names marked ' (run 2)')."""
    extra = report.get("followup", {}).get("variants", [])
    return report["variants"] + [{**r, "name": f"{r['name']} (run 2)"} for r in extra]


def print_table(report: dict) -> None:
    hf_ok = [r for r in report["variants"] if r["kind"] == "hf" and r["status"] == "ok"]
    base = next((r for r in hf_ok if r["name"] == "hf_baseline"), hf_ok[0] if hf_ok else None)
    t = Table(
        title=f"trainer step: {report['meta']['shape_name']} on {report['meta']['device_name']}"
    )
    for col in (
        "variant",
        "what",
        "step ms",
        "tokens/s",
        "MFU %",
        "trainer mfu %",
        "peak GiB",
        f"x {base['name']}" if base else "x HF",
        "loss@1 / gn@1",
    ):
        t.add_column(col, justify="left" if col in ("variant", "what") else "right")
    for r in all_rows(report):
        if r["status"] != "ok":
            t.add_row(r["name"], r["desc"], r["status"], "", "", "", "", "", "")
            continue
        mem = r.get("peak_mem_gib", r.get("peak_rss_gib"))
        t.add_row(
            r["name"],
            r["desc"],
            f"{r['step_time_s'] * 1e3:.0f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['mfu'] * 100:.1f}",
            f"{r['trainer_mfu'] * 100:.1f}" if r.get("trainer_mfu") is not None else "",
            f"{mem:.1f}" if mem is not None else "",
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "",
            f"{r['first_loss']:.4f} / {r['first_grad_norm']:.2f}" if "first_loss" in r else "",
        )
    console.print(t)
    if "followup" in report:
        console.print(f"(run 2): {report['followup'].get('note', 'a follow-up run')}")
    for r in all_rows(report):
        if prof := r.get("profile"):
            if "gpu_busy_ms" not in prof:
                continue
            kinds = ", ".join(f"{k} {ms:.0f}" for k, ms in prof["gpu_ms_by_kind"].items())
            console.print(
                f"profile {r['name']}: GPU busy {prof['gpu_busy_ms']:.0f} ms of a "
                f"{r['step_time_s'] * 1e3:.0f} ms step (profiled {prof['profiled_wall_ms']:.0f} ms); "
                f"GPU ms by kind: {kinds}"
            )
    if report.get("logprob_micro"):
        lt = Table(title="chunked_logprobs fwd+bwd alone, one micro-batch")
        for col in ("impl", "setup", "chunk", "ms"):
            lt.add_column(col)
        for r in report["logprob_micro"]:
            lt.add_row(
                r["impl"],
                r["setup"],
                str(r.get("chunk", "")),
                f"{r['ms']:.2f}"
                if "ms" in r
                else r.get("error")
                or ", ".join(f"{k} {v:.2g}" for k, v in r.items() if k.endswith("diff")),
            )
        console.print(lt)
    if report.get("best"):
        b = report["best"]
        console.print(f"best: [bold]{b['name']}[/] at {b['mfu'] * 100:.1f}% MFU ({b['desc']})")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in all_rows(report) if r["status"] == "ok"]
    if not ok:
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.45 * len(ok) + 2.2), sharey=True)
    names = [r["name"] for r in ok][::-1]
    mfu = [r["mfu"] * 100 for r in ok][::-1]
    mem = [r.get("peak_mem_gib", r.get("peak_rss_gib")) or 0 for r in ok][::-1]
    colors = [
        "tab:gray" if n.startswith("hf_") else "tab:green" if n.endswith("(run 2)") else "tab:blue"
        for n in names
    ]
    axes[0].barh(names, mfu, color=colors)
    axes[0].axvline(TARGET_MFU * 100, color="tab:red", ls="--", label="target 55%")
    for i, m in enumerate(mfu):
        axes[0].text(m, i, f" {m:.1f}", va="center", fontsize=8)
    axes[0].set_xlabel("MFU % (989 TFLOP/s peak)")
    axes[0].legend(fontsize=8, loc="lower right")
    axes[1].barh(names, mem, color=colors)
    axes[1].set_xlabel("peak GiB" if report["meta"]["device"] == "cuda" else "peak RSS GiB")
    for a in axes:
        a.grid(axis="x", alpha=0.3)
    m = report["meta"]
    fig.suptitle(
        f"trainer RL step: {m['shape_name']}, {m['samples_per_step']} x {m['seq_len']} tokens, "
        f"{m['device_name']}" + ("; green: a follow-up run" if "followup" in report else ""),
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
    add("--tiny", action="store_true", help="tiny model, short sequences, 2 steps (CPU smoke)")
    add("--device", default="auto", help="cpu | cuda | auto")
    add("--variants", help="comma-separated subset (default: all)")
    add("--seq", type=int, help="tokens per sample (default 4096; tiny 128)")
    add("--samples", type=int, help="samples per step (default 4; tiny 2)")
    add("--prompt", type=int, help="masked prompt tokens per sample (default seq/16)")
    add("--steps", type=int, help="timed steps per variant (default 6; tiny 2)")
    add("--warmup", type=int, help="warm-up steps (default 2; tiny 1)")
    add("--compile-warmup", type=int, help="warm-up steps of compile variants (default 3)")
    add("--no-micro", action="store_true", help="skip the logprob micro-benchmark")
    add("--profile", default="", help="comma-separated variants to profile one extra step of")
    add("--time-budget-s", type=float, help="skip the variants left once this much has run")
    add("--seed", type=int, default=0)
    add("--out", help="output stem (default tests/bench/results/trainer_h200 | trainer_cpu)")
    add("--replot", type=Path, help="only print the table and redraw the PNG of this JSON")
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    tiny = args.tiny
    args.seq = args.seq or (128 if tiny else 4096)
    args.samples = args.samples or (2 if tiny else 4)
    args.prompt = args.prompt if args.prompt is not None else args.seq // 16
    args.steps = args.steps or (2 if tiny else 6)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 2)
    args.compile_warmup = args.compile_warmup or (1 if tiny else 3)
    names = [v.name for v in VARIANTS]
    args.profile = [x.strip() for x in args.profile.split(",") if x.strip()]
    if set(args.profile) - set(names):
        ap.error(f"unknown variants to profile {sorted(set(args.profile) - set(names))}")
    if args.variants:
        args.variants = [x.strip() for x in args.variants.split(",") if x.strip()]
        bad = sorted(set(args.variants) - set(names))
        if bad:
            ap.error(f"unknown variants {bad}; known: {names}")
    else:
        args.variants = names
    default = "trainer_h200" if args.device.startswith("cuda") else "trainer_cpu"
    args.out = Path(args.out) if args.out else RESULTS_DIR / default
    return args


def versions() -> dict:
    out = {}
    for k in VERSIONS_OF:
        try:
            out[k] = importlib.metadata.version(k)
        except importlib.metadata.PackageNotFoundError:
            out[k] = None
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        report = json.loads(args.replot.read_text())
        print_table(report)
        plot(report, args.replot.with_suffix(".png"))
        return 0
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if cuda:
        torch.cuda.set_device(device)
    shape = TINY if args.tiny else QWEN2_1_5B
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp_s:
        tmp = Path(tmp_s)
        model_dir = tmp / "model"
        t0 = time.perf_counter()
        params = build_model(model_dir, shape, device, args.seed)
        build_s = time.perf_counter() - t0
        cleanup(device)
        fpt = flops_per_token(params, shape, args.seq)
        meta = {
            "bench": "trainer",
            "schema": 1,
            "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "argv": sys.argv,
            "device": device.type,
            "device_name": torch.cuda.get_device_name(device)
            if cuda
            else f"CPU x{os.cpu_count()} ({platform.machine()})",
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            **{f"version_{k}": v for k, v in versions().items()},
            "flash_attn_installed": importlib.util.find_spec("flash_attn") is not None,
            "shape_name": "tiny Qwen2" if args.tiny else "Qwen2-1.5B shape (random init)",
            "shape": shape,
            "params": params,
            "seq_len": args.seq,
            "samples_per_step": args.samples,
            "prompt_tokens_masked": args.prompt,
            "tokens_per_step": args.seq * args.samples,
            "warmup_steps": args.warmup,
            "compile_warmup_steps": args.compile_warmup,
            "timed_steps": args.steps,
            "flops_per_token": fpt,
            "peak_flops": PEAK_FLOPS,
            "mfu_formula": (
                "(6*N + 12*layers*hidden*seq_len) * tokens / step_time / 989e12; "
                "N = all params - input embedding + vocab*hidden (LM head matmul); tied "
                "embeddings: N = all unique params"
            ),
            "model_build_s": build_s,
        }
        report: dict[str, Any] = {"meta": meta, "variants": [], "logprob_micro": []}
        out_json = args.out.with_suffix(".json")

        def save() -> None:
            ok = [r for r in report["variants"] if r["status"] == "ok"]
            report["best"] = (
                {
                    k: max(ok, key=lambda r: r["mfu"])[k]
                    for k in ("name", "desc", "mfu", "tokens_per_s")
                }
                if ok
                else None
            )
            meta["wall_s"] = time.perf_counter() - t_start
            out_json.write_text(json.dumps(report, indent=1, default=str) + "\n")

        if not args.no_micro:
            console.print("logprob micro-benchmark")
            report["logprob_micro"] = bench_logprob(
                device,
                shape["hidden_size"],
                shape["vocab_size"],
                args.seq,
                reps=3 if args.tiny else 10,
            )
            cleanup(device)
            save()
        samples = make_samples(args.samples, args.seq, shape["vocab_size"], args.prompt, args.seed)
        ctx = Ctx(
            device, model_dir, tmp, samples, args.seq, args.warmup, args.steps,
            args.compile_warmup, fpt, tuple(args.profile),
        )  # fmt: skip
        for v in (v for v in VARIANTS if v.name in args.variants):
            skip = (
                "compile needs CUDA here (CPU inductor builds take minutes)"
                if (v.compile and not cuda)
                else None
            )
            if args.time_budget_s and time.perf_counter() - t_start > args.time_budget_s:
                skip = f"time budget of {args.time_budget_s:.0f} s spent"
            report["variants"].append(run_variant(v, ctx, skip))
            save()
    save()
    print_table(report)
    plot(report, args.out.with_suffix(".png"))
    console.print(f"wrote {out_json} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
