"""Inference engines behind one interface (`base.InferenceEngine`): `torch` and `vllm`."""

from __future__ import annotations

from node.engines.base import GenerationRequest, GenerationResult, InferenceEngine, PrefillResult

__all__ = [
    "GenerationRequest",
    "GenerationResult",
    "InferenceEngine",
    "PrefillResult",
    "create_engine",
]


def create_engine(config) -> InferenceEngine:  # config: node.config.EngineConfig
    """Build the engine named by `config.kind`."""
    if config.kind == "torch":
        from node.engines.torch_engine import TorchEngine

        return TorchEngine(config)
    if config.kind == "vllm":
        from node.engines.vllm_engine import VLLMEngine

        return VLLMEngine(config)
    raise ValueError(f"unknown engine kind {config.kind!r}")
