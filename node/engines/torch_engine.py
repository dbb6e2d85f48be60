"""The `torch` engine: a transformers causal LM driven by our own decode loop.

Two decode paths, chosen by `EngineConfig.decode` ('auto': slots on CUDA, loop elsewhere;
`TorchEngine.decode` says which runs): 'loop', batched generation with transformers' growing cache (left-padded prompts, one forward per
step); 'slots', continuous batching over a static KV cache with CUDA graphs on a GPU
(`node.engines.slot_decode`). Both use the
seeded sampling of `verifier.sampling`, stop on EOS / stop strings / max_tokens, and keep
the last-layer hidden state of every step for proofs; a prefill-only path (right-padded
batch, no cache) serves verification.

Invariants: see `node.engines.base`. In addition, weights are swapped under the engine
lock, so a batch never mixes two versions.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache

from node.engines.base import (
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    PrefillBatch,
    PrefillResult,
    hash_weights_dir,
)
from node.engines.common import StopWatcher, eos_ids, pick_device, pick_dtype
from node.engines.slot_decode import SlotDecoder, supports
from verifier.models import load_tokenizer, resolve_model
from verifier.sampling import BatchSampler, RowLogits, RowParams


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
        self.decode = config.decode
        if self.decode == "auto":
            self.decode = "slots" if self.device.type == "cuda" else "loop"
        self.lock = threading.Lock()
        self._slots: SlotDecoder | None = None  # built on first use (it allocates the KV cache)
        self.weights_version = 0
        self.weights_hash = hash_weights_dir(self.model_path)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def decode_steps(self) -> dict[str, int]:
        return {"slots": self._slots.steps_run if self._slots is not None else 0}

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
        if not requests:
            return []
        with self.lock:
            slots = self._slot_decoder(requests)
            if slots is None:
                return self._generate(requests)
            done = dict(
                x for group in slots.run(enumerate(requests), self._stop_hit) for x in group
            )
            return [done[i] for i in range(len(requests))]

    @torch.inference_mode()
    def generate_stream(self, requests, more, emit) -> None:
        """Continuous batching with the slot decoder: requests `more` hands over join as slots
        free; a request only the loop decode serves waits for the end of the slot run."""
        with self.lock:
            slots = self._slot_decoder(requests)
        if slots is None:
            emit(list(enumerate(self.generate(requests))))
            return
        later: list[tuple[int, GenerationRequest]] = []

        def admissible(k: int) -> list[tuple[int, GenerationRequest]]:
            got = more(k)
            ok = [(i, r) for i, r in got if self._slot_decoder([r]) is slots]
            later.extend(x for x in got if x not in ok)
            return ok

        with self.lock:
            for group in slots.run(enumerate(requests), self._stop_hit, admissible):
                emit(group)
        if later:
            emit(
                list(zip([i for i, _ in later], self.generate([r for _, r in later]), strict=True))
            )

    def _stop_hit(self, request: GenerationRequest):
        return StopWatcher(self.tokenizer, request.sampling.stop).hit

    def _slot_decoder(self, requests: list[GenerationRequest]) -> SlotDecoder | None:
        """The continuous-batching decoder, when the config asks for it and it can serve
        these requests (alternatives per position are only reported by the loop)."""
        cfg = self.config
        if (
            self.decode == "loop"
            or not supports(self.model)
            or any(r.top_logprobs for r in requests)
        ):
            return None
        if any(len(r.prompt_ids) + r.sampling.max_tokens > cfg.max_model_len for r in requests):
            return None
        if self._slots is None:
            self._slots = SlotDecoder(
                self.model,
                slots=cfg.max_batch_size,
                max_len=cfg.max_model_len,
                max_new=cfg.max_model_len,
                eos_ids=self.eos_token_ids,
                window=cfg.decode_window,
                graphs=cfg.cuda_graphs and self.device.type == "cuda",
                min_rows=cfg.decode_min_rows if self.device.type == "cuda" else 1,
            )
        return self._slots

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
        max_new = max(r.sampling.max_tokens for r in requests)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        # The whole attention mask is allocated once; step k uses its first width + k columns.
        mask = torch.zeros((b, width + max_new), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        hidden = self._forward(ids, mask[:, :width], positions, cache)

        params = [
            RowParams(r.sampling.temperature, r.sampling.top_k, r.sampling.top_p) for r in requests
        ]
        sampler = BatchSampler(params, [r.seed for r in requests], self.vocab_size, dev)
        watchers = [StopWatcher(self.tokenizer, r.sampling.stop) for r in requests]
        tokens_out: list[list[int]] = [[] for _ in requests]
        logprobs_out: list[list[float]] = [[] for _ in requests]
        step_hidden: list[torch.Tensor] = []  # [B, H] per step, kept on the device
        n_top = max(r.top_logprobs for r in requests)
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in requests]
        finish: list[str | None] = [None] * b
        last_pos = positions[:, -1:]
        step = 0
        while True:
            logits = self.lm_head(hidden)
            out = sampler(logits, step)
            step_hidden.append(hidden)
            # One device->host copy per step: token ids are exact in float64.
            host = torch.stack([out.tokens.double(), out.logprobs.double()]).tolist()
            toks = [int(t) for t in host[0]]
            if n_top:
                top = torch.log_softmax(logits.float() / sampler.t[:, None], dim=-1).topk(
                    n_top, dim=-1
                )
                top_vals, top_ids = top.values.tolist(), top.indices.tolist()
            for i, r in enumerate(requests):
                if finish[i] is not None:
                    continue
                tokens_out[i].append(toks[i])
                logprobs_out[i].append(host[1][i])
                if r.top_logprobs:
                    tops[i].append(
                        list(zip(top_ids[i], top_vals[i], strict=True))[: r.top_logprobs]
                    )
                stop = toks[i] in self.eos_token_ids and not r.sampling.ignore_eos
                if stop or watchers[i].hit(tokens_out[i]):
                    finish[i] = "stop"
                elif len(tokens_out[i]) >= r.sampling.max_tokens:
                    finish[i] = "length"
            step += 1
            if all(f is not None for f in finish):
                break
            last_pos = last_pos + 1
            hidden = self._forward(out.tokens[:, None], mask[:, : width + step], last_pos, cache)
        rows = torch.stack(step_hidden, dim=1).cpu()  # [B, steps, H]
        return [
            GenerationResult(
                tokens_out[i],
                logprobs_out[i],
                finish[i],  # type: ignore[arg-type]
                rows[i, : len(tokens_out[i])].clone(),
                tops[i] if requests[i].top_logprobs else None,
            )
            for i in range(b)
        ]

    # -- verification prefill ------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, items: list[tuple[list[int], list[int]]]) -> list[PrefillResult]:
        """Logits stay on the engine's device (the checks run there); hidden rows go to CPU."""
        batch = self.prefill_batch(items)
        logits = batch.logits[:].float()
        hidden = batch.rows.cpu()
        return [
            PrefillResult(lg, h)
            for lg, h in zip(logits.split(batch.sizes), hidden.split(batch.sizes), strict=True)
        ]

    @torch.inference_mode()
    def prefill_batch(self, items: list[tuple[list[int], list[int]]]) -> PrefillBatch:
        """One forward over the right-padded batch; the rows that produced completion
        tokens are gathered with one index and stay on the device, and their logits are
        made a block at a time by whoever reads them (`RowLogits`)."""
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
            sizes = [len(c) for _, c in items]
            # Row k of item i is position len(prompt_i) - 1 + k of its sequence.
            first = torch.tensor([i * width + len(p) - 1 for i, (p, _) in enumerate(items)])
            n = torch.tensor(sizes)
            idx = torch.arange(int(n.sum())) - (torch.cumsum(n, 0) - n).repeat_interleave(n)
            idx += first.repeat_interleave(n)
            hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])
            rows = hidden[idx.to(self.device)]
            return PrefillBatch(rows, sizes, RowLogits(rows, self.lm_head, self.vocab_size))
