"""The `torch` engine: a transformers causal LM driven by our own decode loop.

Batched generation with a KV cache (left-padded prompts, one forward per step), seeded
sampling from `verifier.sampling`, stop on EOS / stop strings / max_tokens, and capture of
the last-layer hidden state of every step for proofs; a prefill-only path (right-padded
batch, no cache) for verification. Runs on CPU and CUDA.

Invariants: see `node.engines.base`. In addition, weights are swapped under the engine
lock, so a batch never mixes two versions.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedTokenizerFast

from node.engines.base import (
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    PrefillResult,
    hash_weights_dir,
)
from node.models import resolve_model
from verifier.sampling import RowParams, sample

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    # AutoTokenizer maps the char-level tiny tokenizer to a class that drops spaces.
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def eos_ids(tokenizer, model_config) -> frozenset[int]:
    ids = set()
    for src in (getattr(model_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list):
            ids.update(src)
    return frozenset(ids)


class _StopWatcher:
    """Detects stop strings in a growing completion (decodes only rows that have any)."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stops = stops

    def hit(self, completion: list[int]) -> bool:
        if not self.stops:
            return False
        text = self.tokenizer.decode(completion, skip_special_tokens=False)
        return any(s in text for s in self.stops)


class TorchEngine(InferenceEngine):
    def __init__(self, config):  # config: node.config.EngineConfig
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.model_path = resolve_model(config.model, config.seed)
        self.tokenizer = load_tokenizer(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(str(self.model_path), dtype=self.dtype)
        self.model.to(self.device).eval()
        self.base = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        self.eos_token_ids = eos_ids(self.tokenizer, self.model.config)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = next(iter(self.eos_token_ids), 0)
        self.lock = threading.Lock()
        self.weights_version = 0
        self.weights_hash = hash_weights_dir(self.model_path)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    # -- weights -------------------------------------------------------------------
    def load_weights(self, path: str | Path, version: int, weights_hash: str = "") -> None:
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        expected = set(self.model.state_dict().keys())
        missing = {k for k in expected - state.keys() if not k.endswith("lm_head.weight")}
        if missing:
            raise ValueError(
                f"weights in {path} lack {len(missing)} tensors, e.g. {sorted(missing)[:3]}"
            )
        new_hash = weights_hash or hash_weights_dir(path)
        with self.lock:
            self.model.load_state_dict(state, strict=False)
            if getattr(self.model.config, "tie_word_embeddings", False):
                self.model.tie_weights()
            self.weights_version = version
            self.weights_hash = new_hash

    # -- generation ----------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        with self.lock:
            return self._generate(requests)

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        out = self.base(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        return out.last_hidden_state[:, -1]

    def _generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        b = len(requests)
        dev = self.device
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        hidden = self._forward(ids, mask, positions, cache)

        params = [
            RowParams(r.sampling.temperature, r.sampling.top_k, r.sampling.top_p) for r in requests
        ]
        seeds = [r.seed for r in requests]
        watchers = [_StopWatcher(self.tokenizer, r.sampling.stop) for r in requests]
        tokens_out: list[list[int]] = [[] for _ in requests]
        logprobs_out: list[list[float]] = [[] for _ in requests]
        rows: list[list[torch.Tensor]] = [[] for _ in requests]
        n_top = max(r.top_logprobs for r in requests)
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in requests]
        finish: list[str | None] = [None] * b
        last_pos = positions[:, -1]
        step = 0
        while True:
            logits = self.lm_head(hidden)
            out = sample(logits, params, seeds, [step] * b)
            toks = out.tokens.tolist()
            lps = out.logprobs.tolist()
            hidden_cpu = hidden.detach().to("cpu")
            if n_top:
                scale = torch.tensor([p.scale for p in params], device=dev)[:, None]
                top = torch.log_softmax(logits.float() / scale, dim=-1).topk(n_top, dim=-1)
                top_vals, top_ids = top.values.tolist(), top.indices.tolist()
            for i, r in enumerate(requests):
                if finish[i] is not None:
                    continue
                tokens_out[i].append(toks[i])
                logprobs_out[i].append(lps[i])
                rows[i].append(hidden_cpu[i])
                if r.top_logprobs:
                    tops[i].append(
                        list(zip(top_ids[i], top_vals[i], strict=True))[: r.top_logprobs]
                    )
                if (toks[i] in self.eos_token_ids and not r.sampling.ignore_eos) or watchers[i].hit(
                    tokens_out[i]
                ):
                    finish[i] = "stop"
                elif len(tokens_out[i]) >= r.sampling.max_tokens:
                    finish[i] = "length"
            step += 1
            if all(f is not None for f in finish):
                break
            nxt = torch.tensor(toks, dtype=torch.long, device=dev)[:, None]
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=dev)], dim=1)
            last_pos = last_pos + 1
            hidden = self._forward(nxt, mask, last_pos[:, None], cache)
        return [
            GenerationResult(
                tokens_out[i],
                logprobs_out[i],
                finish[i],
                torch.stack(rows[i]),  # type: ignore[arg-type]
                tops[i] if requests[i].top_logprobs else None,
            )
            for i in range(b)
        ]

    # -- verification prefill ------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, items: list[tuple[list[int], list[int]]]) -> list[PrefillResult]:
        with self.lock:
            seqs = [p + c[:-1] for p, c in items]
            width = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, : len(s)] = torch.tensor(s)
                mask[i, : len(s)] = 1
            out = self.base(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False
            )
            results = []
            for i, (p, c) in enumerate(items):
                h = out.last_hidden_state[i, len(p) - 1 : len(p) - 1 + len(c)]
                results.append(PrefillResult(self.lm_head(h).float().cpu(), h.detach().cpu()))
            return results
