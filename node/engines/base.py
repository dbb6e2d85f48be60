"""The `InferenceEngine` interface every engine implements.

Invariants every implementation keeps:
- Tokens are chosen by `verifier.sampling.sample` (seeded Gumbel-max over top-k/top-p
  filtered logits / T), so any verifier can replay them, whatever engine made them.
- `GenerationResult.hidden_states[k]` is the last-layer (post-final-norm) hidden state
  that produced completion token k; `PrefillResult` returns the same rows computed in one
  forward pass over prompt + completion, so proofs from one engine verify on another.
- Reported logprobs are under log_softmax(logits / T), T = 1 for greedy.
- `load_weights` is applied between batches, never in the middle of one.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from protocol.messages import FinishReason, SamplingParams


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int
    top_logprobs: int = 0  # alternatives to report per position (OpenAI surface only)


@dataclass
class GenerationResult:
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    hidden_states: torch.Tensor  # [N, H] on CPU, engine dtype
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per position, best first


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [N, V] float32: row k produced completion token k
    hidden_states: torch.Tensor  # [N, H] on CPU, engine dtype


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

    @abstractmethod
    def prefill(self, items: list[tuple[list[int], list[int]]]) -> list[PrefillResult]:
        """For each (prompt_ids, completion_ids): logits and hidden states of the rows that
        produced the completion tokens, from one forward pass (no sampling)."""

    @abstractmethod
    def load_weights(self, path: str | Path, version: int, weights_hash: str = "") -> None:
        """Swap in the safetensors weights under `path` as policy `version`."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of logits per row."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release engine resources."""
