"""Configuration of the scheduler daemon (`prime-scheduler serve @ configs/pools/<pool>.toml`).

Invariants: every field is documented where it is declared; validators fail fast with a
message an operator can act on; the resolved config is written into `log_dir` at start.
The pool itself (model, trainer key, admission, verification, reputation, async_level)
is not configured here: it is the owner-signed file `pool_file`, so nobody can change
it without the owner key.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from protocol.config import HttpServerConfig, PrimeSettings, Section
from protocol.identity import Identity, IdentityError, public_key_from_node_id
from protocol.messages import (
    AdmissionPolicy,
    CheckerPolicy,
    ReputationPolicy,
    VerificationPolicy,
    check_founding_set,
)


class DatabaseConfig(Section):
    """Where the pool's state lives."""

    url: str = "sqlite+aiosqlite:///runs/scheduler/scheduler.db"
    """SQLAlchemy async URL: `sqlite+aiosqlite:///path.db` (default) or
    `postgresql+asyncpg://user@host:5432/db` (production, several replicas)."""
    flush_interval_ms: float = Field(20.0, ge=0, le=1000)
    """Group commit: at most one transaction per this interval (an idle scheduler writes at
    once). A result is released to the orchestrator only after its write committed."""

    @field_validator("url")
    @classmethod
    def check_async_driver(cls, v: str) -> str:
        if not v.startswith(("sqlite+aiosqlite://", "postgresql+asyncpg://")):
            raise ValueError(
                "database.url must use an async driver: 'sqlite+aiosqlite:///file.db' or "
                "'postgresql+asyncpg://user@host:5432/db'"
            )
        return v


class ServerConfig(HttpServerConfig):
    """The scheduler's HTTP API (host and body read timeout as every server's)."""

    port: int = Field(7000, ge=0, le=65535)
    """Port to listen on."""
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    """Largest request body accepted; larger ones get 413."""


class LifecycleConfig(Section):
    """Heartbeats and the node lifecycle (registered -> healthy -> unhealthy -> dead)."""

    heartbeat_interval_s: float = Field(10.0, gt=0, le=3600)
    """How often nodes are told to heartbeat."""
    swarm_announce_interval_s: float = Field(15.0, gt=0, le=3600)
    """How often swarm peers re-announce to the tracker (it forgets them after 4 intervals)."""
    unhealthy_after_s: float = Field(25.0, gt=0)
    """A node silent this long gets no new work (unhealthy)."""
    dead_after_s: float = Field(45.0, gt=0)
    """A node silent this long is dead: its in-flight work is re-dispatched."""
    check_interval_s: float = Field(1.0, gt=0)
    """How often the scheduler looks for silent nodes."""

    @model_validator(mode="after")
    def check_timeouts_ordered(self) -> LifecycleConfig:
        if not self.heartbeat_interval_s < self.unhealthy_after_s < self.dead_after_s:
            raise ValueError(
                "need heartbeat_interval_s < unhealthy_after_s < dead_after_s "
                f"(got {self.heartbeat_interval_s}, {self.unhealthy_after_s}, {self.dead_after_s})"
            )
        return self


class ChannelConfig(Section):
    """Node channels: the WebSocket each node opens to the scheduler, which carries every
    call the scheduler makes to it (generation, verification, judges, weights pushes)."""

    ping_interval_s: float = Field(5.0, gt=0, le=300)
    """The scheduler pings every channel this often; one whose pong is missing half an
    interval later is closed, its calls fail over to other nodes (a dead link is known
    within 1.5 intervals, however quiet the node is)."""
    hello_timeout_s: float = Field(10.0, gt=0, le=300)
    """A connection that has not sent its signed hello by then is closed: a deadline from
    the upgrade, which no ping, pong or other frame extends."""
    max_unauthenticated: int = Field(256, ge=1, le=100_000)
    """Connections still in their hello (not yet proven to be a registered node), from all
    addresses together; one more is answered 503 with Retry-After, before any upgrade."""
    max_unauthenticated_per_address: int = Field(16, ge=1, le=100_000)
    """The same, from one client address."""
    max_frame_bytes: int = Field(64 * 1024 * 1024, ge=64 * 1024)
    """Largest frame taken from a node (an answer); larger ones close its channel."""
    max_in_flight: int = Field(1024, ge=1, le=65536)
    """Calls outstanding on one channel at once; more wait for a free slot (flow control:
    one node cannot be handed more than this, whatever its advertised capacity)."""


class DispatchConfig(Section):
    """How rollout requests are sent to generators and verifiers."""

    generate_timeout_s: float = Field(300.0, gt=0)
    """A generator that has not answered within this is given up on; the request goes elsewhere."""
    verify_timeout_s: float = Field(300.0, gt=0)
    """Same for a verifier."""
    max_attempts: int = Field(5, ge=1)
    """Generation attempts (on different nodes) before a request is reported failed."""
    max_queued: int = Field(100_000, ge=1)
    """Requests waiting for a node before submissions get 503 (backpressure)."""
    verifier_wait_s: float = Field(120.0, gt=0)
    """How long a rollout waits for an eligible verifier (or judge) before it is given up on."""
    openai_timeout_s: float = Field(900.0, gt=0)
    """How long a call through the OpenAI-compatible endpoint waits for its verified
    rollouts (generation, verification and any regeneration) before it gets 503."""
    probation: int = Field(4, ge=0)
    """A node may have this many generations in flight, plus one per accepted rollout of
    its, up to its capacity (0: no probation). Bounds what a new cheater can get through
    the door before its first disputes ban it."""

    @model_validator(mode="after")
    def check_openai_timeout_outlasts_a_generation(self) -> DispatchConfig:
        if self.openai_timeout_s <= self.generate_timeout_s:
            raise ValueError(
                f"dispatch.openai_timeout_s ({self.openai_timeout_s:g}) must exceed "
                f"dispatch.generate_timeout_s ({self.generate_timeout_s:g}): a call that "
                "meets a silent generator must still be served by another"
            )
        return self


class OpenAIConfig(Section):
    """The pool's OpenAI-compatible endpoint: a front of the signed dispatch path."""

    tokenizer: Path | None = None
    """Hugging Face model folder whose tokenizer (tokenizer.json + chat template) turns
    clients' prompts into token ids on this trusted side; None = the pool's model, when
    that names a folder. Without one, only prompts given as token ids are served."""
    revoked_keys: list[str] = []
    """Key ids (`ApiKey.key_id`, printed by `prime-scheduler pool api-key`) refused even
    though their signature and expiry are good."""
    default_max_tokens: int = Field(256, ge=1, le=65536)
    """max_tokens of a call that names none."""

    @field_validator("tokenizer")
    @classmethod
    def check_tokenizer_folder(cls, v: Path | None) -> Path | None:
        if v is not None and not (v.expanduser() / "tokenizer.json").is_file():
            raise ValueError(f"{v} holds no tokenizer.json: give a Hugging Face model folder")
        return v


class RateLimitConfig(Section):
    """Token buckets against flooding; 429 with a clear message when exceeded."""

    per_identity_per_s: float = Field(20.0, gt=0)
    """Sustained signed messages per second from one node key (registration, heartbeats, ...)."""
    per_identity_burst: int = Field(40, ge=1)
    """Burst allowance per node key."""
    per_address_per_s: float = Field(500.0, gt=0)
    """Sustained requests per second from one client address (all routes)."""
    per_address_burst: int = Field(1000, ge=1)
    """Burst allowance per address."""
    new_nodes_per_address_per_min: float = Field(30.0, gt=0)
    """Registrations of node keys this scheduler does not know, per client address and
    minute (a burst of as many is allowed); more get 429. A known key registering again (a
    restarted node) is not counted. Identities are free: this caps how fast one address
    mints them."""
    exempt_addresses: list[str] = []
    """Addresses never rate limited per address (a load balancer, a benchmark driver)."""


class ReplicaConfig(Section):
    """Several scheduler processes on one PostgreSQL database: one active, the others on
    standby. They must share `key_file` (nodes accept work signed by that key) and the pool
    file; nodes and orchestrators list all of them (`--scheduler URL1,URL2`)."""

    lease_s: float = Field(10.0, gt=0.5, le=600)
    """The active replica renews its lease this often x3; a standby takes over once the
    lease has not been renewed for this long. An active replica that cannot renew stops."""
    replica_id: str = Field("", max_length=200)
    """This replica's name in the lease ('' = host:port of this process); a restarted
    process with the same name takes its lease back at once."""


class SchedulerConfig(PrimeSettings):
    """The scheduler daemon of one pool."""

    pool_file: Path
    """The owner-signed pool config written by `prime-scheduler pool create`."""
    key_file: Path = Path("~/.prime-swarm/scheduler.key")
    """The scheduler's Ed25519 key (nodes accept work signed by it); created on first start."""
    database: DatabaseConfig = DatabaseConfig()
    """State storage."""
    server: ServerConfig = ServerConfig()
    """HTTP server."""
    lifecycle: LifecycleConfig = LifecycleConfig()
    """Heartbeats and node states."""
    channel: ChannelConfig = ChannelConfig()
    """The node channels (node-initiated WebSockets)."""
    dispatch: DispatchConfig = DispatchConfig()
    """Dispatch, retries, timeouts, backpressure."""
    rate_limits: RateLimitConfig = RateLimitConfig()
    """Flood protection."""
    openai: OpenAIConfig = OpenAIConfig()
    """The OpenAI-compatible endpoint (API keys, tokenizer)."""
    replica: ReplicaConfig = ReplicaConfig()
    """Active/standby replicas on one database."""
    log_dir: Path = Path("runs/scheduler/logs")
    """Where the resolved config and logs go."""

    @field_validator("pool_file")
    @classmethod
    def check_pool_file_exists(cls, v: Path) -> Path:
        v = v.expanduser()
        if not v.is_file():
            raise ValueError(
                f"pool file {v} not found: create one with `prime-scheduler pool create`"
            )
        return v


class PoolCreateConfig(PrimeSettings):
    """`prime-scheduler pool create`: write a pool config signed by the owner key."""

    pool_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """Pool id (letters, digits, '.', '_', '-')."""
    model: str = "tiny"
    """Model the pool trains: a bundled name ('tiny', 'smollm2') or a model folder."""
    trainer: str
    """The trainer's node id (`prime-node keygen --key-file trainer.key` prints it), or the
    path of the trainer's key file."""
    owner_key: Path = Path("~/.prime-swarm/owner.key")
    """The pool owner's key file (created if missing): it signs the pool and its invites."""
    admission: AdmissionPolicy = AdmissionPolicy()
    """Who may join: mode 'open', 'allowlist' (with allowlist = [node ids]) or 'invite'."""
    verification: VerificationPolicy = VerificationPolicy()
    """Spot-check rate and thresholds; use the calibrated tables in configs/verification/."""
    reputation: ReputationPolicy = ReputationPolicy()
    """Reputation changes and the ban threshold."""
    checkers: CheckerPolicy = CheckerPolicy()
    """Who may verify, judge and audit: for a pool open to anyone, earn_after = N accepted
    rollouts and founders = [the owner's own node ids]."""
    async_level: int = Field(2, ge=0, le=64)
    """Largest allowed age (in steps) of a rollout's policy at training time."""
    out: Path | None = None
    """Where to write the signed pool file (default configs/pools/<pool_id>.pool); a
    scheduler config next to it (<pool_id>.toml) is written too if missing."""
    port: int = Field(7000, ge=1, le=65535)
    """Port written into the generated scheduler config."""

    @field_validator("trainer")
    @classmethod
    def check_trainer_is_node_id_or_key(cls, v: str) -> str:
        if Path(v).expanduser().is_file():
            return v
        try:
            public_key_from_node_id(v)
        except IdentityError as exc:
            raise ValueError(f"trainer must be a node id or a key file path: {exc}") from exc
        return v

    @model_validator(mode="after")
    def check_rights_have_a_founding_set(self) -> PoolCreateConfig:
        check_founding_set(self.admission, self.checkers)
        return self

    @field_validator("verification")
    @classmethod
    def check_thresholds_state_their_engine_mix(cls, v: VerificationPolicy) -> VerificationPolicy:
        if not v.engine_mixes:
            raise ValueError(
                "the verification thresholds state no engine mix they were calibrated for: "
                "give a calibrated table (@ configs/verification/<model>-<engine>-<device>-"
                "<dtype>.toml, or one written by `prime-node calibrate`), or list the mixes "
                "with --verification.engine-mixes"
            )
        return v

    @model_validator(mode="after")
    def check_allowlist_matches_mode(self) -> PoolCreateConfig:
        if self.admission.mode == "allowlist" and not self.admission.allowlist:
            raise ValueError("admission.mode = 'allowlist' needs admission.allowlist = [node ids]")
        for node_id in self.admission.allowlist:
            try:
                public_key_from_node_id(node_id)
            except IdentityError as exc:
                raise ValueError(f"admission.allowlist: {exc}") from exc
        return self

    def trainer_public_key(self) -> bytes:
        p = Path(self.trainer).expanduser()
        if p.is_file():
            return Identity.load_or_create(p).public_key
        return public_key_from_node_id(self.trainer)
