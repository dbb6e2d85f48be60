"""Pydantic models of every message in DESIGN.md sections 2 and 4.

Each model is a wire message: it is encoded by `protocol.codec` and, between processes,
signed inside a `protocol.envelope`. Invariants:
- Models are strict about shapes and ranges (a malformed message fails validation with a
  message that names the field), and frozen so a verified message cannot change later.
- Token ids, logprobs and proof chunks of a `Rollout` line up: one logprob per completion
  token, one proof chunk per `proof_chunk_tokens` completion tokens (rounded up).
"""

from __future__ import annotations

import hashlib
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protocol.codec import encode

MAX_SEED = 2**63 - 1


def check_token_ids_non_negative(cls, v: list[int]) -> list[int]:
    """Validator shared by every message carrying token ids."""
    if any(t < 0 for t in v):
        raise ValueError("token ids must be non-negative")
    return v


class Message(BaseModel):
    """Base of all wire messages: frozen, no unknown fields, field docstrings as docs."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    def digest(self) -> str:
        """Hex SHA-256 of the canonical encoding: the message's identity."""
        return hashlib.sha256(encode(self)).hexdigest()


# Smallest non-zero temperature. Every check compares scaled logits (logits / T) in absolute
# units, so an honest engine's numerical error grows as 1/T: at T = 0.01 an fp32 logit error
# (~1e-6) is still 10x under the tightest calibrated tolerance (tiny fp32: 1e-3), while a
# bf16 one (~1e-2) already reaches 1 nat of logprob on a near-tie; smaller T would get honest
# nodes rejected for the request's choice. Nothing is lost by refusing: below 0.01 a logit
# gap of 0.1 is odds of e**10, practically greedy, and temperature 0 says so exactly. (vLLM
# silently turns T < 1e-5 into greedy; we refuse, so a rollout's declared parameters are
# the ones it was sampled with.)
MIN_TEMPERATURE = 0.01
# Largest top_k: any top_k at or above the vocabulary size keeps every token (the sampler and
# the checks clamp it the same way); the bound keeps it an int32 and msgpack-encodable.
MAX_TOP_K = 2**31 - 1
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 64


class SamplingParams(Message):
    """How tokens are chosen. The same parameters are replayed by the verifier.

    Only values every engine and every verifier treat identically are accepted: a value
    that would make an honest rollout fail verification (or fail to be signed) is refused
    here, with a message naming it."""

    temperature: float = Field(1.0, ge=0.0, le=10.0, allow_inf_nan=False)
    """Softmax temperature; 0 means greedy (argmax), otherwise at least `MIN_TEMPERATURE`."""
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p
    (never empty: the most likely token is always kept, however small top_p is)."""
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)
    """Keep only the k most likely tokens; 0 (or k >= vocabulary size) disables the filter."""
    max_tokens: int = Field(64, ge=1, le=65536)
    """Maximum number of completion tokens; reaching it ends with finish_reason 'length'."""
    stop: tuple[str, ...] = ()
    """Strings that end the completion when they appear in its text (at most 8, each 1 to
    64 characters of valid Unicode)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks)."""

    @field_validator("temperature")
    @classmethod
    def check_temperature_greedy_or_at_least_min(cls, v: float) -> float:
        if 0.0 < v < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {v!r}: "
                "smaller temperatures cannot be verified reliably; use 0 for greedy decoding"
            )
        return v

    @field_validator("stop")
    @classmethod
    def check_stop_strings_at_most_max(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(v)}")
        return v

    @field_validator("stop")
    @classmethod
    def check_stop_strings_non_empty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("stop")
    @classmethod
    def check_stop_strings_short(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        long = [s for s in v if len(s) > MAX_STOP_CHARS]
        if long:
            raise ValueError(
                f"stop strings must be at most {MAX_STOP_CHARS} characters, "
                f"got one of {len(long[0])}: {long[0][:16]!r}..."
            )
        return v

    @field_validator("stop")
    @classmethod
    def check_stop_strings_valid_unicode(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        # A lone surrogate (e.g. from a JSON "\ud800" escape) has no UTF-8 encoding: the
        # rollout could not be signed.
        for s in v:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(
                    f"stop string {s!r} is not valid Unicode (lone surrogate); "
                    "it cannot be encoded as UTF-8"
                ) from None
        return v


class ProofParams(Message):
    """TOPLOC proof layout."""

    chunk_tokens: int = Field(32, ge=1, le=4096)
    """Completion tokens covered by one proof chunk (TOPLOC decode batching size)."""
    topk: int = Field(128, ge=8, le=1024)
    """Top-k hidden-state values committed to per chunk."""


class RolloutRequest(Message):
    """Scheduler -> generator: produce one completion for these prompt tokens."""

    request_id: str = Field(min_length=1, max_length=128)
    """Unique id chosen by the scheduler."""
    pool_id: str = Field("local", min_length=1, max_length=64)
    """Pool the request belongs to."""
    prompt_ids: list[int] = Field(min_length=1, max_length=65536)
    """Prompt token ids (already chat-templated)."""
    sampling: SamplingParams = SamplingParams()
    """Sampling parameters the generator must honour."""
    seed: int = Field(ge=0, le=MAX_SEED)
    """Seed of the sampling noise, chosen by the scheduler, never by the worker."""
    min_version: int = Field(0, ge=0)
    """Lowest admissible weights version."""
    proof: ProofParams = ProofParams()
    """Proof layout the pool asks for."""

    _check_prompt_ids = field_validator("prompt_ids")(check_token_ids_non_negative)


FinishReason = Literal["stop", "length"]


class Rollout(Message):
    """Generator's answer: tokens, logprobs, proof, and the weights it used."""

    request_id: str = Field(min_length=1, max_length=128)
    """Id of the `RolloutRequest` this answers."""
    pool_id: str = Field("local", min_length=1, max_length=64)
    """Pool of the request."""
    node_id: str = Field(min_length=1, max_length=128)
    """Generator's node id; must equal the signer of the envelope."""
    prompt_ids: list[int] = Field(min_length=1)
    """Prompt token ids as generated from."""
    completion_ids: list[int] = Field(min_length=1)
    """Generated token ids, including a final end-of-sequence token when there is one."""
    logprobs: list[float]
    """Per completion token: log-probability under softmax(logits / temperature)."""
    finish_reason: FinishReason
    """'stop' (EOS or a stop string) or 'length' (max_tokens reached)."""
    sampling: SamplingParams
    """Sampling parameters used (must equal the request's)."""
    seed: int = Field(ge=0, le=MAX_SEED)
    """Seed used for the sampling noise (must equal the request's)."""
    weights_version: int = Field(ge=0)
    """Policy version (trainer step) of the weights used."""
    weights_hash: str = Field(max_length=128)
    """Manifest hash of the weights used."""
    proof_params: ProofParams = ProofParams()
    """Proof layout used."""
    proof: list[bytes]
    """TOPLOC proof: one chunk per `proof_params.chunk_tokens` completion tokens."""

    @model_validator(mode="after")
    def check_lengths_line_up(self) -> Rollout:
        n = len(self.completion_ids)
        if len(self.logprobs) != n:
            raise ValueError(f"{len(self.logprobs)} logprobs for {n} completion tokens")
        if n > self.sampling.max_tokens:
            raise ValueError(f"{n} completion tokens exceed max_tokens={self.sampling.max_tokens}")
        chunks = math.ceil(n / self.proof_params.chunk_tokens)
        if len(self.proof) != chunks:
            raise ValueError(f"{len(self.proof)} proof chunks for {n} tokens (expected {chunks})")
        if any(not math.isfinite(x) or x > 1e-6 for x in self.logprobs):
            raise ValueError("logprobs must be finite and <= 0")
        if any(t < 0 for t in self.prompt_ids + self.completion_ids):
            raise ValueError("token ids must be non-negative")
        return self


class VerifyRequest(Message):
    """Scheduler -> verifier: check someone else's rollout."""

    rollout_envelope: bytes = Field(max_length=64 * 1024 * 1024)
    """The generator's signed `Rollout` envelope, passed on untouched."""
    expected_weights_hash: str = Field("", max_length=128)
    """Weights the rollout must have been generated with ('' = the verifier's current)."""
    request: RolloutRequest | None = None
    """The request the rollout answers, so the verifier can check it was honoured."""


class CheckResult(Message):
    """Outcome of one named check inside a verdict."""

    name: str
    """Check name: proof, logprobs, sampling, support, termination, request."""
    passed: bool
    """Whether the check passed."""
    detail: str = ""
    """Human-readable reason, mostly for failures."""
    metrics: dict[str, float] = {}
    """Measured values (worst chunk mismatches, max logprob error, ...)."""


class Verdict(Message):
    """Verifier's signed judgement of one rollout."""

    request_id: str
    """Request the rollout answered."""
    rollout_digest: str
    """SHA-256 of the rollout message judged."""
    generator_id: str
    """Node id of the generator."""
    verifier_id: str
    """Node id of the verifier (the envelope signer)."""
    weights_hash: str
    """Weights the verifier used."""
    accepted: bool
    """True when every check passed."""
    checks: list[CheckResult]
    """Every check run, in order."""

    @property
    def reasons(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.checks if not c.passed]


class WeightUpdate(Message):
    """Trainer -> worker: load this weights version (signed by the pool's trainer key).

    Filesystem transport: `path` names a folder the node can read. Swarm transport:
    `manifest` is the trainer-signed `Manifest` envelope and `seeders` where to start
    fetching its pieces; the node downloads into its own folder and ignores `path`."""

    version: int = Field(ge=0)
    """Policy version (trainer step) of the weights."""
    path: str = Field("", max_length=4096)
    """Folder with the safetensors weights (filesystem transport)."""
    weights_hash: str = Field("", max_length=128)
    """Manifest hash of the weights ('' to let the node hash the files)."""
    manifest: bytes = Field(b"", max_length=64 * 1024 * 1024)
    """Trainer-signed `Manifest` envelope (swarm transport); empty for the filesystem one."""
    seeders: list[str] = Field([], max_length=64)
    """libp2p multiaddrs (ending in /p2p/<peer id>) that hold every piece (swarm transport)."""
    deltas: list[bytes] = Field([], max_length=16)
    """Trainer-signed delta manifests of the versions up to this one, oldest first, each
    against the version before it (swarm transport): a node holding one of their bases
    fetches only the deltas after it instead of the full `manifest`."""

    @model_validator(mode="after")
    def check_path_or_manifest(self) -> WeightUpdate:
        if not self.path and not self.manifest:
            raise ValueError("a weights update needs a folder path or a swarm manifest")
        return self


class WeightReload(Message):
    """Trainer -> worker: re-read the current weights from disk (signed by the trainer key)."""

    version: int = Field(ge=0)
    """Version the node is expected to hold; a node holding another refuses."""


NodeState = Literal["registered", "healthy", "unhealthy", "dead", "draining", "left", "banned"]


class Heartbeat(Message):
    """Worker -> scheduler: I am alive, with this version and load."""

    node_id: str
    """Sender's node id."""
    weights_version: int = Field(ge=0)
    """Version the engine serves."""
    weights_hash: str = Field("", max_length=128)
    """Hash of the weights the engine serves."""
    outstanding_tokens: int = Field(0, ge=0)
    """Tokens queued or in generation."""
    stats: dict[str, int] = {}
    """Counters since start (generated, verified, accepted, rejected, ...), for the dashboard."""


class HeartbeatResponse(Message):
    """Scheduler -> worker: your state, and the pool's newest weights if you lack them."""

    state: NodeState
    """The node's lifecycle state as the scheduler sees it."""
    weights_envelope: bytes = b""
    """The trainer-signed `WeightUpdate` of the pool's newest weights, when newer than the
    node's (the node checks the trainer signature itself); empty otherwise."""


class Invite(Message):
    """An invite token: signed by the pool owner, single use, with the envelope's expiry."""

    pool_id: str = Field(min_length=1, max_length=64)
    """Pool the invite admits to."""
    invite_id: str = Field(min_length=8, max_length=64)
    """Unique id; an invite is consumed by its first registration."""
    node_id: str = Field("", max_length=128)
    """Node id the invite is bound to ('' = whoever presents it first)."""


class ApiKey(Message):
    """A key to the pool's OpenAI endpoint: signed by the pool owner, expiring with its
    envelope; clients send it as `Authorization: Bearer <token>` (`scheduler.pool`)."""

    pool_id: str = Field(min_length=1, max_length=64)
    """Pool whose endpoint the key opens."""
    key_id: str = Field(min_length=8, max_length=64)
    """Unique id: what the scheduler logs, rate-limits by and can revoke."""
    name: str = Field("", max_length=128)
    """Who the key was issued to (for logs)."""
    rate_per_s: float = Field(20.0, gt=0, le=100_000)
    """Sustained calls per second allowed under this key."""
    burst: int = Field(64, ge=1, le=1_000_000)
    """Calls allowed at once above the sustained rate."""


class RegisterRequest(Message):
    """Worker -> scheduler: admit me to this pool."""

    pool_id: str = Field(min_length=1, max_length=64)
    """Pool to join."""
    operator: str = Field("", max_length=128)
    """Operator label; a verifier is never of the generator's operator."""
    p2p_addrs: list[str] = Field([], max_length=16)
    """libp2p multiaddrs of the node."""
    engine: Literal["torch", "vllm", "loadtest"] = "torch"
    """Inference engine kind ('loadtest' is the benchmark's instant fake engine)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of the node's engine."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Device kind of the node's engine."""
    decode: Literal["loop", "slots"] | None = None
    """The torch engine's decode (None: another engine, or a node that does not say)."""
    model: str = Field("", max_length=512)
    """Model the node serves (must be the pool's)."""
    weights_version: int = Field(0, ge=0)
    """Version the node holds right now."""
    weights_hash: str = Field("", max_length=128)
    """Hash of the weights the node holds right now."""
    capacity: int = Field(16, ge=1, le=4096)
    """Requests the node takes at once before the scheduler holds more back."""
    invite: bytes = Field(b"", max_length=4096)
    """Invite token envelope (invite-only pools)."""


class RegisterResponse(Message):
    """Scheduler -> worker: admitted; how to behave from now on."""

    node_id: str
    """The admitted node's id."""
    pool_id: str
    """Pool joined."""
    scheduler_id: str
    """The scheduler's node id: the node accepts rollout and verify requests signed by it."""
    heartbeat_interval_s: float
    """How often the node must heartbeat."""
    weights_envelope: bytes = b""
    """The trainer-signed `WeightUpdate` of the pool's current weights (empty: the base model)."""


class ChannelHello(Message):
    """Worker -> scheduler, the first frame on its node channel (`protocol.channel`): this
    connection is mine, and it answers the challenge the scheduler sent on it."""

    node_id: str = Field(min_length=1, max_length=128)
    """Sender's node id (the key that signs this is the one it registered with)."""
    pool_id: str = Field(min_length=1, max_length=64)
    """Pool the node registered in."""
    challenge: bytes = Field(min_length=32, max_length=32)
    """The random bytes the scheduler sent first on this connection."""


class Deregister(Message):
    """Worker -> scheduler: leave the pool cleanly."""

    node_id: str
    """Sender's node id."""
    stage: Literal["drain", "leave"] = "drain"
    """'drain': send me no new work; 'leave': I am gone (after my work finished)."""


class NodeAck(Message):
    """Scheduler -> worker: a node message was taken; the node's state now."""

    state: NodeState
    """The node's lifecycle state."""
    in_flight: int = 0
    """Requests the scheduler still waits on from this node."""


class RolloutSpec(Message):
    """Orchestrator -> scheduler: one rollout to generate (the scheduler picks the seed)."""

    request_id: str = Field(min_length=1, max_length=128)
    """Unique within the pool, chosen by the orchestrator: resubmitting it is a no-op."""
    prompt_ids: list[int] = Field(min_length=1, max_length=65536)
    """Prompt token ids (already chat-templated)."""
    sampling: SamplingParams = SamplingParams()
    """Sampling parameters."""
    min_version: int = Field(0, ge=0)
    """Lowest admissible weights version for the generator."""
    priority: int = Field(0, ge=0, le=100)
    """Queue order at the scheduler: lower goes first (as vLLM's `priority`); 0, the
    default, is training's. An orchestrator's online evaluation asks for 1, so it takes
    only capacity that training leaves idle. Never negative: no client outranks training."""

    _check_prompt_ids = field_validator("prompt_ids")(check_token_ids_non_negative)


class SubmitRollouts(Message):
    """Orchestrator -> scheduler: a batch of rollout requests (signed by the trainer key)."""

    pool_id: str = Field(min_length=1, max_length=64)
    """Pool the batch is for."""
    requests: list[RolloutSpec] = Field(min_length=1, max_length=10_000)
    """The requests."""


class SubmitAck(Message):
    """Scheduler -> orchestrator: the batch is durable."""

    accepted: int
    """New requests stored."""
    duplicates: int
    """Request ids already known (ignored: resubmitting is idempotent)."""


class ResultsQuery(Message):
    """Orchestrator -> scheduler: results after a cursor (long-poll)."""

    after: int = Field(0, ge=0)
    """Return results with seq > after (the last seq the caller has)."""
    limit: int = Field(500, ge=1, le=10_000)
    """Most results in one answer."""
    wait_s: float = Field(0.0, ge=0, le=60)
    """Block up to this long when there is nothing new."""


class RolloutResult(Message):
    """One request's final outcome, released exactly once in the results stream."""

    seq: int = Field(ge=1)
    """Position in the pool's results stream (strictly increasing)."""
    request_id: str
    """The request (for OpenAI-endpoint calls: the rollout id given in the answer)."""
    source: Literal["dispatch", "openai"] = "dispatch"
    """Submitted by the orchestrator, or made through the OpenAI-compatible endpoint."""
    status: Literal["accepted", "rejected", "failed"]
    """'accepted': verified (or skipped by the spot-check rate); 'rejected': an OpenAI-endpoint
    rollout that failed verification (its episode must not be trained on); 'failed': gave up."""
    detail: str = ""
    """Why a request failed or was rejected, or 'unverified (spot check)'."""
    weights_version: int = Field(0, ge=0)
    """Version the rollout was generated with."""
    rollout_envelope: bytes = b""
    """The generator's signed `Rollout`."""
    verdict_envelopes: list[bytes] = []
    """The signed verdicts that decided it (verifier, and a judge after a dispute)."""


class ResultsPage(Message):
    """Scheduler -> orchestrator: a page of the results stream."""

    results: list[RolloutResult]
    """Results in seq order."""
    last_seq: int
    """The cursor to pass as `after` next time."""


class AdmissionPolicy(Message):
    """Who may join a pool."""

    mode: Literal["open", "allowlist", "invite"] = "open"
    """open: anyone; allowlist: listed node ids; invite: holders of owner-signed invites."""
    allowlist: list[str] = []
    """Node ids admitted in allowlist mode."""


class EngineMix(Message):
    """What generates a pool's rollouts: honest error, hence every threshold, depends on it."""

    engine: Literal["torch", "vllm", "loadtest"]
    """Inference engine kind of the generating node."""
    dtype: Literal["float32", "bfloat16", "float16"]
    """Its compute dtype."""
    device: Literal["cpu", "cuda"]
    """Its device kind."""
    decode: Literal["loop", "slots"] | None = None
    """The torch engine's decode (`EngineConfig.decode`, resolved). In a pool's list, None
    covers either: thresholds fitted to the loop decode's noise hold for the slot decode's
    smaller errors. An exact tier's thresholds hold for the slot decode only, and its
    file names it (a loop-decode node would be rejected for its honest noise)."""

    def label(self) -> str:
        base = f"{self.engine}/{self.dtype}/{self.device}"
        return base if self.decode is None else f"{base}/{self.decode}"

    def covered_by(self, mixes: list[EngineMix]) -> bool:
        """Whether thresholds calibrated for `mixes` hold for a node generating with this."""
        return any(
            (m.engine, m.dtype, m.device) == (self.engine, self.dtype, self.device)
            and m.decode in (None, self.decode)
            for m in mixes
        )


class EvidencePolicy(Message):
    """Per-node evidence (`protocol.evidence`): the honest noise of the pool's engine mix and
    the false-flag budget of the sequential test over each generator's rollouts."""

    mu: float = Field(ge=0)
    """Honest mean of a rollout's clipped mean |logprob error| (nats)."""
    between: float = Field(ge=0)
    """Rollout-to-rollout standard deviation of that mean, whatever the length."""
    token: float = Field(ge=0)
    """Per-token standard deviation of the clipped error (its share shrinks as 1/sqrt(n))."""
    cap: float = Field(1.0, gt=0)
    """Per-token errors are clipped here before averaging."""
    shift: float = Field(1.0, gt=0)
    """The systematic excess, in honest standard deviations of a rollout's score, the test
    is tuned to catch fastest (larger excesses are caught faster still)."""
    false_flag_rate: float = Field(1e-6, gt=0, lt=1)
    """Probability that an honest node is flagged at least once within `horizon` rollouts
    (by any of its tests together: the budget is split evenly between them)."""
    horizon: int = Field(10_000, ge=1)
    """Rollouts of one node that `false_flag_rate` covers."""
    floor_watch: bool = False
    """Also flag a node whose scores sit below the honest floor: claims more exact than
    any honest engine of the mix computes (a launderer's, taken from a real prefill). Only
    for a mix whose every honest engine is as noisy as calibrated: an exact decode among
    them (the slot decode next to the loop's) would be flagged, so no shipped file sets it."""
    off_replay: float | None = Field(None, ge=0, lt=1)
    """Honest share of tokens that are not the verifier's replayed seeded choice (a replay
    score gap above the checks' `OFF_REPLAY_GAP`), fitted from honest verdicts; None: the
    replay test is off. Zero on an exact mix (the test then uses `OFF_REPLAY_FLOOR`)."""
    off_replay_excess: float = Field(2e-3, gt=0, lt=1)
    """The excess per-token rate over `off_replay` that the replay test is tuned to catch
    fastest: on an exact mix, about threshold / log(excess / floor) tokens off the seeded
    choice (4 at the defaults), each under the per-rollout tolerance, flag a node."""

    @property
    def tests(self) -> int:
        """How many one-sided tests share the false-flag budget."""
        return 1 + self.floor_watch + (self.off_replay is not None)

    @property
    def threshold(self) -> float:
        """CUSUM level that keeps `false_flag_rate` over `horizon` rollouts, all tests."""
        return math.log(self.horizon * self.tests / self.false_flag_rate)

    def sd(self, tokens: int) -> float:
        return math.sqrt(self.between**2 + self.token**2 / max(tokens, 1))

    def z(self, score: float, tokens: int) -> float:
        """A rollout's score in honest standard deviations above honest noise."""
        sd = self.sd(tokens)
        return (score - self.mu) / sd if sd > 0 else (math.inf if score > self.mu else 0.0)

    def expected_delay(self, delta: float) -> float:
        """Rollouts until a node `delta` standard deviations above honest is flagged (inf
        when the drift is not positive: too small an excess to ever be caught)."""
        drift = self.shift * delta - self.shift**2 / 2
        return self.threshold / drift if drift > 0 else math.inf


class SpotCheckPolicy(Message):
    """Per-node verification rates: a node earns fewer checks with a history of accepted
    rollouts, and what goes unverified is held until the node passes its next check.

    A node's rate is 1 until `full_until` of its rollouts were verified and accepted
    (`NodeRecord.earned`); then it halves every `halving` more, down to `floor`. A rollout
    the draw skips is released only once a later verified rollout of the same generator
    was accepted; if that one is rejected, or none comes within `hold_s`, the skipped
    rollout is verified itself, and a ban drops it. So a node that turns to cheating on
    every rollout gets none trained, and one that cheats on some gets, before its first
    checked cheat, a geometric number of unchecked ones: at most `bound(delta)` with
    probability 1 - delta (with every cheat rollout checked at `floor`). Worth it where a
    checked cheat is caught on that rollout: the exact tiers."""

    full_until: int = Field(64, ge=0)
    """Accepted verified rollouts a node needs before any of its rollouts goes unchecked."""
    halving: int = Field(64, ge=1)
    """Past `full_until`, the rate halves with every this many more accepted rollouts."""
    floor: float = Field(0.1, gt=0, le=1)
    """The lowest rate: the share of an established node's rollouts that are verified."""
    hold_s: float = Field(30.0, ge=0)
    """How long a skipped rollout waits for its generator's next accepted check before it
    is verified itself (0: skipped rollouts are released at once, nothing held)."""

    def rate(self, earned: int) -> float:
        """The share of a node's rollouts verified, after `earned` accepted ones (negative:
        a revoked right being earned back; checked fully)."""
        if earned < self.full_until:
            return 1.0
        return max(self.floor, 0.5 ** ((earned - self.full_until) / self.halving))

    def bound(self, delta: float = 1e-3) -> int:
        """Unchecked cheat rollouts of a node at `floor` before its first checked one, with
        probability at least 1 - delta: the least n with (1 - floor)^n <= delta."""
        if self.floor >= 1.0:
            return 0
        return math.ceil(math.log(delta) / math.log(1.0 - self.floor))


class VerificationPolicy(Message):
    """How rollouts are checked; thresholds come from `prime-node calibrate`."""

    spot_check_rate: float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of rollouts sent to a second worker (1.0 = all), the same for every node;
    `spot_checks` sets a rate per node instead."""
    spot_checks: SpotCheckPolicy | None = None
    """Per-node rates from each node's history, with skipped rollouts held until the node
    passes its next check (None: `spot_check_rate` for every node, nothing held)."""
    audit_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Fraction of verified rollouts that need two concurring verdicts: an acceptance (or
    a judge's acceptance overturning a rejection) is re-checked by another worker before
    release; when two disagree a third decides by majority and the minority loses
    reputation (a verifier that accepted a bad rollout is punished like its generator).
    1.0: no rollout is accepted, and no generator punished, on the word of one verifier."""
    proof: ProofParams = ProofParams()
    """Proof layout."""
    max_exp_mismatches: int = Field(38, ge=0)
    """Per chunk: most top-k exponents allowed to differ (TOPLOC)."""
    max_mant_err_mean: float = Field(10.0, ge=0)
    """Per chunk: largest allowed mean mantissa error of the matching top-k values."""
    max_mant_err_median: float = Field(8.0, ge=0)
    """Per chunk: largest allowed median mantissa error."""
    max_logprob_abs_diff: float = Field(0.5, gt=0)
    """Largest allowed |claimed - recomputed| logprob of any single token."""
    max_logprob_mean_abs_diff: float = Field(0.05, gt=0)
    """Largest allowed mean |claimed - recomputed| logprob over the completion (of at least
    `logprob_mean_min_tokens` tokens)."""
    logprob_mean_min_tokens: int = Field(16, ge=1, le=4096)
    """Completions shorter than this are judged by the per-token maximum alone: the mean of
    a few tokens is as noisy as one token (on the H200 in bf16 an honest 2-token mean
    reached 0.15, 1.5 x the longest completions' worst), and the per-node evidence, not this
    check, is what sees a small systematic excess."""
    sampling_tolerance: float = Field(0.05, ge=0)
    """Replay: a chosen token's perturbed score may trail the best by at most this."""
    max_sampling_mismatch_fraction: float = Field(0.02, ge=0, le=1)
    """Replay: fraction of tokens allowed outside the tolerance (numerical near-ties)."""
    engine_mixes: list[EngineMix] = Field([], max_length=64)
    """The engine mixes these thresholds were calibrated for (`prime-node calibrate` writes
    its own); a node generating with another mix is refused at registration. Empty: the
    policy states none, and no node is admitted (`pool create` refuses such a pool)."""
    evidence: EvidencePolicy | None = None
    """The per-node sequential test over verified rollouts' errors (None: off); fitted by
    `prime-node calibrate` for the same engine mix as the thresholds."""
    support_tolerance: float = Field(0.01, ge=0)
    """Support: slack on the top-p mass when deciding a token was inside the nucleus, and
    the width of a near-tie at the support's edge (tokens within a factor 1 - slack in
    probability count as either side; `verifier.sampling.support_mask`)."""

    @model_validator(mode="after")
    def check_one_spot_check_rule(self) -> VerificationPolicy:
        if self.spot_checks is not None and self.spot_check_rate < 1.0:
            raise ValueError(
                f"spot_check_rate ({self.spot_check_rate:g}) and spot_checks both set how "
                "often rollouts are verified: set spot_checks (per node) or "
                "spot_check_rate (every node), not both"
            )
        return self

    def logprob_mean_limit(self, tokens: int) -> float:
        """The largest mean |logprob error| accepted over a completion of `tokens` tokens.

        `max_logprob_mean_abs_diff` is fitted to honest rollouts' means, mostly of long
        completions, whose noise is smaller: on the H200 in bf16 a 16-token honest mean
        exceeded it 6 times in 10,000 (trust_stats_h200_smollm2_bf16). With per-node
        evidence the limit widens for short completions to the honest mean plus
        `MEAN_LIMIT_Z` standard deviations of an n-token mean (the evidence model:
        sqrt(between^2 + token^2 / n)); it never drops below the fitted threshold."""
        if tokens < self.logprob_mean_min_tokens:
            return math.inf
        ev = self.evidence
        if ev is None:
            return self.max_logprob_mean_abs_diff
        sd = math.sqrt(ev.between**2 + ev.token**2 / tokens)
        return max(self.max_logprob_mean_abs_diff, ev.mu + MEAN_LIMIT_Z * sd)


# One-sided normal quantile of 1e-5: the per-metric share of a 1e-4 per-rollout false
# rejection budget split over the checks that can reject (as `verifier.calibration` does).
MEAN_LIMIT_Z = 4.26


class ReputationPolicy(Message):
    """How verdicts move a node's reputation, and when it is banned."""

    initial: float = Field(1.0, gt=0, le=1)
    """Reputation of a newly admitted node."""
    reward_accepted: float = Field(0.02, ge=0, le=1)
    """Gain (capped at 1) when a node's rollout is accepted or its verdict is upheld."""
    penalty_lost_dispute: float = Field(0.25, gt=0, le=1)
    """Loss of the side a dispute proves wrong (a generator whose rollout was rejected
    by the judge, or a verifier that accepted a rollout two others rejected)."""
    overturned_rejection_factor: float = Field(1.2, ge=1, le=4)
    """A verifier whose rejection is overturned loses this many times
    `penalty_lost_dispute` (capped at 1): a false rejection costs an honest generator a
    dispute and costs more than a bad rollout, so rejecting everything is the dearer lie."""
    ban_below: float = Field(0.3, ge=0, lt=1)
    """A node whose reputation falls below this is banned and its work re-dispatched."""

    @property
    def penalty_overturned_rejection(self) -> float:
        """What a verifier loses when the judge overturns its rejection."""
        return min(1.0, self.penalty_lost_dispute * self.overturned_rejection_factor)

    @model_validator(mode="after")
    def check_ban_below_initial(self) -> ReputationPolicy:
        if self.ban_below >= self.initial:
            raise ValueError("ban_below must be lower than initial, or every node starts banned")
        return self


class CheckerPolicy(Message):
    """Who may verify, judge and audit others' rollouts (DESIGN.md section 10, "Sybils").

    Identities are free, so in a pool open to anyone the right to check is earned: a node
    checks others only once enough rollouts of its own were accepted by nodes that
    already check (verified, not spot-checked); the chain starts from the founding set:
    `founders`, the allowlist in allowlist mode, every invited node in invite mode."""

    earn_after: int = Field(0, ge=0, le=1_000_000)
    """Accepted rollouts of its own a node needs before it checks others; 0: every admitted
    node checks at once (for a pool whose admission vouches for its nodes)."""
    founders: list[str] = Field(default_factory=list, max_length=10_000)
    """Node ids that check from the start (the owner's own nodes)."""
    honest_wrong_rate: float = Field(0.005, gt=0, lt=0.5)
    """Share of an honest checker's verdicts that other checkers outvote (an overturned
    rejection, or an acceptance two others rejected): the noise of its engines. Each
    checker's verdicts are watched against it (`scheduler.checker_watch`)."""
    suspect_wrong_rate: float = Field(0.05, gt=0, lt=1)
    """The outvoted share the watch is tuned to catch: a checker wrong this often loses
    the right to check after about log(1 / false_alarm_rate) / drift verdicts (some 200 at
    the defaults), though rewards would keep its reputation up."""
    false_alarm_rate: float = Field(1e-6, gt=0, lt=0.5)
    """How rarely an honest checker at `honest_wrong_rate` loses its right (at most once in
    1 / this many verdicts)."""
    reearn_after: int = Field(32, ge=1, le=1_000_000)
    """Accepted rollouts of its own a node that lost the right needs to check again."""
    recent_window_s: float = Field(86_400.0, ge=0)
    """A node admitted (first registered) less than this long ago is recent; founders never
    are. Recent identities are the cheap ones: a Sybil can make many, but not make them old."""
    recent_draw_share: float = Field(0.25, ge=0, le=1)
    """Recent checkers together are drawn at most this share of the time while an
    established one is eligible (uniform draws when they are fewer), so that no number of
    recent identities dominates the verdicts."""
    max_recent_checkers: int = Field(1, ge=0, le=3)
    """At most this many of one rollout's checkers (verifier, auditor, judge) are recent;
    a verdict that would need another waits for an established checker."""

    @model_validator(mode="after")
    def check_suspect_above_honest(self) -> CheckerPolicy:
        if self.suspect_wrong_rate <= self.honest_wrong_rate:
            raise ValueError(
                "checkers.suspect_wrong_rate must be above checkers.honest_wrong_rate, or the "
                "watch would take the right from honest checkers"
            )
        return self

    @field_validator("founders")
    @classmethod
    def check_founders_are_node_ids(cls, v: list[str]) -> list[str]:
        from protocol.identity import IdentityError, public_key_from_node_id

        for node_id in v:
            try:
                public_key_from_node_id(node_id)
            except IdentityError as exc:
                raise ValueError(f"checkers.founders: {exc}") from exc
        return v


def check_founding_set(admission: AdmissionPolicy, checkers: CheckerPolicy) -> None:
    """Raise ValueError if earned rights could never be earned (no one checks at first)."""
    if checkers.earn_after and admission.mode == "open" and not checkers.founders:
        raise ValueError(
            "checkers.earn_after is set on an open pool without checkers.founders: nobody "
            "could check the first rollouts, so nobody would ever earn the right; name the "
            "owner's own nodes as founders"
        )


class PoolConfig(Message):
    """A pool, signed by its owner."""

    pool_id: str = Field(min_length=1, max_length=64)
    """Pool id."""
    model: str
    """Model name or path the pool trains."""
    trainer_public_key: bytes = Field(min_length=32, max_length=32)
    """Trainer's Ed25519 key: only weights it signs are loaded."""
    admission: AdmissionPolicy = AdmissionPolicy()
    """Admission policy."""
    verification: VerificationPolicy = VerificationPolicy()
    """Verification policy and thresholds."""
    reputation: ReputationPolicy = ReputationPolicy()
    """Reputation and ban rule."""
    checkers: CheckerPolicy = CheckerPolicy()
    """Who may verify, judge and audit: earned rights and the founding set."""
    async_level: int = Field(2, ge=0, le=64)
    """Largest allowed age (in steps) of a rollout's policy at training time."""

    @model_validator(mode="after")
    def check_rights_have_a_founding_set(self) -> PoolConfig:
        check_founding_set(self.admission, self.checkers)
        return self

    def founding_checkers(self) -> frozenset[str] | None:
        """Node ids that check from the start; None when every admitted node does."""
        if not self.checkers.earn_after or self.admission.mode == "invite":
            return None  # rights are not earned, or every node holds an owner's invite
        listed = self.admission.allowlist if self.admission.mode == "allowlist" else []
        return frozenset([*self.checkers.founders, *listed])


class FileEntry(Message):
    """One file of a weights version, in the order the files are concatenated."""

    name: str = Field(min_length=1, max_length=255)
    """File name inside the weights folder (no directories)."""
    size: int = Field(ge=0)
    """Bytes in the file."""

    @field_validator("name")
    @classmethod
    def check_plain_file_name(cls, v: str) -> str:
        if "/" in v or "\\" in v or v.startswith(".") or "\x00" in v:
            raise ValueError(f"file name {v!r} must be a plain name (no folders, not hidden)")
        return v


class TensorInfo(Message):
    """Where one tensor lies in the concatenated files (from the safetensors header)."""

    name: str = Field(min_length=1, max_length=1024)
    """Tensor name."""
    file: str = Field(min_length=1, max_length=255)
    """File that holds it."""
    dtype: str = Field(min_length=1, max_length=16)
    """safetensors dtype (F32, BF16, ...)."""
    shape: list[int]
    """Tensor shape."""
    offset: int = Field(ge=0)
    """Byte offset of the tensor's data in the concatenation of all files."""
    size: int = Field(ge=0)
    """Bytes of the tensor's data."""


class Manifest(Message):
    """A weights version, cut into pieces: layout and piece hashes, signed by the trainer.

    Its `digest()` (hex SHA-256 of its encoding) is the manifest hash that names the
    version everywhere: in the swarm handshake, in rollouts and in heartbeats."""

    step: int = Field(ge=0)
    """Trainer step (weights version)."""
    parent_step: int | None = None
    """Previous version, if any."""
    piece_size: int = Field(ge=1024, le=256 * 1024 * 1024)
    """Bytes per piece (the last may be shorter)."""
    total_size: int = Field(ge=0)
    """Bytes of the concatenated files."""
    files: list[FileEntry] = Field(min_length=1)
    """The files, in concatenation order."""
    tensors: list[TensorInfo] = []
    """Tensor layout of the safetensors files (informational: pieces are what is checked)."""
    pieces: list[str] = []
    """Hex SHA-256 of every piece, in order."""
    delta_of: str = Field("", max_length=64)
    """A delta version (`protocol.swarm.delta`): the manifest hash of the full version it
    applies to ('' = a full version)."""
    result: bytes = Field(b"", max_length=16 * 1024 * 1024)
    """A delta version: the trainer-signed manifest envelope of the full version it
    produces; a node hashes its reconstruction against it before loading or seeding it."""

    @model_validator(mode="after")
    def check_sizes_add_up(self) -> Manifest:
        if sum(f.size for f in self.files) != self.total_size:
            raise ValueError("total_size is not the sum of the file sizes")
        if len({f.name for f in self.files}) != len(self.files):
            raise ValueError("file names repeat")
        if len(self.pieces) != self.num_pieces:
            raise ValueError(
                f"{len(self.pieces)} piece hashes for {self.num_pieces} pieces of "
                f"{self.piece_size} bytes"
            )
        if any(len(h) != 64 for h in self.pieces):
            raise ValueError("piece hashes must be 64 hex characters")
        return self

    @property
    def num_pieces(self) -> int:
        return -(-self.total_size // self.piece_size)

    def piece_length(self, index: int) -> int:
        return min(self.piece_size, self.total_size - index * self.piece_size)


class SwarmPeer(Message):
    """One swarm member as the tracker knows it."""

    peer_id: str = Field(min_length=1, max_length=128)
    """libp2p peer id (= node id: the same Ed25519 key)."""
    addrs: list[str] = Field([], max_length=16)
    """libp2p multiaddrs it listens on."""
    complete: bool = False
    """It holds every piece (a seed)."""


class SwarmAnnounce(Message):
    """Peer -> tracker (the scheduler): I take part in the swarm of this manifest."""

    manifest_hash: str = Field(min_length=64, max_length=64)
    """Manifest being downloaded or seeded."""
    addrs: list[str] = Field([], max_length=16)
    """libp2p multiaddrs the sender listens on (its peer id is the envelope signer)."""
    complete: bool = False
    """The sender holds every piece."""
    left: int = Field(0, ge=0)
    """Bytes the sender still lacks."""
    stopped: bool = False
    """The sender leaves this swarm (forget it now rather than at expiry)."""
    want: int = Field(30, ge=0, le=200)
    """How many other peers the sender would like to hear of."""


class SwarmPeers(Message):
    """Tracker -> peer: other members of the manifest's swarm (a random sample)."""

    peers: list[SwarmPeer] = []
    """Other peers, seeds first."""
    interval_s: float = 15.0
    """Announce again after this long (the tracker forgets peers silent for 4 intervals)."""
