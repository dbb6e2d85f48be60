"""Helpers every engine shares: the dtype and device a config names, the EOS ids of a
model, and the stop-string watcher of the termination rule.

Owns the rules both engines must apply alike so that a rollout of one verifies on the other
(`node.engines.base`): 'auto' dtype is bfloat16 on a GPU and float32 on a CPU; EOS is the
union of the model config's and the tokenizer's EOS ids; a stop string ends a completion
as soon as the decoded text (special tokens kept) contains it.

Invariants: imports nothing of the engines (`torch_engine`, `vllm_engine` import it), and
nothing heavier than torch.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    """The device a config names; 'auto' is CUDA when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The dtype a config names; 'auto' is bfloat16 on CUDA, float32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def eos_ids(tokenizer, model_config) -> frozenset[int]:
    """Every EOS id of the model config and of the tokenizer (an int or a list each)."""
    ids = set()
    for src in (getattr(model_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list):
            ids.update(src)
    return frozenset(ids)


class StopWatcher:
    """Detects stop strings in a growing completion (decodes only rows that have any)."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stops = stops

    def hit(self, completion: list[int]) -> bool:
        if not self.stops:
            return False
        text = self.tokenizer.decode(completion, skip_special_tokens=False)
        return any(s in text for s in self.stops)
