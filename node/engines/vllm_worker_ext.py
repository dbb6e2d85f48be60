"""Code that runs inside vLLM's worker process for the `vllm` engine (vLLM v1 API).

Two pieces, both loaded by vLLM from their qualified names (vLLM is never patched at
import time):
- `SeededSampler`, a v1 custom logits processor. For every request tagged by
  `node.engines.vllm_engine` it computes the project's seeded choice
  (`verifier.sampling.sample` on the raw logits, completion index = number of tokens
  generated so far) and masks every other logit to -inf, so whatever vLLM's own sampler
  does (the engine asks it for greedy) it must pick that token. It records the reported
  logprob, log_softmax(logits / T)[token], and the top alternatives when asked.
- `CaptureExtension`, a worker extension (`LLM(worker_extension_cls=...)`). Its
  `ps_install` RPC wraps this worker's `model_runner.execute_model` (an instance
  attribute, set at run time) so that after every forward the last-layer, post-final-norm
  hidden states of tagged requests are copied out, keyed by absolute position; its
  `ps_collect` RPC hands rows, logits and the sampler's records back to the engine.

Invariants:
- Row at absolute position P-1+k (P = prompt length) is the state that produced
  completion token k, as in `node.engines.base`; rows are keyed by position, so chunked
  or recomputed (preempted) prefills overwrite, never shift, them.
- The logits the sampler sees are vLLM's float32 `compute_logits` of those same rows,
  before any vLLM temperature/top-k/top-p: the same quantity the torch engine samples from.
- Per-request state lives only in this process and is dropped by `ps_collect`.
- Needs `async_scheduling=False` (so a request's output list is current when `apply`
  runs) and no speculative decoding (vLLM refuses custom logits processors with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save as save_tensors
from vllm import SamplingParams as VLLMSamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from verifier.sampling import RowParams, sample

EXTRA_KEY = "prime_swarm"
"""Key of our per-request metadata in vLLM's `SamplingParams.extra_args`:
{"tag": str, "rows_from": int, "sample": None | {"seed", "temperature", "top_k", "top_p",
"top_logprobs"}}. Requests without it are left to vLLM untouched."""

# Per-process stores, filled during forwards and emptied by `ps_collect`.
_ROWS: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # tag -> [(positions, rows)]
# tag -> completion index k -> (token, logprob, top alternatives [[id, logprob], ...])
_RECORDS: dict[str, dict[int, tuple[int, float, list]]] = {}


def _meta(params: VLLMSamplingParams | None) -> dict[str, Any] | None:
    extra = getattr(params, "extra_args", None) or {}
    return extra.get(EXTRA_KEY)


@dataclass
class _Row:
    tag: str
    params: RowParams
    seed: int
    top_n: int
    output_ids: list[int]  # vLLM's live list of this request's generated tokens


class SeededSampler(LogitsProcessor):
    """Forces every tagged row to the project's seeded sampler's choice."""

    @classmethod
    def validate_params(cls, sampling_params: VLLMSamplingParams) -> None:
        meta = _meta(sampling_params)
        if meta is None:
            return
        if not isinstance(meta.get("tag"), str) or not isinstance(meta.get("rows_from"), int):
            raise ValueError(f"extra_args[{EXTRA_KEY!r}] needs a str 'tag' and an int 'rows_from'")
        s = meta.get("sample")
        if (
            s is not None
            and not {"seed", "temperature", "top_k", "top_p", "top_logprobs"} <= s.keys()
        ):
            raise ValueError(f"extra_args[{EXTRA_KEY!r}]['sample'] lacks sampling fields")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, _Row] = {}  # persistent-batch index -> request state

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax: applied before vLLM's sampling, greedy included

    @staticmethod
    def _new_row(
        params: VLLMSamplingParams, _prompt: list[int] | None, output_ids: list[int]
    ) -> _Row | None:
        meta = _meta(params)
        if meta is None or meta.get("sample") is None:
            return None
        s = meta["sample"]
        return _Row(
            meta["tag"],
            RowParams(float(s["temperature"]), int(s["top_k"]), float(s["top_p"])),
            int(s["seed"]),
            int(s["top_logprobs"]),
            output_ids,
        )

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._new_row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        index = sorted(i for i in self.rows if i < logits.shape[0])
        if not index:
            return logits
        rows = [self.rows[i] for i in index]
        positions = [len(r.output_ids) for r in rows]  # completion index k of the token chosen now
        idx = torch.tensor(index, dtype=torch.long, device=logits.device)
        sub = logits.index_select(0, idx).float()
        out = sample(sub, [r.params for r in rows], [r.seed for r in rows], positions)
        chosen = out.tokens[:, None]
        top_n = max(r.top_n for r in rows)
        if top_n:
            scale = torch.tensor([r.params.scale for r in rows], device=sub.device)[:, None]
            top = torch.log_softmax(sub / scale, dim=-1).topk(min(top_n, sub.shape[-1]), dim=-1)
            top_ids, top_vals = top.indices.tolist(), top.values.tolist()
        toks, lps = out.tokens.tolist(), out.logprobs.tolist()
        for j, r in enumerate(rows):
            top_list = (
                [[int(t), v] for t, v in zip(top_ids[j], top_vals[j], strict=True)][: r.top_n]
                if r.top_n
                else []
            )
            _RECORDS.setdefault(r.tag, {})[positions[j]] = (toks[j], lps[j], top_list)
        forced = torch.full_like(sub, float("-inf")).scatter_(-1, chosen, sub.gather(-1, chosen))
        logits.index_copy_(0, idx, forced.to(logits.dtype))
        return logits


def _capture(runner) -> None:
    """Copy the tagged requests' hidden-state rows of the forward that just ran."""
    state = runner.execute_model_state
    if state is None:  # nothing sampled this step (e.g. not the last pipeline stage)
        return
    n = runner.input_batch.num_reqs
    req_ids = runner.input_batch.req_ids[:n]
    starts = runner.query_start_loc.cpu[: n + 1].tolist()
    if runner.positions.dim() != 1:
        raise NotImplementedError("multi-dimensional (M-RoPE) positions are not supported")
    positions = runner.positions[: starts[-1]].to("cpu")
    picks: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (tag, positions, row indices)
    for i, rid in enumerate(req_ids):
        req = runner.requests.get(rid)
        meta = _meta(req.sampling_params if req is not None else None)
        if meta is None:
            continue
        pos = positions[starts[i] : starts[i + 1]]
        keep = pos >= meta["rows_from"]
        if bool(keep.any()):
            picks.append((meta["tag"], pos[keep], torch.nonzero(keep)[:, 0] + starts[i]))
    if not picks:
        return
    # One gather and one device->host copy per forward.
    flat = torch.cat([p[2] for p in picks]).to(state.hidden_states.device)
    rows = state.hidden_states.index_select(0, flat).to("cpu")
    at = 0
    for tag, pos, ix in picks:
        _ROWS.setdefault(tag, []).append((pos, rows[at : at + len(ix)]))
        at += len(ix)


class CaptureExtension:
    """Worker extension: hidden-state capture and collection RPCs (prefixed `ps_`)."""

    def ps_install(self) -> bool:
        """Wrap this worker's `model_runner.execute_model` with the capture (idempotent)."""
        runner = self.model_runner  # type: ignore[attr-defined]
        if getattr(runner, "_ps_capture_installed", False):
            return True
        original = runner.execute_model

        def execute_model(*args, **kwargs):
            out = original(*args, **kwargs)
            _capture(runner)
            return out

        runner.execute_model = execute_model
        runner._ps_capture_installed = True
        return True

    def ps_collect(
        self, specs: list[tuple[str, int, int]], with_logits: bool
    ) -> tuple[bytes, dict]:
        """For each (tag, first position, row count): the rows [count, H] (engine dtype),
        and with `with_logits` their float32 logits. Returns (safetensors bytes, sampler
        records {tag: [[k, token, logprob, top], ...]}) and empties this process's stores."""
        runner = self.model_runner  # type: ignore[attr-defined]
        tensors: dict[str, torch.Tensor] = {}
        missing = []
        for tag, first, count in specs:
            chunks = _ROWS.get(tag, [])
            width = chunks[0][1].shape[-1] if chunks else 0
            out = torch.zeros((count, width), dtype=chunks[0][1].dtype if chunks else torch.float32)
            seen = torch.zeros(count, dtype=torch.bool)
            for pos, rows in chunks:  # later chunks (recomputed prefills) overwrite earlier ones
                rel = pos - first
                ok = (rel >= 0) & (rel < count)
                out[rel[ok]] = rows[ok]
                seen[rel[ok]] = True
            if not bool(seen.all()):
                missing.append(f"{tag}: {int((~seen).sum())}/{count} rows")
                continue
            tensors[f"{tag}/hidden"] = out.contiguous()
            if with_logits:
                with torch.inference_mode():
                    logits = runner.model.compute_logits(out.to(runner.device))
                tensors[f"{tag}/logits"] = logits.float().cpu().contiguous()
        records = {
            tag: [[k, tok, lp, top] for k, (tok, lp, top) in sorted(_RECORDS.get(tag, {}).items())]
            for tag, _, _ in specs
        }
        _ROWS.clear()
        _RECORDS.clear()
        if missing:
            raise RuntimeError(f"hidden-state rows were not captured for {'; '.join(missing)}")
        return save_tensors(tensors), records
