"""Configuration of the trusted side: `prime-trainer rl | train | orchestrate | sft | eval`.

One model per process (`TrainerConfig`, `OrchestratorConfig`, `SFTConfig`, `EvalConfig`)
and `RLConfig`, which composes a trainer and an orchestrator for one run and hands each
the settings they must agree on (run directory, model, steps, async_level, batch shape).

Invariants: every field is documented where it is declared; unknown keys, wrong types
and impossible combinations (a batch not divisible by its group size, async_level < 0,
a warm-up longer than the run) fail before anything starts, with a message that names the
key; every process writes its resolved config into `<run_dir>/configs/`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from protocol.config import PrimeSettings, Section
from protocol.swarm.config import SwarmConfig, SwarmToolSettings
from verifier.models import check_model_name


def check_api_key_file_exists(v: Path | None) -> Path | None:
    if v is not None and not v.expanduser().is_file():
        raise ValueError(
            f"API key file {v} not found: the pool owner issues keys with "
            "`prime-scheduler pool api-key` (write the printed key to that file)"
        )
    return v


def _check_whole_groups(batch_size: int, group_size: int) -> None:
    if batch_size % group_size:
        raise ValueError(
            f"batch_size ({batch_size}) must be a multiple of group_size "
            f"({group_size}): each prompt contributes one whole group"
        )


class ModelConfig(Section):
    """Which causal LM is trained, and how it is laid out in memory."""

    name: str = "tiny"
    """'tiny' (random Qwen2, char tokenizer), 'smollm2' (bundled) or a Hugging Face model folder."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter dtype for compute: 'auto' is bf16 on GPU (fp32 master weights kept by FSDP2's
    mixed precision) and fp32 on CPU."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel passed to transformers."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory, ~30% more compute)."""
    compile: bool = False
    """torch.compile each decoder layer (GPU; slow to start on CPU)."""

    @field_validator("name")
    @classmethod
    def check_model_exists(cls, v: str) -> str:
        return check_model_name(v)


class OptimConfig(Section):
    """AdamW with a learning-rate schedule and gradient clipping."""

    lr: float = Field(1e-5, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    max_norm: float = Field(1.0, gt=0)
    """Gradients are clipped to this global L2 norm."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up from 0 to `lr` over this many steps."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up, down to `min_lr_ratio * lr` at the last step."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Floor of the decay, as a fraction of `lr`."""

    @field_validator("betas")
    @classmethod
    def check_betas_in_unit_interval(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"AdamW betas must lie in [0, 1), got {v}")
        return v


class LossConfig(Section):
    """The AIPO token-level objective (DESIGN.md section 2, step 7)."""

    delta: float = Field(8.0, gt=1)
    """Cap on the importance ratio pi_theta / mu (mu: the workers' logprobs)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of a k3 KL penalty between the policy and the workers' logprobs (0: off)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of an entropy bonus (0: off)."""
    logprob_chunk: int = Field(4096, ge=1)
    """Tokens per chunk when turning hidden states into logprobs over the vocabulary: the
    full [tokens, vocab] logits tensor is never held at once, only [chunk, vocab] (4096 x
    a 152k vocabulary: 1.2 GB of bf16 logits plus float32 work; larger chunks run faster
    on a GPU, smaller ones hold less)."""
    temperature: float = Field(1.0, gt=0)
    """The trainer's logprobs are those of softmax(logits / temperature): set it to the
    temperature under which the workers' logprobs mu were computed."""


class CheckpointConfig(Section):
    """When state is saved and how much is kept."""

    interval: int = Field(5, ge=1)
    """Save trainer and orchestrator state every this many steps (and at the last step)."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept; older ones are deleted."""
    resume: bool = False
    """Continue from the newest checkpoint in the run directory (same data order)."""


class WeightsConfig(Section):
    """How each new policy reaches the workers (DESIGN.md section 2, step 8)."""

    transport: Literal["filesystem", "swarm"] = "filesystem"
    """'filesystem': a shared folder with a stable marker per step (single machine or a
    shared filesystem). 'swarm': the trainer cuts each step into pieces under a signed
    manifest and seeds it over libp2p; workers fetch pieces from each other."""
    keep_last: int = Field(3, ge=1)
    """Weight versions kept on disk beyond what async_level still needs."""
    swarm: SwarmConfig = SwarmConfig(relay_service=True, use_relay=False)
    """The trainer's swarm peer (swarm transport): listen address, upload cap, piece size.
    It is also the pool's relay: workers behind NAT reserve a slot on it."""
    trainer_key: Path = Path("keys/trainer.key")
    """Key that signs swarm manifests: the pool's trainer key (swarm transport)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The dtype weights are published in: what the pool's workers serve, so a bf16 pool
    gets half the bytes of the fp32 master weights (which stay in checkpoints only).
    'auto': the dtype of the pool's engine mixes when `rl` knows the pool file (one dtype
    among them), else float32."""
    deltas: bool = True
    """Swarm transport: publish each step also as a delta against the step before (only
    the elements that changed, exact, zstd): a worker holding that version fetches the
    delta instead of the whole model, rebuilds the new version and checks it against its
    full manifest before loading it."""
    keyframe_interval: int = Field(50, ge=1)
    """Every this many steps a version is published full only (no delta), which bounds how
    long a chain of deltas gets. Every version is also published in full and peers seed
    the versions they rebuilt, so no node needs a keyframe to catch up: keyframes cost a
    full broadcast each (measured: at lr 1e-6 an interval of 10 ships 10.5% of the model
    per step on average, against 0.5% for the deltas alone)."""
    delta_max_fraction: float = Field(0.5, gt=0, le=1)
    """A delta larger than this fraction of the full version is not published (most values
    changed: the full version pays)."""


class MonitorConfig(Section):
    """What a run reports while it runs."""

    progress: bool = True
    """A rich progress display on the terminal."""
    wandb_project: str | None = None
    """Also log to this Weights & Biases project (needs `wandb` installed and a login)."""
    plot: bool = True
    """Write a PNG of reward and loss curves into the run directory at the end."""


class RunSettings(PrimeSettings):
    """Fields every trusted-side process has."""

    run_dir: Path = Path("runs/default")
    """Run directory: configs/, checkpoints/, weights/, rollouts/, logs/ and metrics.jsonl."""
    seed: int = 0
    """Seed for model initialisation, data order and sampling seeds on the trusted side."""
    monitor: MonitorConfig = MonitorConfig()
    """Progress, metrics file, W&B, plots."""


class TrainerConfig(RunSettings):
    """`prime-trainer train`: learns from the orchestrator's batches, writes weights."""

    model: ModelConfig = ModelConfig()
    """The policy being trained."""
    optim: OptimConfig = OptimConfig()
    """Optimizer and schedule."""
    loss: LossConfig = LossConfig()
    """RL objective."""
    ckpt: CheckpointConfig = CheckpointConfig()
    """Checkpoints."""
    weights: WeightsConfig = WeightsConfig()
    """Weight transport to the workers."""
    max_steps: int = Field(20, ge=1)
    """Optimizer steps of the run."""
    async_level: int = Field(2, ge=0)
    """Policy updates allowed between generating a sample and training on it (step n
    trains policy n - 1 into n; a sample of policy v is used only if n - 1 - v <=
    async_level). 0: synchronous on-policy RL."""
    micro_batch_tokens: int = Field(4096, ge=16)
    """Tokens per packed micro-batch (several samples share one row; attention never
    crosses a sample boundary)."""
    micro_batch_rows: int = Field(1, ge=1)
    """Rows of micro_batch_tokens each processed in one forward ([rows, width], shorter rows
    padded at the end with tokens that carry no loss): >1 trades memory for GPU efficiency."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: 'auto' picks CUDA when present."""
    batch_timeout_s: float = Field(3600.0, gt=0)
    """Give up when the orchestrator has produced no batch for this long."""
    peak_flops: float | None = Field(None, gt=0)
    """Peak FLOP/s of one device, for the `mfu` metric (None: 989e12 on an H100/H200 in
    bf16, unknown elsewhere, and then mfu is reported as 0)."""

    @model_validator(mode="after")
    def check_warmup_fits_run(self) -> TrainerConfig:
        if self.optim.warmup_steps > self.max_steps:
            raise ValueError(
                f"optim.warmup_steps ({self.optim.warmup_steps}) exceeds max_steps ({self.max_steps})"
            )
        return self


class EnvConfig(Section):
    """A verifiers environment (classic in-process API, verifiers 0.3.x)."""

    id: str = "reverse-text"
    """A bundled environment ('reverse-text', 'count-turns') or 'module:function' returning
    a verifiers Environment."""
    args: dict[str, Any] = {}
    """Keyword arguments for the environment's loader (e.g. {num_examples = 500})."""


class SamplingConfig(Section):
    """Sampling parameters of every rollout request."""

    temperature: float = Field(1.0, gt=0)
    """Softmax temperature (RL needs exploration: keep it near 1)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    max_tokens: int = Field(64, ge=1)
    """Completion length cap per turn."""


class OrchestratorConfig(RunSettings):
    """`prime-trainer orchestrate`: environment -> rollout requests -> verified, scored batches."""

    env: EnvConfig = EnvConfig()
    """Where prompts and rewards come from."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters."""
    ckpt: CheckpointConfig = CheckpointConfig()
    """Orchestrator checkpoints (step, buffer, results cursor)."""
    weights: WeightsConfig = WeightsConfig()
    """Weight transport (must match the trainer's)."""
    pool: Path = Path("configs/pools/local.pool")
    """The signed pool file (gives pool id, model and the scheduler's trust anchors)."""
    scheduler: str = "http://127.0.0.1:7700"
    """Scheduler URL (comma-separated for replicas)."""
    trainer_key: Path = Path("keys/trainer.key")
    """The pool's trainer key: signs weight updates and rollout submissions."""
    model_name: str = ""
    """Model name sent in OpenAI requests ('' : the pool's model)."""
    api_key_file: Path | None = None
    """File holding the key to the scheduler's OpenAI endpoint (`prime-scheduler pool
    api-key`); None: no key (a pool's endpoint then answers 401)."""
    tokenizer: Path | None = None
    """Model folder whose tokenizer decodes the verified ids the rubric's text is checked
    against; None: the pool's model."""
    max_steps: int = Field(20, ge=1)
    """Batches to produce."""
    async_level: int = Field(2, ge=0)
    """Batch n is generated by policy >= n - 1 - async_level (0: synchronous on-policy)."""
    batch_size: int = Field(32, ge=1)
    """Rollouts (episodes) per training step."""
    group_size: int = Field(8, ge=2)
    """Rollouts per prompt; the advantage is reward minus the group's mean reward."""
    max_concurrent: int = Field(64, ge=1)
    """Episodes in flight at once."""
    max_rounds: int = Field(8, ge=1)
    """Generation rounds per step before a step goes ahead with fewer groups than asked
    (all-equal groups are dropped; a step must not spin forever on an easy dataset)."""

    _check_api_key_file = field_validator("api_key_file")(check_api_key_file_exists)

    @model_validator(mode="after")
    def check_batch_divisible_by_group(self) -> OrchestratorConfig:
        _check_whole_groups(self.batch_size, self.group_size)
        return self


class RLTrainerSection(Section):
    """Trainer settings of an `rl` run (run-wide settings come from the top level)."""

    optim: OptimConfig = OptimConfig()
    """Optimizer and schedule."""
    loss: LossConfig = LossConfig()
    """RL objective."""
    micro_batch_tokens: int = Field(4096, ge=16)
    """Tokens per packed micro-batch."""
    micro_batch_rows: int = Field(1, ge=1)
    """Rows of micro_batch_tokens each processed in one forward: >1 trades memory for GPU
    efficiency."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train."""
    nproc: int = Field(1, ge=1)
    """Trainer processes (torchrun --nproc-per-node) sharing the model with FSDP2."""


class RLOrchestratorSection(Section):
    """Orchestrator settings of an `rl` run."""

    env: EnvConfig = EnvConfig()
    """Environment."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters."""
    pool: Path = Path("configs/pools/local.pool")
    """The signed pool file."""
    scheduler: str = "http://127.0.0.1:7700"
    """Scheduler URL(s)."""
    trainer_key: Path = Path("keys/trainer.key")
    """The pool's trainer key."""
    api_key_file: Path | None = None
    """File holding the key to the scheduler's OpenAI endpoint (`prime-scheduler pool
    api-key`; a local swarm writes its own)."""
    tokenizer: Path | None = None
    """Model folder whose tokenizer decodes verified ids (None: the pool's model)."""
    max_concurrent: int = Field(64, ge=1)
    """Episodes in flight at once."""
    max_rounds: int = Field(8, ge=1)
    """Generation rounds per step before going ahead with fewer groups."""

    _check_api_key_file = field_validator("api_key_file")(check_api_key_file_exists)


class LocalSwarmConfig(Section):
    """The whole network on this machine (`prime-trainer rl --local-swarm.enabled true`): a
    scheduler (SQLite in the run directory), `workers` worker nodes and the trainer, each
    its own process on loopback; the launcher fills in the orchestrator's pool, scheduler
    and trainer key itself."""

    enabled: bool = False
    """Start the scheduler and the workers as well (off: `rl` uses an existing pool)."""
    workers: int = Field(3, ge=2, le=32)
    """Worker nodes (`prime-node join`); at least 2 (a rollout's verifier is never its
    generator), 3 or more to settle disputes."""
    sft: Path | None = None
    """SFT config run first (`prime-trainer sft @ <file>`) when the policy needs a warm-up;
    its model (`<run_dir>/sft/final`, reused if present) becomes the policy and the
    pool's model. '' : no warm-up, `model.name` is the policy."""
    verification: Path = Path("configs/verification/tiny-torch-cpu-fp32.toml")
    """Calibrated thresholds of the pool (`prime-node calibrate` output) for this model
    and engine mix."""
    pool_id: str = Field("local", min_length=1, max_length=64)
    """Pool id of the local pool."""
    heartbeat_interval_s: float = Field(2.0, gt=0)
    """Worker heartbeat period (a killed worker is declared dead after 15 of them)."""
    worker_upload_rate: int = Field(0, ge=0)
    """Upload cap of every worker's weight-swarm peer in bytes/s (0: none), to watch the
    swarm share the trainer's load on one machine."""
    pool_args: list[str] = []
    """Extra flags for `prime-scheduler pool create` (e.g. `--verification.audit-rate 1`)."""
    worker_args: list[str] = []
    """Extra flags for every `prime-node join` (e.g. `--engine.max-batch-size 64` on a GPU)."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """How long the scheduler and the workers may take to come up."""

    @field_validator("sft", mode="before")
    @classmethod
    def check_empty_means_no_warmup(cls, v: object) -> object:
        return None if v in ("", "none") else v

    @field_validator("sft", "verification")
    @classmethod
    def check_file_exists(cls, v: Path | None) -> Path | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(f"{v} is not a file")
        return v


class RLConfig(RunSettings):
    """`prime-trainer rl`: one run, a trainer and an orchestrator agreeing on its shape."""

    model: ModelConfig = ModelConfig()
    """Policy (also what the pool's workers must serve at version 0)."""
    max_steps: int = Field(20, ge=1)
    """Training steps."""
    async_level: int = Field(2, ge=0)
    """Policy updates allowed between generating a sample and training on it (0: synchronous)."""
    batch_size: int = Field(32, ge=1)
    """Rollouts per step."""
    group_size: int = Field(8, ge=2)
    """Rollouts per prompt."""
    ckpt: CheckpointConfig = CheckpointConfig()
    """Checkpoints of both processes."""
    weights: WeightsConfig = WeightsConfig()
    """Weight transport."""
    trainer: RLTrainerSection = RLTrainerSection()
    """Trainer-only settings."""
    orchestrator: RLOrchestratorSection = RLOrchestratorSection()
    """Orchestrator-only settings."""
    local_swarm: LocalSwarmConfig = LocalSwarmConfig()
    """Run the scheduler and the workers too, on this machine (the main demo)."""

    @model_validator(mode="after")
    def check_batch_divisible_by_group(self) -> RLConfig:
        _check_whole_groups(self.batch_size, self.group_size)
        return self

    def publish_dtype(self) -> str:
        """The weights' publishing dtype, 'auto' resolved from the pool's engine mixes."""
        if self.weights.dtype != "auto":
            return self.weights.dtype
        from protocol.envelope import open_envelope  # the pool file is an owner-signed envelope
        from protocol.messages import PoolConfig

        try:
            pool = open_envelope(
                self.orchestrator.pool.read_bytes(), PoolConfig, check_expiry=False
            ).message
        except (OSError, ValueError):
            return "float32"  # the orchestrator reports a missing or bad pool file itself
        dtypes = {m.dtype for m in pool.verification.engine_mixes}
        return dtypes.pop() if len(dtypes) == 1 else "float32"

    def _child_monitor(self) -> MonitorConfig:
        # The `rl` parent draws one progress display and the plot; children only log.
        return self.monitor.model_copy(update={"progress": False, "plot": False})

    def trainer_config(self) -> TrainerConfig:
        t, o_key = self.trainer, self.orchestrator.trainer_key
        return TrainerConfig(
            run_dir=self.run_dir,
            seed=self.seed,
            monitor=self._child_monitor(),
            model=self.model,
            optim=t.optim,
            loss=t.loss,
            ckpt=self.ckpt,
            # One trainer key for the run: the orchestrator's signs updates, this one manifests.
            weights=self.weights.model_copy(
                update={"trainer_key": o_key, "dtype": self.publish_dtype()}
            ),
            max_steps=self.max_steps,
            async_level=self.async_level,
            micro_batch_tokens=t.micro_batch_tokens,
            micro_batch_rows=t.micro_batch_rows,
            device=t.device,
        )

    def orchestrator_config(self) -> OrchestratorConfig:
        o = self.orchestrator
        return OrchestratorConfig(
            run_dir=self.run_dir,
            seed=self.seed,
            monitor=self._child_monitor(),
            ckpt=self.ckpt,
            weights=self.weights,
            max_steps=self.max_steps,
            async_level=self.async_level,
            batch_size=self.batch_size,
            group_size=self.group_size,
            **o.model_dump(),
        )


class SFTConfig(RunSettings):
    """`prime-trainer sft`: supervised warm-up on (prompt, completion) pairs."""

    model: ModelConfig = ModelConfig()
    """Model to fine-tune."""
    optim: OptimConfig = OptimConfig(lr=1e-3)
    """Optimizer and schedule."""
    env: EnvConfig = EnvConfig()
    """Environment whose bundled SFT data is used (reverse-text generates its own)."""
    num_examples: int = Field(2000, ge=1)
    """SFT examples generated."""
    batch_size: int = Field(32, ge=1)
    """Examples per optimizer step."""
    max_steps: int = Field(100, ge=1)
    """Optimizer steps."""
    micro_batch_tokens: int = Field(4096, ge=16)
    """Tokens per packed micro-batch."""
    micro_batch_rows: int = Field(1, ge=1)
    """Rows of micro_batch_tokens each processed in one forward: >1 trades memory for GPU
    efficiency."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train."""
    output: Path | None = None
    """Folder for the final model ('' : <run_dir>/final)."""


class EvalConfig(RunSettings):
    """`prime-trainer eval`: mean reward of a model on an environment, through a pool or a node."""

    env: EnvConfig = EnvConfig()
    """Environment."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters."""
    base_url: str = "http://127.0.0.1:7700/v1"
    """OpenAI-compatible endpoint (a scheduler's or a single node's)."""
    api_key_file: Path | None = None
    """File holding the endpoint's API key (a pool's: `prime-scheduler pool api-key`)."""
    model_name: str = "tiny"
    """Model name sent in requests."""
    num_examples: int = Field(32, ge=1)
    """Prompts evaluated."""
    rollouts_per_example: int = Field(1, ge=1)
    """Samples per prompt."""

    _check_api_key_file = field_validator("api_key_file")(check_api_key_file_exists)


class PublishConfig(SwarmToolSettings):
    """`prime-trainer publish`: cut a file or a weights folder into pieces, sign the
    manifest with the trainer key and seed it until stopped (for testing links)."""

    source: Path
    """A file, a weights folder (e.g. `<run_dir>/weights/step_3`) or an HF model folder."""
    step: int = Field(0, ge=0)
    """Version number written into the manifest."""
    trainer_key: Path = Path("keys/trainer.key")
    """Key that signs the manifest (workers trust only the pool's trainer key)."""
    manifest_out: Path | None = None
    """Where to write the signed manifest (default: `<folder>/.manifest`, or
    `<file>.manifest` for a single file)."""
    seed_for_s: float = Field(0.0, ge=0.0)
    """Stop after this many seconds (0: until interrupted)."""

    @field_validator("source")
    @classmethod
    def check_source_exists(cls, v: Path) -> Path:
        if not v.exists():
            raise ValueError(f"{v} does not exist")
        return v
