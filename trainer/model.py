"""Loading the policy: any Hugging Face causal LM, plus the wrapper the trainer runs.

`PolicyModel` owns the HF model and computes per-token logprobs and entropies inside its
own forward, so that under FSDP2 (where the wrapper is the root unit) the final norm and
the LM head weight are unsharded while the chunked logprob code reads them.

Invariants: master weights are float32 (FSDP2's mixed precision casts to bf16 for
compute); the tokenizer always comes from `verifier.models.load_tokenizer` (the same
class the workers use); `PolicyModel.forward` never builds the [tokens, vocab] logits.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from trainer.config import ModelConfig
from trainer.loss import chunked_logprobs
from verifier.models import load_tokenizer, resolve_model


def pick_device(kind: str = "auto") -> torch.device:
    """'auto' -> CUDA (this rank's local device) when present, else CPU."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' asked for, but torch sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def compute_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """The dtype of forward/backward compute ('auto': bf16 on GPU, fp32 on CPU)."""
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def load_model(cfg: ModelConfig, device: torch.device | str = "cpu"):
    """(HF causal LM with float32 weights on `device`, tokenizer)."""
    from transformers import AutoModelForCausalLM

    folder = resolve_model(cfg.name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=cfg.attn_implementation
    )
    model.config.use_cache = False  # a KV cache in training would also defeat packed masks
    return model.to(device), load_tokenizer(folder)


def decoder_layers(hf_model: nn.Module) -> nn.ModuleList:
    """The transformer blocks (Llama/Qwen/Mistral-style `model.model.layers`)."""
    layers = getattr(getattr(hf_model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(hf_model).__name__} has no model.layers ModuleList")
    return layers


class PolicyModel(nn.Module):
    """HF causal LM -> (logprob of each next token, entropy) on packed rows [B, L], flat."""

    def __init__(self, hf_model: nn.Module, temperature: float = 1.0, chunk: int = 1024):
        super().__init__()
        self.lm = hf_model
        self.temperature = temperature
        self.chunk = chunk

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, targets: Tensor
    ) -> tuple[Tensor, Tensor]:
        # position_ids restarting at 0 make transformers build a block-diagonal causal mask
        # (no attention across packed samples); use_cache=False is what lets it do so.
        out = self.lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state.flatten(0, 1)
        return chunked_logprobs(
            hidden, self.lm.lm_head.weight, targets.flatten(), self.temperature, self.chunk
        )
