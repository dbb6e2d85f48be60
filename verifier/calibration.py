"""Statistics of honest verification errors, and thresholds proposed from them.

Input: the metrics of verdicts on honest rollouts, checked with no thresholds at all.
Output: per metric the median, 99th percentile, maximum and a fitted tail, and a
`VerificationPolicy` whose thresholds sit where the honest distribution is exceeded with
the target probability per rollout (`target_rate`, default 1e-4, split evenly between the
metrics, any of which rejects), extrapolated past the
sample by an exponential tail fitted to its top tenth (peaks over a threshold: the mean
excess over the 90th percentile is the tail's scale), never below a floor, and capped
where tampering starts (a capped metric then rejects honest rollouts more often than the
target: `honest_rate` says how often).

Whether the engine mix is exact (`exactness`): at least `EXACT_TOKENS` honest tokens, none
off the replayed seeded choice and no logprob error above float noise (`EXACT_LOGPROB`);
for an exact mix `propose_exact` gives the exact tier (`EXACT_TIER`: one token off the
seeded choice rejects a rollout), never below the worst honest value measured.

Also the per-node evidence model (`propose_evidence`): the honest mean and spread of each
rollout's clipped mean logprob error, fitted from the same verdicts, and the honest share
of tokens off the replayed seeded choice (0 on an exact mix).

Invariant: proposed thresholds are never below the worst honest value measured, whatever
the target; the
evidence model's spread is never below `MIN_EVIDENCE_SD` nor a tenth of the honest mean
(an engine mix as exact as fp32 on one CPU must not flag an honest node for the noise of
another batch composition).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protocol.evidence import fit_noise
from protocol.messages import CheckResult, EvidencePolicy, VerificationPolicy

# metric name in CheckResult.metrics -> (check name, policy field, floor)
_FIELDS = {
    "exp_mismatches": ("proof", "max_exp_mismatches", 4),
    "mant_err_mean": ("proof", "max_mant_err_mean", 1.0),
    "mant_err_median": ("proof", "max_mant_err_median", 1.0),
    "max_abs_diff": ("logprobs", "max_logprob_abs_diff", 0.01),
    "mean_abs_diff": ("logprobs", "max_logprob_mean_abs_diff", 0.002),
    "max_score_gap": ("sampling", "sampling_tolerance", 0.001),
    "mismatch_fraction": ("sampling", "max_sampling_mismatch_fraction", 0.0),
}

# Upper bounds: a threshold above these would let tampering through. On the H200
# (bench_trust over trust_stats_h200_smollm2_bf16), moving the CUDA thresholds from their
# base-model fit (logprob 0.81, replay 0.83, exponents 15) to the fit over two RL runs
# (1.65, 1.39, 25) cut the share of cheating rollouts rejected (int8 52% -> 22%, weight
# noise 1e-2 73% -> 42%, top-p 0.9 83% -> 70%, one steered token 100% -> 98%), while every
# cheat was still banned within 14 rollouts (the per-node evidence or the disputes).
_CAPS = {
    "max_exp_mismatches": 64,
    "max_mant_err_mean": 16.0,
    "max_mant_err_median": 16.0,
    "max_logprob_abs_diff": 2.0,
    "max_logprob_mean_abs_diff": 0.1,
    "sampling_tolerance": 1.5,
    "max_sampling_mismatch_fraction": 0.05,
}


def permissive_policy() -> VerificationPolicy:
    """A policy that rejects nothing numeric: for measuring, never for deciding."""
    inf = 1e30
    return VerificationPolicy(
        max_exp_mismatches=10**9,
        max_mant_err_mean=inf,
        max_mant_err_median=inf,
        max_logprob_abs_diff=inf,
        max_logprob_mean_abs_diff=inf,
        sampling_tolerance=inf,
        max_sampling_mismatch_fraction=1.0,
        support_tolerance=1.0,
    )


TAIL_FRACTION = 0.1
# The sample's tops that are fitted, each only with at least MIN_TAIL_POINTS values.
TAIL_FRACTIONS = (TAIL_FRACTION, 0.03, 0.01)
MIN_TAIL_POINTS = 30
DEFAULT_TARGET_RATE = 1e-4


@dataclass(frozen=True)
class TailFit:
    """P(X > u + x) = fraction * exp(-x / scale) for x >= 0: the sample's top `fraction`."""

    u: float
    scale: float
    fraction: float

    @classmethod
    def of(cls, values: list[float], fraction: float = TAIL_FRACTION) -> TailFit:
        s = sorted(values)
        k = max(1, int(len(s) * fraction))
        u = s[len(s) - k - 1] if len(s) > k else s[0]
        excess = [v - u for v in s[len(s) - k :]]
        return cls(u, sum(excess) / len(excess), k / len(s))

    def quantile(self, rate: float) -> float:
        """The value exceeded with probability `rate` (inside the fit: rate < fraction)."""
        if rate >= self.fraction or self.scale <= 0:
            return self.u
        return self.u + self.scale * math.log(self.fraction / rate)

    def exceedance(self, value: float) -> float:
        """P(X > value) under the fit (`fraction` for values below u)."""
        if self.scale <= 0:  # the top of the sample is one value: nothing honest exceeds it
            return 0.0 if value >= self.u else self.fraction
        if value <= self.u:
            return self.fraction
        return self.fraction * math.exp(-(value - self.u) / self.scale)


@dataclass(frozen=True)
class HeavyTail:
    """The most pessimistic of exponential fits to the sample's top tenth, thirtieth and
    hundredth (those with at least `MIN_TAIL_POINTS` values). A tail heavier than
    exponential shows as a scale that grows further out: the max logprob error of the
    honest verdicts of an RL run on the H200 has scale 0.083 over its top tenth and 0.122
    over its top hundredth, and the fit to the top tenth alone put its 1e-5 quantile (0.94)
    barely above the worst of 3,880 values (0.87) while 4 of them exceeded 0.74, where that
    fit expected 0.6."""

    fits: tuple[TailFit, ...]

    @classmethod
    def of(cls, values: list[float]) -> HeavyTail:
        n = len(values)
        fits = tuple(TailFit.of(values, f) for f in TAIL_FRACTIONS if f * n >= MIN_TAIL_POINTS)
        return cls(fits or (TailFit.of(values, TAIL_FRACTIONS[0]),))

    def quantile(self, rate: float) -> float:
        return max(f.quantile(rate) for f in self.fits)

    def exceedance(self, value: float) -> float:
        return max(f.exceedance(value) for f in self.fits)


@dataclass
class MetricStats:
    name: str
    median: float
    p99: float
    maximum: float
    tail: TailFit | HeavyTail


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def collect(
    verdict_checks: list[list[CheckResult]], mean_min_tokens: int | None = None
) -> dict[str, list[float]]:
    """Metric name -> values over all verdicts (the mean logprob error only of completions
    the check judges by it: `VerificationPolicy.logprob_mean_min_tokens` or more tokens)."""
    if mean_min_tokens is None:
        mean_min_tokens = VerificationPolicy().logprob_mean_min_tokens
    out: dict[str, list[float]] = {k: [] for k in _FIELDS}
    for checks in verdict_checks:
        for c in checks:
            short = c.metrics.get("tokens", mean_min_tokens) < mean_min_tokens
            for k, v in c.metrics.items():
                if k in out and _FIELDS[k][0] == c.name and not (k == "mean_abs_diff" and short):
                    out[k].append(v)
    return out


def summarize(values: dict[str, list[float]]) -> list[MetricStats]:
    return [
        MetricStats(k, _quantile(v, 0.5), _quantile(v, 0.99), max(v), HeavyTail.of(v))
        for k, v in values.items()
        if v
    ]


def propose(
    stats: list[MetricStats],
    base: VerificationPolicy | None = None,
    target_rate: float = DEFAULT_TARGET_RATE,
) -> VerificationPolicy:
    """Thresholds = each fitted tail's (1 - target_rate / m) quantile for the m metrics
    fitted, at least the floor and the worst honest value, capped where tampering starts.
    The rate is split between the metrics because any one of them rejects: the rollout's
    false-rejection rate is then at most `target_rate` (Bonferroni), not m times it."""
    fields = dict((base or VerificationPolicy()).model_dump())
    per_metric = target_rate / max(len(stats), 1)
    for s in stats:
        _, field, floor = _FIELDS[s.name]
        value = max(s.tail.quantile(per_metric), floor)
        value = max(min(value, _CAPS[field]), s.maximum)
        # Rounded up: a threshold rounded below the worst honest value would reject it.
        fields[field] = math.ceil(value) if field == "max_exp_mismatches" else _ceil4(value)
    return VerificationPolicy(**fields)


def propose_over_regimes(
    regimes: list[list[list[CheckResult]]],
    base: VerificationPolicy | None = None,
    target_rate: float = DEFAULT_TARGET_RATE,
) -> VerificationPolicy:
    """Thresholds that hold in every regime (a bench's prompts; a real run's batch mixes and
    trained weights): each the largest of the regimes' own proposals. Fitting their union
    instead lets the larger, tamer sample dilute the heavier tail of the other."""
    fields = dict((base or VerificationPolicy()).model_dump())
    proposed: dict[str, list[float]] = {}
    for regime in regimes:
        stats = summarize(collect(regime))
        policy = propose(stats, base, target_rate)
        for s in stats:  # only what the regime measured (a run's verdicts lack some metrics)
            field = _FIELDS[s.name][1]
            proposed.setdefault(field, []).append(getattr(policy, field))
    fields.update({field: max(values) for field, values in proposed.items()})
    return VerificationPolicy(**fields)


# What an exact mix shows over at least this many honest tokens (issue 27's definition):
# no token off the replayed seeded choice, and logprobs equal to a verifier's to float
# noise (the H100's slot decode: 3.8e-6 over 587,191 tokens; tiny fp32 on a CPU: 4e-6).
EXACT_TOKENS = 100_000
EXACT_LOGPROB = 1e-4
# The exact tier's thresholds (`configs/verification/smollm2-torch-cuda-bf16-exact.toml`).
EXACT_TIER = {
    "max_logprob_abs_diff": 1e-3,
    "max_logprob_mean_abs_diff": 1e-3,
    "sampling_tolerance": 1e-3,
    "max_sampling_mismatch_fraction": 0.0,
}


@dataclass
class Exactness:
    """What honest verdicts say of a mix's exactness."""

    tokens: int
    off_replay: int  # tokens off the replayed seeded choice
    max_logprob_err: float

    @property
    def exact(self) -> bool:
        return (
            self.tokens >= EXACT_TOKENS
            and self.off_replay == 0
            and self.max_logprob_err <= EXACT_LOGPROB
        )

    def describe(self) -> str:
        seen = (
            f"{self.tokens:,} honest tokens, {self.off_replay} off the replayed seeded "
            f"choice, max logprob error {self.max_logprob_err:.3g}"
        )
        if self.exact:
            return f"exact ({seen})"
        if self.off_replay or self.max_logprob_err > EXACT_LOGPROB:
            return f"not exact ({seen})"
        return f"not proven exact ({seen}; it takes {EXACT_TOKENS:,})"


def exactness(verdict_checks: list[list[CheckResult]]) -> Exactness:
    """Tokens, tokens off the replay and the worst logprob error over honest verdicts."""
    tokens = off = 0
    worst = 0.0
    for checks in verdict_checks:
        by = {c.name: c.metrics for c in checks}
        lp, sampling = by.get("logprobs", {}), by.get("sampling", {})
        tokens += int(lp.get("tokens", 0))
        worst = max(worst, lp.get("max_abs_diff", 0.0))
        off += int(sampling.get("off_replay_tokens", 0))
    return Exactness(tokens, off, worst)


def propose_exact(stats: list[MetricStats], proposed: VerificationPolicy) -> VerificationPolicy:
    """`proposed` with the exact tier's replay and logprob thresholds (each at least the
    worst honest value measured); the proof's stay as fitted."""
    worst = {_FIELDS[s.name][1]: s.maximum for s in stats}
    update = {f: _ceil4(max(v, worst.get(f, 0.0))) for f, v in EXACT_TIER.items()}
    update["max_sampling_mismatch_fraction"] = worst.get("max_sampling_mismatch_fraction", 0.0)
    return proposed.model_copy(update=update)


def _ceil4(x: float) -> float:
    return math.ceil(round(x * 1e4, 6)) / 1e4


def threshold(s: MetricStats, policy: VerificationPolicy) -> float:
    """`policy`'s threshold on this metric."""
    return getattr(policy, _FIELDS[s.name][1])


def honest_rate(s: MetricStats, policy: VerificationPolicy) -> float:
    """Estimated share of honest rollouts that `policy`'s threshold on this metric rejects."""
    return s.tail.exceedance(threshold(s, policy))


_NUMERIC_CHECKS = ("sampling", "logprobs", "proof")


def rejects(
    checks: list[CheckResult], policy: VerificationPolicy, score_gaps: list[float] | None = None
) -> bool:
    """Whether `policy` rejects a rollout whose checks ran under another policy of the same
    `support_tolerance` (`permissive_policy()` when measuring): the other checks (request,
    weights, termination, support) count as they passed, the numeric ones are judged again
    from their metrics (the proof's are each the worst chunk's). The sampling check needs
    the per-token `score_gaps`, unless `policy` allows no mismatch (then the worst decides)."""
    if any(not c.passed for c in checks if c.name not in _NUMERIC_CHECKS):
        return True
    by = {c.name: c.metrics for c in checks}
    if by.get("support", {}).get("tokens_outside", 0) > 0:
        return True
    if score_gaps is not None:
        outside = sum(g > policy.sampling_tolerance for g in score_gaps)
        mismatch = outside / max(len(score_gaps), 1) > policy.max_sampling_mismatch_fraction
    elif policy.max_sampling_mismatch_fraction == 0:
        mismatch = by["sampling"]["max_score_gap"] > policy.sampling_tolerance
    else:
        raise ValueError("judging a policy that allows sampling mismatches needs score_gaps")
    lp, proof = by["logprobs"], by["proof"]
    return (
        mismatch
        or lp["max_abs_diff"] > policy.max_logprob_abs_diff
        or lp["mean_abs_diff"] > policy.logprob_mean_limit(int(lp["tokens"]))
        or proof["exp_mismatches"] > policy.max_exp_mismatches
        or proof["mant_err_mean"] > policy.max_mant_err_mean
        or proof["mant_err_median"] > policy.max_mant_err_median
    )


MIN_EVIDENCE_SD = 1e-4  # nats: a systematic excess smaller than this is not worth a ban


def propose_evidence(verdict_checks: list[list[CheckResult]], **settings) -> EvidencePolicy:
    """The per-node evidence model fitted to honest verdicts (see the module invariant)."""
    scores = [
        (c.metrics["clipped_mean_abs_diff"], int(c.metrics["tokens"]))
        for checks in verdict_checks
        for c in checks
        if c.name == "logprobs" and "clipped_mean_abs_diff" in c.metrics
    ]
    fitted = fit_noise(scores, **settings)
    floor = max(MIN_EVIDENCE_SD, 0.1 * fitted.mu)
    update: dict = {"between": round(max(fitted.between, floor), 6)}
    # The replay test's honest rate, over the verdicts that counted tokens off the seeded
    # choice: their count over their own tokens.
    counted = [
        (m["sampling"]["off_replay_tokens"], m["logprobs"]["tokens"])
        for m in ({c.name: c.metrics for c in checks} for checks in verdict_checks)
        if "off_replay_tokens" in m.get("sampling", {}) and "tokens" in m.get("logprobs", {})
    ]
    tokens = sum(n for _, n in counted)
    if tokens and "off_replay" not in settings:
        update["off_replay"] = sum(k for k, _ in counted) / tokens
    return fitted.model_copy(update=update)
