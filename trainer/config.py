"""Configuration of the trusted side: `prime-trainer rl | train | orchestrate | sft | eval`.

One model per process (`TrainerConfig`, `OrchestratorConfig`, `SFTConfig`, `EvalConfig`)
and `RLConfig`, which contains a trainer config and an orchestrator config for one run.
What the two must agree on is declared once (`RunShape`: run directory, seed, monitor,
steps, async_level, checkpoints, weights; `PolicySettings`: the model; `BatchShape`: the
batch) and inherited by the models that have it; an `rl` run sets each such field once, at
the top level, and `RLConfig` hands it to the process configs it contains.

Invariants: every field is documented where it is declared; unknown keys, wrong types
and impossible combinations (a batch not divisible by its group size, async_level < 0,
a warm-up longer than the run) fail before anything starts, with a message that names the
key; in an `rl` run, a shared field set under `trainer.`/`orchestrator.` to another value
than the run's, a loss temperature other than the sampling temperature, and an async_level
other than the signed pool's are refused naming both values; every field `rl` accepts
reaches the process it configures; every process writes its resolved config into
`<run_dir>/configs/`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, Field, field_validator, model_validator

from protocol.config import PrimeSettings, Section, deep_merge, parse_args
from protocol.messages import PoolConfig
from protocol.swarm.config import SwarmConfig, SwarmToolSettings
from verifier.models import check_model_name


def check_api_key_file_exists(v: Path | None) -> Path | None:
    if v is not None and not v.expanduser().is_file():
        raise ValueError(
            f"API key file {v} not found: the pool owner issues keys with "
            "`prime-scheduler pool api-key` (write the printed key to that file)"
        )
    return v


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
    temperature under which the workers' logprobs mu were computed (an `rl` run sets it to
    `orchestrator.sampling.temperature` and refuses another value)."""


class CheckpointConfig(Section):
    """When state is saved and how much is kept."""

    interval: int = Field(5, ge=1)
    """Save trainer and orchestrator state every this many steps (and at the last step)."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept; older ones are deleted."""
    resume: bool = False
    """Continue from the newest checkpoint in the run directory (same data order)."""
    background: bool = True
    """Write the trainer's checkpoints on a thread while training goes on (the state is
    copied to CPU memory first; one process only: several ranks write in the step).
    False: the step waits for its checkpoint."""


class WeightsConfig(Section):
    """How each new policy reaches the workers (DESIGN.md section 2, step 8)."""

    transport: Literal["filesystem", "swarm"] = "filesystem"
    """'filesystem': a shared folder with a stable marker per step (single machine or a
    shared filesystem). 'swarm': the trainer cuts each step into pieces under a signed
    manifest and seeds it over libp2p; workers fetch pieces from each other."""
    keep_last: int = Field(3, ge=1)
    """Weight versions kept on disk beyond what async_level still needs."""
    background: bool = True
    """Publish each version (write, hash, delta-code, seed) on a background thread while
    the next step trains (`trainer.publisher`); the trainer waits only to copy the weights
    off the device and, when publishing is slower than training, for the version before.
    False: the trainer publishes each version itself before its next step (the way to
    measure what the background saves)."""
    swarm: SwarmConfig = SwarmConfig(relay_service=True, use_relay=False)
    """The trainer's swarm peer (swarm transport): listen address, upload cap, piece size.
    It is also the pool's relay: workers behind NAT reserve a slot on it."""
    trainer_key: Path = Path("keys/trainer.key")
    """Key that signs swarm manifests: the pool's trainer key (swarm transport; in an `rl`
    run `orchestrator.trainer_key`, and no other value is accepted)."""
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


class RunShape(RunSettings):
    """What a trainer and its orchestrator must agree on: each is declared here once, and an
    `rl` run sets it once, at the top level, for both."""

    max_steps: int = Field(20, ge=1)
    """Training steps: the trainer's optimizer steps, the orchestrator's batches."""
    async_level: int = Field(2, ge=0)
    """Policy updates allowed between generating a sample and training on it (step n
    trains policy n - 1 into n; a sample of policy v is used only if n - 1 - v <=
    async_level; batch n is generated by policy >= n - 1 - async_level). 0: synchronous
    on-policy RL. It must equal the signed pool's `async_level`: the orchestrator (and
    `rl`) refuse a pool signed with another."""
    ckpt: CheckpointConfig = CheckpointConfig()
    """Checkpoints (trainer state; orchestrator step, buffer and results cursor)."""
    weights: WeightsConfig = WeightsConfig()
    """Weight transport to the workers (the trainer writes versions, the orchestrator
    announces them)."""


class PolicySettings(Section):
    """The policy a run trains (a trainer's and an `rl` run's)."""

    model: ModelConfig = ModelConfig()
    """The policy being trained (in an `rl` run also what the pool's workers serve at
    version 0)."""


class BatchShape(Section):
    """The shape of a training step's batch (an orchestrator's and an `rl` run's)."""

    batch_size: int = Field(32, ge=1)
    """Rollouts (episodes) per training step."""
    group_size: int = Field(8, ge=2)
    """Rollouts per prompt; the advantage is reward minus the group's mean reward."""

    @model_validator(mode="after")
    def check_batch_divisible_by_group(self) -> Self:
        if self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of group_size "
                f"({self.group_size}): each prompt contributes one whole group"
            )
        return self


class TrainerConfig(PolicySettings, RunShape):
    """`prime-trainer train`: learns from the orchestrator's batches, writes weights."""

    optim: OptimConfig = OptimConfig()
    """Optimizer and schedule."""
    loss: LossConfig = LossConfig()
    """RL objective."""
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
    def check_warmup_fits_run(self) -> Self:
        if self.optim.warmup_steps > self.max_steps:
            raise ValueError(
                f"optim.warmup_steps ({self.optim.warmup_steps}) exceeds max_steps ({self.max_steps})"
            )
        return self


class EnvConfig(Section):
    """A verifiers environment (classic in-process API, verifiers 0.3.x)."""

    id: str = "reverse-text"
    """A bundled environment ('reverse-text', 'reverse-text-chain', 'tool-arithmetic') or
    'module:function' returning a verifiers Environment."""
    args: dict[str, Any] = {}
    """Keyword arguments for the environment's loader (e.g. {num_examples = 500})."""
    max_turns: int | None = Field(None, ge=1)
    """Cap on the assistant turns of an episode (None: the environment's own; a lower
    environment value stands)."""
    max_context_tokens: int | None = Field(None, ge=16)
    """Cap on a turn's prompt in tokens: an episode whose next prompt would be longer ends
    there (verifiers' `max_seq_len`; None: no cap beyond the pool's model length)."""


class SamplingConfig(Section):
    """Sampling parameters of every rollout request."""

    temperature: float = Field(1.0, gt=0)
    """Softmax temperature (RL needs exploration: keep it near 1). In an `rl` run it is the
    trainer's loss temperature too (`trainer.loss.temperature` follows it)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    max_tokens: int = Field(64, ge=1)
    """Completion length cap per turn."""


class OnlineEvalConfig(Section):
    """Evaluation while an RL run trains (`[orchestrator.eval]`, as prime-rl's): every
    `interval` versions the orchestrator scores the newest policy on fixed prompts of
    each environment, through the same signed, verified path as training, at a lower
    priority at the scheduler, so it takes only capacity training leaves idle. Scores go
    to `<run_dir>/logs/eval_metrics.jsonl` (per version), the live view and curves.png."""

    envs: list[EnvConfig] = []
    """Environments evaluated, each scored on its own; empty: no online evaluation."""
    interval: int = Field(10, ge=1)
    """Evaluate versions 0, interval, 2 x interval, ... (the newest one the pool holds
    when a step starts; a version the run skipped past is not evaluated)."""
    num_examples: int = Field(32, ge=1)
    """Prompts per environment: the first of its eval split (its training set when it has
    none), the same ones at every evaluation."""
    rollouts_per_example: int = Field(1, ge=1)
    """Samples per prompt."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling of evaluation requests (independent of training's)."""
    pass_threshold: float = 1.0
    """An evaluated episode passes at this reward or above (`pass_rate` beside the mean)."""
    priority: int = Field(1, ge=1, le=100)
    """Queue priority at the scheduler (lower first; training's is 0)."""
    final: bool = True
    """Also evaluate the run's last version once the trainer has published it (the run
    ends when that evaluation is written)."""
    max_concurrent: int = Field(32, ge=1)
    """Evaluation episodes in flight at once."""
    timeout_s: float = Field(600.0, gt=0)
    """An evaluation ends this long after it started; episodes still unverified are
    reported as missing, never scored."""


class BufferConfig(Section):
    """Online difficulty filtering (`[orchestrator.buffer]`, as prime-rl's buffer): each
    prompt's recent pass rate is tracked from its verified rollouts; a prompt the policy
    (almost) always solves or never solves, or (`flat`) answers with the same reward
    every time, is set aside, since its group would most likely come back all-equal and
    be dropped after the pool paid for it, and revisited at `revisit`. The state is part
    of the orchestrator's checkpoint."""

    enabled: bool = False
    """Sample prompts by difficulty (off: uniformly, as before; pass rates are tracked
    and reported either way)."""
    pass_threshold: float = 1.0
    """A verified rollout passes at this reward or above."""
    window: int = Field(16, ge=1)
    """A prompt's pass rate is over its last this many verified rollouts."""
    min_seen: int = Field(8, ge=1)
    """Verified rollouts of a prompt before it may be set aside."""
    easy_threshold: float = Field(1.0, gt=0, le=1)
    """A pass rate at or above this sets the prompt aside as easy."""
    hard_threshold: float | None = Field(None, ge=0, lt=1)
    """A pass rate at or below this sets the prompt aside as hard (None: never, since a
    graded reward can carry signal while failing every time; with a 0/1 reward a prompt
    never solved is flat anyway)."""
    flat: float | None = Field(None, gt=0, le=1)
    """Also set aside a prompt whose next group comes back all-equal with at least this
    chance, estimated from its recent rewards (q ** group_size, q the share of the most
    common one): with a graded reward, the policy (almost) always giving one answer
    (None: never; 1.0: only a prompt whose recent rewards are all equal). Off by default:
    on the tiny reverse-text run, where all-equal groups come from prompts whose last
    group varied, it raised the trained share by nothing measurable."""
    revisit: float = Field(0.1, ge=0, le=1)
    """Chance that a round's prompt is drawn from the set-aside ones (their pass rate is
    measured again: a prompt the policy forgot, or now learns, comes back)."""

    @model_validator(mode="after")
    def check_thresholds(self) -> Self:
        if self.hard_threshold is not None and self.hard_threshold >= self.easy_threshold:
            raise ValueError(
                f"buffer.hard_threshold ({self.hard_threshold}) must be below "
                f"buffer.easy_threshold ({self.easy_threshold})"
            )
        return self


class GroupsConfig(Section):
    """Groups that survive lost rollouts (`[orchestrator.groups]`): a rollout rejected,
    failed, lost to a ban or cut off at the deadline is generated again for the same
    prompt, up to `max_reschedules` per group; a group still short is trained at its
    smaller size if its advantages carry signal. Nothing unverified is ever trained."""

    max_reschedules: int = Field(3, ge=0)
    """Rollouts generated again per group, within the round's deadline."""
    min_size: int = Field(2, ge=2)
    """Fewest verified episodes a group is trained with (advantages are over those)."""
    deadline_s: float = Field(300.0, gt=0)
    """A round ends this long after it started: stragglers are cut off (counted as
    `dropped_straggler`) and no step waits on one longer."""


class OrchestratorConfig(BatchShape, RunShape):
    """`prime-trainer orchestrate`: environment -> rollout requests -> verified, scored batches."""

    env: EnvConfig = EnvConfig()
    """Where prompts and rewards come from."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters."""
    pool: Path = Path("configs/pools/local.pool")
    """The signed pool file (gives pool id, model, async_level and the scheduler's trust
    anchors)."""
    scheduler: str = "http://127.0.0.1:7700"
    """Scheduler URL (comma-separated for replicas)."""
    trainer_key: Path = Path("keys/trainer.key")
    """The pool's trainer key: signs weight updates and rollout submissions."""
    model_name: str = ""
    """Model name sent in OpenAI requests ('' : the pool's model)."""
    api_key_file: Path | None = None
    """File holding the key to the scheduler's OpenAI endpoint (`prime-scheduler pool
    api-key`; a local swarm writes its own); None: no key (a pool's endpoint then
    answers 401)."""
    tokenizer: Path | None = None
    """Model folder whose tokenizer decodes the verified ids the rubric's text is checked
    against; None: the pool's model."""
    max_concurrent: int = Field(64, ge=1)
    """Episodes in flight at once."""
    max_rounds: int = Field(8, ge=1)
    """Generation rounds per step before a step goes ahead with fewer groups than asked
    (all-equal groups are dropped; a step must not spin forever on an easy dataset)."""
    buffer: BufferConfig = BufferConfig()
    """Which prompts a round samples (online difficulty filtering)."""
    groups: GroupsConfig = GroupsConfig()
    """Rescheduling, partial groups and the stragglers' deadline."""
    eval: OnlineEvalConfig = OnlineEvalConfig()
    """Online evaluation through the pool."""

    _check_api_key_file = field_validator("api_key_file")(check_api_key_file_exists)

    @model_validator(mode="after")
    def check_group_minimum(self) -> Self:
        if self.groups.min_size > self.group_size:
            raise ValueError(
                f"groups.min_size ({self.groups.min_size}) exceeds group_size ({self.group_size})"
            )
        return self


class RLTrainerConfig(TrainerConfig):
    """The trainer of an `rl` run: a `TrainerConfig`, and how many processes run it."""

    nproc: int = Field(1, ge=1)
    """Trainer processes (torchrun --nproc-per-node) sharing the model with FSDP2."""


class LocalSwarmConfig(Section):
    """The whole network on this machine (`prime-trainer rl --local-swarm.enabled true`): a
    scheduler (SQLite in the run directory), `workers` worker nodes and the trainer, each
    its own process on loopback; the launcher fills in the orchestrator's pool, scheduler,
    trainer key and API key file itself, and signs the pool with the run's async_level."""

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
    scheduler_port: int = Field(0, ge=0, le=65535)
    """Port of the local pool's scheduler on 127.0.0.1 (0: a free one). A fixed port lets
    nodes started apart from the run join the local pool (`prime-node join --pool
    <pool_id> --scheduler http://127.0.0.1:<port>`), e.g. a dishonest one in a bench."""
    heartbeat_interval_s: float = Field(2.0, gt=0)
    """Worker heartbeat period (a killed worker is declared dead after 15 of them)."""
    worker_upload_rate: int = Field(0, ge=0)
    """Upload cap of every worker's weight-swarm peer in bytes/s (0: none), to watch the
    swarm share the trainer's load on one machine."""
    pool_args: list[str] = []
    """Extra flags for `prime-scheduler pool create` (e.g. `--verification.audit-rate 1`);
    not `--async-level`: the pool is signed with the run's."""
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

    @field_validator("pool_args")
    @classmethod
    def check_pool_args_keep_async_level(cls, v: list[str]) -> list[str]:
        if "async_level" in parse_args(v):
            raise ValueError(
                "pool_args must not set --async-level: the local pool is signed with the "
                "run's async_level (set --async-level instead)"
            )
        return v


def read_pool(path: Path) -> PoolConfig:
    """The owner-signed pool config in `path` (signature checked, expiry not: a pool file
    is long-lived); ValueError naming the file if it cannot be read."""
    from protocol.envelope import open_envelope

    try:
        return open_envelope(Path(path).read_bytes(), PoolConfig, check_expiry=False).message
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the pool file {path}: {exc}") from exc


def check_pool_async_level(async_level: int, pool: PoolConfig, path: Path) -> None:
    """A run's async_level must be the one its pool was signed with: the scheduler and the
    workers keep weight versions for the pool's value, and the trainer drops samples by
    the run's. Raises ValueError naming both values."""
    if async_level != pool.async_level:
        raise ValueError(
            f"async_level {async_level} differs from the async_level {pool.async_level} "
            f"that pool {pool.pool_id!r} is signed with ({path}): set --async-level "
            f"{pool.async_level}, or use a pool signed with {async_level}"
        )


PARTS = ("trainer", "orchestrator")
"""The process configs an `rl` run contains (`RLConfig` fields)."""


def _given(value: object) -> dict[str, Any] | None:
    """The keys given for a section: a dict's, or a model's explicitly set fields ({} for
    None; None for anything else, which validation then reports)."""
    if value is None:
        return {}
    if isinstance(value, BaseModel):
        return {k: getattr(value, k) for k in value.model_fields_set}
    return dict(value) if isinstance(value, dict) else None


def _differences(run: object, part: object, key: str) -> list[tuple[str, object, object]]:
    """(dotted key, run's value, part's value) of every leaf where two values differ."""
    if isinstance(run, BaseModel) and type(run) is type(part):
        return [
            d
            for f in type(run).model_fields
            for d in _differences(getattr(run, f), getattr(part, f), f"{key}.{f}")
        ]
    return [] if run == part else [(key, run, part)]


class RLConfig(PolicySettings, BatchShape, RunShape):
    """`prime-trainer rl`: one run; contains the trainer's config and the orchestrator's.

    Every field they share with the run (those of `RunShape`, and `model` for the
    trainer, `batch_size`/`group_size` for the orchestrator) is set once, at the top level,
    and handed to them; the same key under `trainer.`/`orchestrator.` is accepted only
    with the run's value (a resolved `rl.toml` reads back). Also one value each for: the
    loss and sampling temperature (`orchestrator.sampling.temperature`;
    `trainer.loss.temperature` follows it), the key that signs manifests and submissions
    (`orchestrator.trainer_key`; `weights.trainer_key` follows it), and async_level, which
    must be the signed pool's."""

    trainer: RLTrainerConfig = Field(default_factory=lambda: RLTrainerConfig.model_validate({}))
    """The trainer: every `prime-trainer train` setting (`--trainer.optim.lr`,
    `--trainer.batch-timeout-s`, ...) and `nproc`; the shared ones come from the top level."""
    orchestrator: OrchestratorConfig = Field(
        default_factory=lambda: OrchestratorConfig.model_validate({})
    )
    """The orchestrator: every `prime-trainer orchestrate` setting (`--orchestrator.env.id`,
    `--orchestrator.model-name`, ...); the shared ones come from the top level."""
    local_swarm: LocalSwarmConfig = LocalSwarmConfig()
    """Run the scheduler and the workers too, on this machine (the main demo)."""

    @classmethod
    def shared_fields(cls, part: str) -> list[str]:
        """The fields `part` ('trainer' or 'orchestrator') shares with the run: set once,
        at the top level."""
        declared = cls.model_fields[part].annotation.model_fields
        return [f for f in cls.model_fields if f in declared]

    @model_validator(mode="before")
    @classmethod
    def hand_shared_settings_down(cls, data: Any) -> Any:
        """Give each part the run's value of every shared field it does not name itself
        (`check_one_value_per_setting` compares those it names), the trainer the sampling
        temperature and the weights the orchestrator's trainer key."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        trainer, orch = _given(data.get("trainer")), _given(data.get("orchestrator"))
        weights = _given(data.get("weights"))
        if trainer is None or orch is None or weights is None:
            return data  # not sections: validation names the key
        sampling, loss = _given(orch.get("sampling")), _given(trainer.get("loss"))
        if sampling is not None and loss is not None:
            default = SamplingConfig.model_fields["temperature"].default
            trainer["loss"] = {"temperature": sampling.get("temperature", default), **loss}
        key = orch.get("trainer_key", OrchestratorConfig.model_fields["trainer_key"].default)
        data["weights"] = {"trainer_key": key, **weights}
        for name, part in (("trainer", trainer), ("orchestrator", orch)):
            data[name] = {f: data[f] for f in cls.shared_fields(name) if f in data} | part
        return data

    @model_validator(mode="after")
    def check_one_value_per_setting(self) -> Self:
        twice = [
            f"{name}.{key} is {theirs!r} but the run's {key} is {run!r} "
            f"(set --{key.replace('_', '-')}, or `{field}` outside [{name}])"
            for name in PARTS
            for field in self.shared_fields(name)
            for key, run, theirs in _differences(
                getattr(self, field), getattr(getattr(self, name), field), field
            )
        ]
        if twice:
            raise ValueError(
                "; ".join(twice) + ": an rl run sets what its trainer and orchestrator "
                "share once, at the top level"
            )
        loss, sampling = self.trainer.loss.temperature, self.orchestrator.sampling.temperature
        if loss != sampling:
            raise ValueError(
                f"trainer.loss.temperature ({loss}) differs from "
                f"orchestrator.sampling.temperature ({sampling}): the trainer's logprobs must "
                "be those of the distribution the workers sampled from (their logprobs mu); "
                "set --orchestrator.sampling.temperature only, the loss follows it"
            )
        if (key := self.weights.trainer_key) != (signer := self.orchestrator.trainer_key):
            raise ValueError(
                f"weights.trainer_key ({key}) differs from orchestrator.trainer_key "
                f"({signer}): a run has one trainer key, the pool's; set "
                "--orchestrator.trainer-key only, the weights follow it"
            )
        if (pool := self.pool_file()) is not None:
            check_pool_async_level(self.async_level, read_pool(pool), pool)
        return self

    @property
    def local_pool_file(self) -> Path:
        """Where the local swarm writes its signed pool file."""
        return Path(self.run_dir) / "swarm" / f"{self.local_swarm.pool_id}.pool"

    def pool_file(self) -> Path | None:
        """The signed pool file the orchestrator will use, if it exists now (with a local
        swarm: only once the launcher has signed it and pointed the run at it)."""
        pool = Path(self.orchestrator.pool)
        if self.local_swarm.enabled and pool != self.local_pool_file:
            return None
        return pool if pool.is_file() else None

    def publish_dtype(self) -> str:
        """The weights' publishing dtype, 'auto' resolved from the pool's engine mixes."""
        if self.weights.dtype != "auto":
            return self.weights.dtype
        if (pool := self.pool_file()) is None:
            return "float32"  # the orchestrator reports a missing pool file itself
        dtypes = {m.dtype for m in read_pool(pool).verification.engine_mixes}
        return dtypes.pop() if len(dtypes) == 1 else "float32"

    def with_changes(self, changes: dict[str, Any]) -> RLConfig:
        """This run with `changes` (nested like TOML tables) laid over what was set, and
        validated again: what follows another setting (the shared fields of the parts,
        the loss temperature, the weights' trainer key) follows its new value."""
        follows: dict[str, Any] = {"weights": {"trainer_key": True}}
        for name in PARTS:
            follows[name] = dict.fromkeys(self.shared_fields(name), True)
        follows["trainer"]["loss"] = {"temperature": True}
        given = self.model_dump(exclude_unset=True, exclude=follows)
        return type(self).model_validate(deep_merge(given, changes))

    def _child_monitor(self) -> MonitorConfig:
        # The `rl` parent draws one progress display and the plot; children only log.
        return self.monitor.model_copy(update={"progress": False, "plot": False})

    def trainer_config(self) -> TrainerConfig:
        """The trainer child's config: the contained one, publishing in the pool's dtype."""
        values = self.trainer.model_dump(exclude={"nproc"})
        values["monitor"] = self._child_monitor().model_dump()
        values["weights"]["dtype"] = self.publish_dtype()
        return TrainerConfig.model_validate(values)

    def orchestrator_config(self) -> OrchestratorConfig:
        """The orchestrator child's config: the contained one."""
        return self.orchestrator.model_copy(update={"monitor": self._child_monitor()})


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
