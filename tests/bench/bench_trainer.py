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
`--steps` steps each timed between two `torch.cuda.synchronize()`; the median counts):

- `hf_baseline`: plain Hugging Face, the reference: `model(input_ids).logits` ->
  cross-entropy, fp32 master weights under bf16 autocast, sdpa, fused AdamW, clipping,
  no compile, one 4096-token sequence per micro-batch.
- `trainer_default`: `Trainer` as its defaults build it on one GPU (FSDP2 over a
  one-process group with bf16 params / fp32 reduce, eager, no activation checkpointing,
  logprob chunk 1024).
- then one setting changed at a time: TF32 matmuls (`allow_tf32`), `model.compile`
  (torch.compile per decoder layer), FSDP2 off (one GPU: plain module under bf16
  autocast; the benchmark swaps `apply_fsdp` for a no-op), FSDP2 without resharding, the
  logprob implementation and chunk size, activation checkpointing, sdpa preferring cuDNN,
  16384-token packed micro-batches (4 samples per row: transformers then builds a
  block-diagonal mask and sdpa loses its causal kernel), and `*_batched`: the 4 samples
  as ONE [4, 4096] micro-batch (the benchmark wraps `split_for_rank` to stack equal-width
  rows; `PolicyModel` already flattens [B, L]).
- `*proto*` and `best*`: the Trainer with `trainer.model.chunked_logprobs` swapped for
  `proto_chunked_logprobs` below, a bench-local prototype of the change proposed for
  trainer/loss.py: matmuls in the compute dtype in the backward too (the core backward
  runs outside autocast, so with fp32 master weights its three [T, H] x [H, V] products
  are fp32), the weight gradient from bf16 products (not an fp32 matmul), the
  softmax/logsumexp/entropy and gradient elementwise work fused by torch.compile, and the
  logsumexp saved from the forward (like the core code, it skips the entropy backward when
  the loss does not use the entropy: `set_materialize_grads(False)`). `best` = compile + FSDP2 off + TF32 + prototype.

`--profile NAMES` runs one more step of those variants under torch.profiler and keeps GPU
kernel time by kind, the top kernels and the top CPU ops (not counted in the timings).
Every row also keeps the loss and gradient norm of its first step: all variants start
from the same weights and batch, so these must agree (the HF rows use plain CE).

Besides the steps, `logprob_micro` times `chunked_logprobs` alone (forward + backward
on one 4096-token micro-batch) for the core code and the prototype, with the weight in
bf16 (as under FSDP2) or fp32 under autocast (FSDP off), TF32 off/on, next to the floor
of its three unavoidable [T, H] x [H, V] matmuls.

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
    python tests/bench/bench_trainer.py --variants hf_baseline,best_batched --profile best
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
from collections.abc import Callable, Iterator
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
    fsdp: bool = True
    compile: bool = False
    ac: bool = False
    chunk: int = 1024
    packed_samples: int = 1  # samples per packed micro-batch (micro_batch_tokens = n x seq)
    tf32: bool = False
    logprob: str = "core"  # "core": trainer/loss.py; "proto": proto_chunked_logprobs
    attn: str = "default"  # "default": sdpa's own choice; "cudnn": cuDNN attention first
    reshard: bool = True  # FSDP2 reshard_after_forward as trainer/parallel.py sets it
    rows: int = 1  # rows stacked into one [rows, L] micro-batch (trainer: split_for_rank patched)


# The best configuration found (compile, FSDP2 off on one GPU, TF32, proposed logprobs).
BEST = dict(compile=True, fsdp=False, tf32=True, logprob="proto")

VARIANTS: list[Variant] = [
    Variant("hf_baseline", "plain HF: logits -> CE, fp32 master + bf16 autocast, eager", "hf"),
    Variant("trainer_default", "Trainer defaults: FSDP2 (1 GPU), eager, no AC, chunk 1024"),
    Variant("tf32", "default + TF32 matmuls", tf32=True),
    Variant("compile", "+ compile per layer (TF32 on)", compile=True, tf32=True),
    Variant(
        "compile_proto",
        "compile + proposed loss.py logprobs (FSDP2)",
        compile=True,
        tf32=True,
        logprob="proto",
    ),
    Variant(
        "compile_proto_noreshard",
        "compile, proposed logprobs, FSDP2 never reshards",
        compile=True,
        tf32=True,
        logprob="proto",
        reshard=False,
    ),
    Variant(
        "compile_nofsdp",
        "compile, FSDP2 off (bf16 autocast), core logprobs",
        compile=True,
        fsdp=False,
        tf32=True,
    ),
    Variant(
        "compile_nofsdp_notf32",
        "compile, FSDP2 off, core logprobs, TF32 off",
        compile=True,
        fsdp=False,
    ),
    Variant(
        "compile_nofsdp_chunk4096",
        "compile, FSDP2 off, core logprobs, chunk 4096",
        compile=True,
        fsdp=False,
        tf32=True,
        chunk=4096,
    ),
    Variant("best", "compile, FSDP2 off, TF32, proposed logprobs (chunk 1024)", **BEST),
    Variant("best_chunk2048", "best, logprob chunk 2048", **BEST, chunk=2048),
    Variant("best_chunk4096", "best, logprob chunk 4096", **BEST, chunk=4096),
    Variant("best_chunk512", "best, logprob chunk 512", **BEST, chunk=512),
    Variant("best_ac", "best + activation checkpointing", **BEST, ac=True),
    Variant("best_cudnn_attn", "best, sdpa prefers cuDNN attention", **BEST, attn="cudnn"),
    Variant(
        "best_packed16k", "best, 4 samples packed per 16384-token row", **BEST, packed_samples=4
    ),
    Variant(
        "eager_nofsdp_proto", "best without compile (eager)", fsdp=False, tf32=True, logprob="proto"
    ),
    Variant("hf_baseline_batched", "plain HF, the 4 samples as one [4, 4096] batch", "hf", rows=4),
    Variant("best_batched", "best, the 4 samples as one [4, 4096] micro-batch", **BEST, rows=4),
    Variant(
        "best_batched_chunk4096",
        "best, one [4, 4096] micro-batch, chunk 4096",
        **BEST,
        rows=4,
        chunk=4096,
    ),
]


# --- Proposed chunked logprobs (bench-local prototype of a trainer/loss.py change) -------
def _lp_fwd_math(z: torch.Tensor, y: torch.Tensor, temp: float):
    zf = z.float() / temp
    lse = torch.logsumexp(zf, dim=-1)
    logp = zf.gather(-1, y[:, None]).squeeze(-1) - lse
    p = torch.exp(zf - lse[:, None])
    ent = lse - (p * zf).sum(-1)
    return logp, ent, lse


def _lp_bwd_math(z, y, lse, g_logp, temp: float, out_dtype: torch.dtype):
    zf = z.float() / temp
    p = torch.exp(zf - lse[:, None])
    g = g_logp[:, None].float()
    onehot = torch.arange(z.shape[-1], device=z.device)[None, :] == y[:, None]
    g_z = torch.where(onehot, g, 0.0) - g * p
    return (g_z / temp).to(out_dtype)


def _lp_bwd_math_ent(z, y, lse, g_logp, g_ent, temp: float, out_dtype: torch.dtype):
    zf = z.float() / temp
    logp_all = zf - lse[:, None]
    p = torch.exp(logp_all)
    g = g_logp[:, None].float()
    ent = -(p * logp_all).sum(-1, keepdim=True)
    onehot = torch.arange(z.shape[-1], device=z.device)[None, :] == y[:, None]
    g_z = torch.where(onehot, g, 0.0) - g * p - g_ent[:, None].float() * p * (logp_all + ent)
    return (g_z / temp).to(out_dtype)


_COMPILED: dict[str, Callable] = {}


def _math(name: str, fn: Callable, device: torch.device) -> Callable:
    """The fused (torch.compile) version of `fn` on CUDA, plain `fn` elsewhere."""
    if device.type != "cuda":
        return fn
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=False)
    return _COMPILED[name]


_MM_OUT_DTYPE: list[bool] = []


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with bf16 inputs and an fp32 result (cuBLAS accumulates in fp32 either way)."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda and _MM_OUT_DTYPE != [False]:
        try:
            out = torch.mm(a, b, out_dtype=torch.float32)
            _MM_OUT_DTYPE[:] = [True]
            return out
        except (TypeError, RuntimeError):
            _MM_OUT_DTYPE[:] = [False]
    return (a @ b).float()


class _ProtoChunkedLogprobs(torch.autograd.Function):
    """Same results as trainer.loss._ChunkedLogprobs; see the module docstring for what differs."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int):
        ctx.set_materialize_grads(False)
        dev = hidden.device.type
        cd = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
        w = weight.to(cd)
        fwd = _math("fwd", _lp_fwd_math, hidden.device)
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        ent, lse = torch.empty_like(logp), torch.empty_like(logp)
        for s in range(0, n, chunk):
            z = hidden[s : s + chunk].to(cd) @ w.t()
            with torch.autocast(dev, enabled=False):
                logp[s : s + chunk], ent[s : s + chunk], lse[s : s + chunk] = fwd(
                    z, targets[s : s + chunk], temperature
                )
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk, ctx.cd = temperature, chunk, cd
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse = ctx.saved_tensors
        temp, chunk, cd = ctx.temperature, ctx.chunk, ctx.cd
        if g_logp is None and g_ent is None:
            return None, None, None, None, None
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        w = weight.to(cd)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_hidden = torch.empty_like(hidden) if need_h else None
        g_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        if g_ent is None:
            bwd = _math("bwd", _lp_bwd_math, hidden.device)
        else:
            bwd = _math("bwd_ent", _lp_bwd_math_ent, hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk].to(cd)
            z = h @ w.t()
            args = (z, targets[s : s + chunk], lse[s : s + chunk], g_logp[s : s + chunk])
            if g_ent is not None:
                args += (g_ent[s : s + chunk],)
            g_logits = bwd(*args, temp, cd)
            if g_hidden is not None:
                g_hidden[s : s + chunk] = g_logits @ w
            if g_weight is not None:
                g_weight += _mm_f32(g_logits.t(), h)
        if g_weight is not None:
            g_weight = g_weight.to(weight.dtype)
        return g_hidden, g_weight, None, None, None


def proto_chunked_logprobs(hidden, weight, targets, temperature: float = 1.0, chunk: int = 1024):
    """Drop-in for trainer.loss.chunked_logprobs (the proposed implementation)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [T, H] and targets [T], got {hidden.shape}")
    return _ProtoChunkedLogprobs.apply(hidden, weight, targets, float(temperature), int(chunk))


# --- Helpers ---------------------------------------------------------------------------
@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


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
    _COMPILED.clear()


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
    import trainer.model as tm
    import trainer.train as tt
    from trainer.config import LossConfig, ModelConfig, MonitorConfig, TrainerConfig

    cfg = TrainerConfig(
        run_dir=ctx.tmp / f"run_{v.name}",
        device=ctx.device.type,
        max_steps=100_000,
        micro_batch_tokens=ctx.seq * v.packed_samples,
        model=ModelConfig(
            name=str(ctx.model_dir), compile=v.compile, activation_checkpointing=v.ac
        ),
        loss=LossConfig(logprob_chunk=v.chunk),
        monitor=MonitorConfig(progress=False, plot=False),
    )
    with contextlib.ExitStack() as stack:
        if not v.fsdp:
            stack.enter_context(patched(tt, "apply_fsdp", lambda *a, **k: False))
        if v.logprob == "proto":
            stack.enter_context(patched(tm, "chunked_logprobs", proto_chunked_logprobs))
        if not v.reshard:
            import torch.distributed.fsdp as fsdp_mod

            orig = fsdp_mod.fully_shard

            def no_reshard(module, **kw):
                return orig(module, **{**kw, "reshard_after_forward": False})

            stack.enter_context(patched(fsdp_mod, "fully_shard", no_reshard))
        if v.rows > 1:
            split = tt.split_for_rank
            stack.enter_context(
                patched(tt, "split_for_rank", lambda *a, **k: stack_rows(split(*a, **k), v.rows))
            )
        t0 = time.perf_counter()
        trainer = tt.Trainer(cfg)
        setup_s = time.perf_counter() - t0
        warm = ctx.compile_warmup if v.compile else ctx.warmup
        res = time_steps(ctx, lambda: trainer.step(ctx.samples, "rl"), warm, v.name in ctx.profile)
        m = res.pop("last_metrics")
        res.update(
            setup_s=setup_s,
            fsdp_applied=bool(trainer.fsdp),
            loss=m["loss"],
            grad_norm=m["grad_norm"],
            # Trainer counts tokens as rows x width: one [rows, L] micro-batch reads as L tokens
            trainer_mfu=m["mfu"] if v.rows == 1 else None,
            trainer_step_time_s=m["step_time_s"],
            micro_batches=m["micro_batches"],
        )
    return res


def stack_rows(mbs: list, k: int) -> list:
    """Micro-batches of one width, k at a time, as one [k, L] micro-batch (targets etc. flat)."""
    from trainer.packing import MicroBatch

    out = []
    for i in range(0, len(mbs), k):
        group = mbs[i : i + k]
        if len({m.num_tokens for m in group}) != 1:
            out.extend(group)
            continue
        fields = ("input_ids", "position_ids", "targets", "loss_mask", "mu", "advantages")
        cat = {f: torch.cat([getattr(m, f) for m in group]) for f in fields}
        out.append(MicroBatch(**cat, num_samples=sum(m.num_samples for m in group)))
    return out


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
        set_tf32(v.tf32)
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
    """chunked_logprobs fwd+bwd alone on one micro-batch: core vs prototype, per dtype set-up."""
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
    for impl_name, impl in (("core", chunked_logprobs), ("proto", proto_chunked_logprobs)):
        for setup, h, w, amp in cases:
            for chunk in (1024, 4096):
                for tf32 in (False, True):
                    if impl_name == "proto" and tf32:
                        continue  # the prototype runs no fp32 matmul: TF32 changes nothing

                    def fn(h=h, w=w, amp=amp, chunk=chunk, impl=impl) -> None:
                        ctxm = (
                            torch.autocast(device.type, dtype=torch.bfloat16)
                            if amp
                            else contextlib.nullcontext()
                        )
                        with ctxm:
                            logp, _ent = impl(h, w, y, 1.0, chunk)
                        (logp * adv).sum().backward()
                        h.grad = w.grad = None

                    if device.type == "cuda":
                        set_tf32(tf32)
                    try:
                        ms = timed(fn)
                    except Exception as exc:
                        rows.append({"impl": impl_name, "setup": setup, "error": repr(exc)[:300]})
                        continue
                    finally:
                        if device.type == "cuda":
                            set_tf32(False)
                    rows.append(
                        {"impl": impl_name, "setup": setup, "chunk": chunk, "tf32": tf32, "ms": ms}
                    )
    # the prototype against the core code (bf16 weight, chunk 1024): same logprobs and grads?
    outs = []
    for impl in (chunked_logprobs, proto_chunked_logprobs):
        logp, ent = impl(h16, w16, y, 1.0, 1024)
        (logp * adv).sum().backward()
        outs.append((logp.detach(), ent.detach(), h16.grad.float(), w16.grad.float()))
        h16.grad = w16.grad = None
    (lc, ec, hc, wc), (lp, ep, hp, wp) = outs
    check = {
        "impl": "check: proto vs core (bf16 weight, chunk 1024)",
        "setup": "max |diff|",
        "logp_max_abs_diff": (lc - lp).abs().max().item(),
        "entropy_max_abs_diff": (ec - ep).abs().max().item(),
        "grad_hidden_rel_diff": ((hc - hp).norm() / hc.norm()).item(),
        "grad_weight_rel_diff": ((wc - wp).norm() / wc.norm()).item(),
    }
    del outs, lc, ec, hc, wc, lp, ep, hp, wp
    # floor: the three [T,H]x[H,V] bf16 matmuls the head needs (fwd, dgrad, wgrad) + recompute
    a, b = h16.detach(), w16.detach()

    def floor() -> None:
        zz = a @ b.t()
        _ = zz @ b
        _ = zz.t() @ a

    rows.append({"impl": "matmul floor (fwd, dgrad, wgrad)", "setup": "bf16", "ms": timed(floor)})
    rows.append(check)
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
    base = next(
        (r for r in report["variants"] if r["name"] == "hf_baseline" and r["status"] == "ok"), None
    )
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
        "x HF",
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
        for col in ("impl", "setup", "chunk", "tf32", "ms"):
            lt.add_column(col)
        for r in report["logprob_micro"]:
            lt.add_row(
                r["impl"],
                r["setup"],
                str(r.get("chunk", "")),
                str(r.get("tf32", "")),
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
        L, H = shape["num_hidden_layers"], shape["hidden_size"]
        fpt = 6 * params["matmul_params_N"] + 12 * L * H * args.seq
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
                device, H, shape["vocab_size"], args.seq, reps=3 if args.tiny else 10
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
            report["variants"].append(run_variant(v, ctx, skip))
            save()
    save()
    print_table(report)
    plot(report, args.out.with_suffix(".png"))
    console.print(f"wrote {out_json} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
