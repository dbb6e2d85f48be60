"""Inference engines behind one interface (`base.InferenceEngine`): `torch` and `vllm`."""

from __future__ import annotations

from node.engines.base import GenerationRequest, GenerationResult, InferenceEngine, PrefillResult
from protocol.messages import EngineMix

__all__ = [
    "GenerationRequest",
    "GenerationResult",
    "InferenceEngine",
    "PrefillResult",
    "create_engine",
    "engine_mix",
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


def engine_mix(engine, kind: str) -> EngineMix:
    """The (engine, dtype, device kind, decode) a loaded engine generates with."""
    dtype = str(getattr(engine, "dtype", "torch.float32")).removeprefix("torch.")
    device = str(getattr(engine, "device", "cpu")).split(":")[0]
    decode = getattr(engine, "decode", None) if kind == "torch" else None
    return EngineMix(engine=kind, dtype=dtype, device=device, decode=decode)
