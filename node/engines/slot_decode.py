"""Continuous-batching decode over a static KV cache, one CUDA graph per step shape.

The torch engine's GPU path. A fixed number of slots share one KV cache of `max_len`
positions per slot; a request takes a free slot, its prompt is prefilled into that slot's
rows, and every decode step advances all slots at once with the same kernels on the same
buffers, so the step is captured once per (slot bucket, length bucket, filtering) and
replayed with one launch (`torch.cuda.CUDAGraph`). The host reads tokens back every
`window` steps (one copy, overlapped with the next window) and only then decides which
slots finished and which queued requests join; a finished slot decodes on, unread, until
that readback, and its request is replaced at once, so the batch stays full while rollouts
end at different lengths.

Invariants:
- Tokens are chosen by `verifier.sampling`'s rule on the step's logits: the same keys
  (`verifier.noise.row_key(seed, completion position)`, made on the device by
  `row_keys`), the same noise, first index on ties. The fused kernel
  (`verifier.fused_sampling`, CUDA) and the torch ops (CPU, and rows that filter) are
  bit-identical in what they choose, so the replay of any verifier holds.
- Row k of a result's hidden states is the post-final-norm state that produced completion
  token k (the prompt's last row for k = 0), as in `node.engines.base`.
- Nothing in a step reads a value back to the host; a readback is the only sync.
- A step runs over at least `min_rows` slots (a bucket of slots; idle ones ride along),
  so a lone request goes through the same GEMM kernels as a full batch and as a
  verifier's prefill.
- A finished slot's outputs are copied out (device to device) before a new request's
  prefill is enqueued on the same stream, so a joining request never overwrites them.
- Supports decoder-only models whose layers are Llama-shaped (Llama, Qwen2, Mistral:
  pre-norm, q/k/v/o projections, rotary embeddings, gated MLP); `supports` says which.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from node.engines.base import GenerationRequest, GenerationResult
from verifier.fused_sampling import row_best_and_lse, triton_available
from verifier.noise import noise_from_keys, row_keys, seed_key
from verifier.sampling import strict_mask

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
LEN_BUCKET = 128  # decode attends to the cache up to the next multiple of this


def supports(model) -> bool:
    """Whether `model` has the layer shape this decoder runs (full attention everywhere)."""
    layer_types = getattr(model.config, "layer_types", None) or []
    return type(model).__name__ in SUPPORTED and "sliding_attention" not in layer_types


def _buckets(limit: int) -> list[int]:
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return [*out, limit]


@dataclass
class _Live:
    """Host-side state of one occupied slot."""

    key: object  # the caller's handle for the request
    request: GenerationRequest
    stop_hit: Callable[[list[int]], bool]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    read: int = 0  # completion tokens already read back


class SlotDecoder:
    def __init__(
        self,
        model,
        *,
        slots: int,
        max_len: int,
        max_new: int,
        eos_ids: frozenset[int],
        window: int = 8,
        graphs: bool | None = None,
        min_rows: int = 1,
    ):
        self.model = model
        self.base = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        cfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.slots, self.max_len, self.window = slots, max_len, window
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        attn0 = self.base.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.scaling = attn0.scaling
        self.vocab = self.lm_head.weight.shape[0]
        self.eos = eos_ids
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.fused = triton_available(self.device)
        layers, dev = len(self.base.layers), self.device
        # Output columns past max_new absorb the steps a finished slot runs before readback.
        self.cols = max_new + 2 * window + 1
        kv = (layers, slots, self.n_kv, max_len, self.head_dim)
        self.k_cache = torch.zeros(kv, dtype=self.dtype, device=dev)
        self.v_cache = torch.zeros(kv, dtype=self.dtype, device=dev)
        self.out_tokens = torch.zeros((slots, self.cols), dtype=torch.int64, device=dev)
        self.out_logprobs = torch.zeros((slots, self.cols), dtype=torch.float32, device=dev)
        self.out_hidden = torch.zeros(
            (slots, self.cols, cfg.hidden_size), dtype=self.dtype, device=dev
        )
        # Per-slot state the captured step reads and advances.
        self.pos = torch.zeros(slots, dtype=torch.int64, device=dev)  # next cache position
        self.gen_pos = torch.zeros(slots, dtype=torch.int64, device=dev)  # next completion index
        self.next_tok = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.seed_keys = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.t = torch.ones(slots, dtype=torch.float32, device=dev)
        self.top_k = torch.full((slots,), self.vocab, dtype=torch.int64, device=dev)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=dev)
        self.stochastic = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.filtering = [False] * slots  # host mirror: does this slot's request filter?
        # A step runs at least `min_rows` rows: the GEMMs of fewer rows sum in another
        # order than a verifier's prefill (`EngineConfig.decode_min_rows`).
        self.slot_buckets = [b for b in _buckets(slots) if b >= min(min_rows, slots)]
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.steps_run = 0

    # -- sampling (shared by prefill and step) ---------------------------------------
    def _sample(
        self, logits: torch.Tensor, rows: slice | torch.Tensor, positions: torch.Tensor, filt: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, stoch = self.t[rows], self.stochastic[rows]
        keys = row_keys(self.seed_keys[rows], positions)
        if self.fused and not filt:
            _, tokens, lse = row_best_and_lse(logits, t, keys, stoch)
            picked = logits.gather(-1, tokens[:, None])[:, 0].float() / t
            return tokens, picked - lse
        scaled = logits.float() / t[:, None]
        scores = scaled
        if filt:  # the strict support, without support_mask's host-side shortcut
            mask = strict_mask(scaled, self.top_k[rows], self.top_p[rows])
            scores = scores.masked_fill(~mask, float("-inf"))
        scores = scores + noise_from_keys(keys, self.vocab) * stoch[:, None]
        tokens = scores.argmax(dim=-1)
        picked = scaled.gather(-1, tokens[:, None])[:, 0]
        return tokens, picked - torch.logsumexp(scaled, dim=-1)

    # -- the model, layer by layer ---------------------------------------------------
    def _layers(self, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        cos, sin = self.base.rotary_emb(x, positions)
        b, s, _ = x.shape
        for i, layer in enumerate(self.base.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
            k = a.k_proj(h).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
            v = a.v_proj(h).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            o = attend(i, q, k, v)  # [b, s, n_heads * head_dim]
            x = x + a.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.base.norm(x)

    # -- prefill of joining requests -------------------------------------------------
    def _prefill(self, slot_ids: list[int], requests: list[GenerationRequest]) -> None:
        """Write the prompts' KV into their slots and sample each one's first token."""
        dev, n = self.device, len(slot_ids)
        lens = [len(r.prompt_ids) for r in requests]
        width = max(lens)
        ids = torch.zeros((n, width), dtype=torch.int64)
        for i, r in enumerate(requests):
            ids[i, : lens[i]] = torch.tensor(r.prompt_ids)
        rows = torch.tensor(slot_ids, dtype=torch.int64, device=dev)
        lens_d = torch.tensor(lens, dtype=torch.int64, device=dev)
        ids = ids.to(dev)
        positions = torch.arange(width, device=dev)[None, :].expand(n, width)
        ar = torch.arange(width, device=dev)
        # Causal, and no key past the prompt (right padding).
        mask = (ar[None, :, None] >= ar[None, None, :]) & (
            ar[None, None, :] < lens_d[:, None, None]
        )
        mask = mask[:, None]
        group = self.n_heads // self.n_kv

        def attend(i: int, q, k, v):
            self.k_cache[i, rows, :, :width] = k
            self.v_cache[i, rows, :, :width] = v
            o = F.scaled_dot_product_attention(
                q,
                k.repeat_interleave(group, dim=1),
                v.repeat_interleave(group, dim=1),
                attn_mask=mask,
                scale=self.scaling,
            )
            return o.transpose(1, 2).reshape(n, width, -1)

        x = self._layers(self.base.embed_tokens(ids), positions, attend)
        last = x[torch.arange(n, device=dev), lens_d - 1]  # [n, H]
        logits = self.lm_head(last)
        filt = any(self.filtering[s] for s in slot_ids)
        zero = torch.zeros(n, dtype=torch.int64, device=dev)
        tokens, logprobs = self._sample(logits, rows, zero, filt)
        self.out_tokens[rows, 0] = tokens
        self.out_logprobs[rows, 0] = logprobs
        self.out_hidden[rows, 0] = last
        self.next_tok[rows] = tokens
        self.pos[rows] = lens_d
        self.gen_pos[rows] = 1

    # -- one decode step over the first `b` slots -------------------------------------
    def _step(self, b: int, length: int, filt: bool) -> None:
        pos, gen = self.pos[:b], self.gen_pos[:b]
        ar_b = torch.arange(b, device=self.device)
        mask = (torch.arange(length, device=self.device)[None, :] <= pos[:, None])[:, None, None]
        group = self.n_heads // self.n_kv

        def attend(i: int, q, k, v):
            self.k_cache[i, ar_b, :, pos] = k[:, :, 0]
            self.v_cache[i, ar_b, :, pos] = v[:, :, 0]
            # Grouped-query decode: the query heads of one KV head are its query rows.
            qg = q.reshape(b, self.n_kv, group, self.head_dim)
            o = F.scaled_dot_product_attention(
                qg,
                self.k_cache[i, :b, :, :length],
                self.v_cache[i, :b, :, :length],
                attn_mask=mask,
                scale=self.scaling,
            )
            return o.reshape(b, 1, -1)

        x = self.base.embed_tokens(self.next_tok[:b, None])
        hidden = self._layers(x, pos[:, None], attend)[:, 0]
        logits = self.lm_head(hidden)
        tokens, logprobs = self._sample(logits, slice(0, b), gen, filt)
        col = gen.clamp(max=self.cols - 1)
        self.out_tokens[ar_b, col] = tokens
        self.out_logprobs[ar_b, col] = logprobs
        self.out_hidden[ar_b, col] = hidden
        self.next_tok[:b] = tokens
        pos.add_(1).clamp_(max=self.max_len - 1)
        gen.add_(1)

    def _run_step(self, b: int, length: int, filt: bool) -> None:
        self.steps_run += 1
        if not self.graphs:
            self._step(b, length, filt)
            return
        key = (b, length, filt)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(b, length, filt)
        graph.replay()

    def _capture(self, b: int, length: int, filt: bool) -> torch.cuda.CUDAGraph:
        """Capture one step; the warm-up runs (kernels compile, buffers settle) are undone."""
        state = [x.clone() for x in (self.pos, self.gen_pos, self.next_tok)]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(b, length, filt)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(b, length, filt)
        for x, saved in zip((self.pos, self.gen_pos, self.next_tok), state, strict=True):
            x.copy_(saved)
        return graph

    # -- the driver ------------------------------------------------------------------
    def run(
        self,
        pending: Iterator[tuple[object, GenerationRequest]],
        stop_hit: Callable[[GenerationRequest], Callable[[list[int]], bool]],
        more: Callable[[int], list[tuple[object, GenerationRequest]]] | None = None,
    ) -> Iterator[list[tuple[object, GenerationResult]]]:
        """Decode every request of `pending` (and of `more(free_slots)`, asked at each
        readback), yielding the (key, result) pairs that finished at each readback."""
        queue = list(pending)
        queue.reverse()  # pop() takes them in order
        live: dict[int, _Live] = {}
        prev: tuple | None = None  # the previous window's readback, still in flight
        while True:
            if more is not None and len(live) + len(queue) < self.slots:
                got = more(self.slots - len(live) - len(queue))
                queue[:0] = list(reversed(got))
            free = [s for s in range(self.slots) if s not in live]
            if free and queue:
                self._admit(free, queue, live, stop_hit)
            if not live and prev is None:
                return
            if live:
                b = next(x for x in self.slot_buckets if x > max(live))
                longest = max(len(lv.request.prompt_ids) + lv.read for lv in live.values())
                length = min(
                    self.max_len,
                    # unread tokens (two windows) and this window's steps ahead of `read`
                    math.ceil((longest + 3 * self.window + 2) / LEN_BUCKET) * LEN_BUCKET,
                )
                filt = any(self.filtering[s] for s in live)
                for _ in range(self.window):
                    self._run_step(b, length, filt)
                cur = self._readback(b, live)
            else:
                cur = None
            if prev is not None:
                done = list(self._settle(prev, live))
                if done:
                    yield done
            prev = cur

    def _admit(self, free, queue, live, stop_hit) -> None:
        take = min(len(free), len(queue))
        slots = free[:take]
        reqs = [queue.pop() for _ in range(take)]
        for s, (key, r) in zip(slots, reqs, strict=True):
            sp = r.sampling
            live[s] = _Live(key, r, stop_hit(r))
            self.filtering[s] = (0 < sp.top_k < self.vocab) or sp.top_p < 1.0
        rows = torch.tensor(slots, dtype=torch.int64, device=self.device)
        sps = [r.sampling for _, r in reqs]
        self.seed_keys[rows] = torch.tensor(
            [seed_key(r.seed) for _, r in reqs], dtype=torch.int64
        ).to(self.device)
        self.t[rows] = torch.tensor(
            [sp.temperature if sp.temperature > 0 else 1.0 for sp in sps], dtype=torch.float32
        ).to(self.device)
        self.top_k[rows] = torch.tensor(
            [sp.top_k if 0 < sp.top_k < self.vocab else self.vocab for sp in sps]
        ).to(self.device)
        self.top_p[rows] = torch.tensor([sp.top_p for sp in sps], dtype=torch.float32).to(
            self.device
        )
        self.stochastic[rows] = torch.tensor([sp.temperature > 0 for sp in sps]).to(self.device)
        self._prefill(slots, [r for _, r in reqs])

    def _readback(self, b: int, live: dict[int, _Live]) -> tuple:
        """Start copying every live slot's unread tokens (non-blocking); `_settle` waits."""
        slots = sorted(live)
        start = torch.tensor([live[s].read for s in slots], dtype=torch.int64)
        n = 2 * self.window + 2  # unread tokens per slot: two windows and a prefill token
        cols = (start[:, None] + torch.arange(n)[None, :]).clamp(max=self.cols - 1)
        rows = torch.tensor(slots, dtype=torch.int64)[:, None].expand_as(cols)
        rows, cols = rows.to(self.device), cols.to(self.device)
        toks = self.out_tokens[rows, cols]
        lps = self.out_logprobs[rows, cols]
        host = torch.stack([toks.double(), lps.double()]).to("cpu", non_blocking=True)
        gen = self.gen_pos[torch.tensor(slots, device=self.device)].to("cpu", non_blocking=True)
        event = torch.cuda.Event() if self.device.type == "cuda" else None
        if event is not None:
            event.record()
        return [live[s] for s in slots], slots, start.tolist(), host, gen, event

    def _settle(self, prev: tuple, live: dict[int, _Live]) -> Iterator[tuple]:
        lives, slots, starts, host, gen, event = prev
        if event is not None:
            event.synchronize()
        toks, lps, gen = host[0].tolist(), host[1].tolist(), gen.tolist()
        for j, s in enumerate(slots):
            lv = lives[j]
            if live.get(s) is not lv:  # finished at the previous readback
                continue
            sp = lv.request.sampling
            finish = None
            # The copy began at `starts[j]`; an earlier readback may have read part of it.
            for k in range(lv.read - starts[j], gen[j] - starts[j]):
                tok = int(toks[j][k])
                lv.tokens.append(tok)
                lv.logprobs.append(lps[j][k])
                if (tok in self.eos and not sp.ignore_eos) or lv.stop_hit(lv.tokens):
                    finish = "stop"
                elif len(lv.tokens) >= sp.max_tokens:
                    finish = "length"
                if finish:
                    break
            lv.read = len(lv.tokens)
            if finish:
                n = len(lv.tokens)
                rows = self.out_hidden[s, :n].clone()  # before a new prefill reuses the slot
                del live[s]
                yield lv.key, GenerationResult(lv.tokens, lv.logprobs, finish, rows)
