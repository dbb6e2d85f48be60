"""The `InferenceEngine` interface every engine implements.

Invariants every implementation keeps:
- Tokens are chosen by `verifier.sampling.sample` (seeded Gumbel-max over top-k/top-p
  filtered logits / T), so any verifier can replay them, whatever engine made them.
- `GenerationResult.hidden_states[k]` is the last-layer (post-final-norm) hidden state
  that produced completion token k (on the CPU, or on the engine's GPU); `PrefillResult` returns the same rows computed in one
  forward pass over prompt + completion, so proofs from one engine verify on another.
- Reported logprobs are under log_softmax(logits / T), T = 1 for greedy.
- `load_weights` is applied between batches, never in the middle of one.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from protocol.messages import FinishReason, ProofParams, SamplingParams


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int
    top_logprobs: int = 0  # alternatives to report per position (OpenAI surface only)
    proof: ProofParams | None = None  # the proof layout its rollout needs (built by the worker)


@dataclass
class GenerationResult:
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    hidden_states: torch.Tensor  # [N, H], engine dtype, on CPU or the engine's device
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per position, best first


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [N, V] float32: row k produced completion token k
    hidden_states: torch.Tensor  # [N, H] on CPU, engine dtype


@dataclass
class PrefillBatch:
    """The verifier's side of several (prompt, completion) items from one forward pass."""

    rows: torch.Tensor  # [sum N_i, H] hidden rows in item order, on the engine's device
    sizes: list[int]  # N_i: completion tokens of item i
    # [sum N_i, V] logits of those rows: a tensor, or `verifier.sampling.RowLogits` that
    # makes them a block at a time
    logits: object


def hash_weights_dir(path: str | Path) -> str:
    """Hex SHA-256 over the safetensors files of a weights folder (name and content)."""
    h = hashlib.sha256()
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    for f in files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


class InferenceEngine(ABC):
    """Generates completions with proofs' raw material and recomputes them for checks."""

    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    weights_version: int = 0
    weights_hash: str = ""

    @abstractmethod
    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Generate one completion per request (batched)."""

    def generate_stream(
        self,
        requests: list[GenerationRequest],
        more: Callable[[int], list[tuple[int, GenerationRequest]]],
        emit: Callable[[list[tuple[int, GenerationResult]]], None],
    ) -> None:
        """Generate `requests` (numbered 0..n-1) and whatever `more(k)` hands over while it
        runs (numbered by the caller), passing finished results to `emit` in groups as they
        end. An engine without continuous batching runs `requests` as one batch."""
        emit(list(enumerate(self.generate(requests))))

    @abstractmethod
    def prefill(self, items: list[tuple[list[int], list[int]]]) -> list[PrefillResult]:
        """For each (prompt_ids, completion_ids): logits and hidden states of the rows that
        produced the completion tokens, from one forward pass (no sampling)."""

    def prefill_batch(self, items: list[tuple[list[int], list[int]]]) -> PrefillBatch:
        """`prefill` with every item's rows and logits in one tensor each, in item order."""
        pre = self.prefill(items)
        return PrefillBatch(
            rows=torch.cat([p.hidden_states for p in pre]),
            sizes=[p.logits.shape[0] for p in pre],
            logits=torch.cat([p.logits for p in pre]),
        )

    @abstractmethod
    def load_weights(self, path: str | Path, version: int, weights_hash: str = "") -> None:
        """Swap in the safetensors weights under `path` as policy `version`."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of logits per row."""

    @property
    def decode_steps(self) -> dict[str, int]:
        """Decode steps run so far per decode path that counts them (shown in /health, so an
        operator sees which path serves)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release engine resources."""
