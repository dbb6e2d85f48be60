"""The per-node sequential test (protocol/evidence.py), replayed on honest and dishonest
error statistics: honest nodes are not flagged within the false-flag budget, a node whose
errors sit systematically above honest noise is, about as fast as the model says; and the
per-rollout thresholds calibration proposes from a fitted tail at a target rate."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocol.evidence import NodeEvidence, clipped_mean, fit_noise
from protocol.messages import EvidencePolicy

CAP = 1.0


def rollouts(rng: np.random.Generator, count: int, scale: float = 1.0, tokens=(32, 256)):
    """Per-token |logprob error| of `count` rollouts shaped like honest bf16 ones: a
    per-rollout level (batch composition, prompt) times heavy-tailed per-token noise with
    a few large outliers (the measured honest maximum was 0.48 nats on one token); `scale`
    inflates every error (what cheaper compute does)."""
    out = []
    for n in rng.integers(tokens[0], tokens[1], size=count):
        level = 0.042 * rng.lognormal(0.0, 0.15)
        errors = level * rng.exponential(1.0, size=n) * scale
        spikes = rng.random(n) < 0.002
        errors[spikes] += rng.uniform(0.2, 3.0, size=int(spikes.sum()))
        out.append(errors)
    return out


def scores(sets) -> list[tuple[float, int]]:
    return [(clipped_mean(list(e), CAP), len(e)) for e in sets]


def replay(model: EvidencePolicy, sample: list[tuple[float, int]]) -> NodeEvidence:
    ev = NodeEvidence()
    for s, n in sample:
        ev.add(model, s, n)
    return ev


@pytest.fixture(scope="module")
def model() -> EvidencePolicy:
    rng = np.random.default_rng(0)
    return fit_noise(scores(rollouts(rng, 2000)), cap=CAP, shift=1.5)


def test_threshold_is_the_false_flag_budget():
    m = EvidencePolicy(mu=0.04, between=0.005, token=0.05, false_flag_rate=1e-6, horizon=10_000)
    assert m.threshold == pytest.approx(math.log(1e10))
    assert m.expected_delay(0.2) == math.inf  # an excess below shift / 2 is never caught
    assert m.expected_delay(3.0) == pytest.approx(m.threshold / 2.5)


def test_fit_recovers_the_two_parts_of_honest_variance():
    rng = np.random.default_rng(1)
    n = rng.integers(16, 512, size=20_000)
    s = 0.05 + rng.normal(0, 0.004, size=n.size) + rng.normal(0, 0.06, size=n.size) / np.sqrt(n)
    m = fit_noise(list(zip(s.tolist(), n.tolist(), strict=True)))
    assert m.mu == pytest.approx(0.05, abs=1e-3)
    assert m.between == pytest.approx(0.004, rel=0.15)
    assert m.token == pytest.approx(0.06, rel=0.15)


def test_honest_nodes_are_not_flagged_over_100k_replayed_rollouts(model):
    """Independent honest sets (another seed than the fit's), 10 nodes x 10,000 rollouts:
    the budget is 1e-6 per node per 10,000, so any flag here is a broken test."""
    rng = np.random.default_rng(2)
    peaks = []
    for _ in range(10):
        ev = replay(model, scores(rollouts(rng, 10_000)))
        assert ev.flagged_at is None, ev
        peaks.append(ev.peak)
    assert max(peaks) < model.threshold
    print(
        f"\nhonest CUSUM peaks over 10 x 10,000 rollouts: max {max(peaks):.1f} "
        f"(threshold {model.threshold:.1f})"
    )


def test_one_wild_token_does_not_flag_an_honest_node(model):
    rng = np.random.default_rng(3)
    sample = rollouts(rng, 200)
    for e in sample[::10]:
        e[0] = 30.0  # a token the verifier scores very differently (a near-tie, say)
    assert replay(model, scores(sample)).flagged_at is None


@pytest.mark.parametrize(
    ("scale", "count", "at_most"),
    # int8-like (its mean error was 2.1x honest, measured on an H200), then smaller excesses:
    # the rollout-to-rollout spread of honest noise, not the token noise, sets the pace.
    [(2.1, 100, 8), (1.3, 400, 40), (1.15, 1500, 400)],
)
def test_systematic_excess_is_flagged_about_as_fast_as_the_model_says(model, scale, count, at_most):
    rng = np.random.default_rng(4)
    delays = []
    for _ in range(20):
        ev = replay(model, scores(rollouts(rng, count, scale=scale)))
        assert ev.flagged_at is not None, f"x{scale} never flagged in {count} rollouts"
        delays.append(ev.flagged_at)
    median = float(np.median(delays))
    delta = (model.mu * (scale - 1)) / model.sd(144)
    expected = model.expected_delay(delta)
    print(f"\nx{scale}: median {median:.0f} rollouts, max {max(delays)}, model {expected:.1f}")
    assert median <= at_most
    assert median <= 2 * expected + 2


def test_a_verdicts_score_is_brought_back_to_temperature_one():
    """A client's low temperature inflates honest logprob errors as 1/T: the score fed to
    the test is scaled back, so the request never gets an honest node flagged."""
    from protocol.messages import CheckResult, Verdict
    from scheduler.evidence_watch import evidence_score

    check = CheckResult(
        name="logprobs", passed=True, metrics={"clipped_mean_abs_diff": 0.4, "tokens": 100.0}
    )
    v = Verdict(
        request_id="r",
        rollout_digest="d",
        generator_id="g",
        verifier_id="v",
        weights_hash="h",
        accepted=True,
        checks=[check],
    )
    assert evidence_score(v, 1.0) == (0.4, 100, None)
    assert evidence_score(v, 0.1) == (pytest.approx(0.04), 100, None)
    assert evidence_score(v, 0.0) == (0.4, 100, None)  # greedy: logprobs are at T = 1
    assert evidence_score(v.model_copy(update={"checks": []}), 1.0) is None
    # The replay test's input: the sampling check's count of tokens off the seeded choice.
    replayed = CheckResult(name="sampling", passed=True, metrics={"off_replay_tokens": 2.0})
    assert evidence_score(v.model_copy(update={"checks": [check, replayed]}), 1.0) == (0.4, 100, 2)


def test_thresholds_come_from_the_fitted_tail_at_the_target_rate():
    """An exponential honest metric: the proposed threshold is its (1 - 1e-4) quantile
    (ln 1e4 = 9.2 scale units), far past the sample maximum of 2,000 draws, and never below
    that maximum; the fit says what share of honest rollouts the threshold rejects."""
    from verifier.calibration import (
        MetricStats,
        TailFit,
        honest_rate,
        propose,
        summarize,
        threshold,
    )

    rng = np.random.default_rng(5)
    values = (rng.exponential(0.05, size=2000)).tolist()
    tail = TailFit.of(values)
    assert tail.quantile(1e-4) == pytest.approx(0.05 * math.log(1e4), rel=0.15)
    assert tail.exceedance(tail.quantile(1e-4)) == pytest.approx(1e-4)
    (stat,) = summarize({"max_abs_diff": values})
    policy = propose([stat], target_rate=1e-4)
    assert threshold(stat, policy) == pytest.approx(0.46, rel=0.15)
    assert honest_rate(stat, policy) == pytest.approx(1e-4, rel=0.01)
    assert propose([stat], target_rate=1e-2).max_logprob_abs_diff < policy.max_logprob_abs_diff
    # Never below the worst honest value, whatever the target.
    worst = MetricStats("max_abs_diff", 0.05, 0.2, 0.9, TailFit(0.1, 0.01, 0.1))
    assert propose([worst], target_rate=0.05).max_logprob_abs_diff >= 0.9


def test_the_rollout_rate_is_split_between_metrics_and_short_means_are_not_judged():
    """Two metrics, either of which rejects: each threshold sits at the target over two,
    so an honest rollout is rejected at most at the target rate. The mean logprob error of
    a completion shorter than `logprob_mean_min_tokens` is neither judged by the check nor
    used to calibrate it: an honest 2-token mean on the H200 reached 0.15 nats."""
    from protocol.messages import CheckResult, VerificationPolicy
    from verifier.calibration import collect, honest_rate, propose, summarize

    rng = np.random.default_rng(6)
    values = rng.exponential(0.05, size=2000).tolist()
    stats = summarize({"max_abs_diff": values, "max_score_gap": values})
    policy = propose(stats, target_rate=1e-4)
    assert sum(honest_rate(s, policy) for s in stats) == pytest.approx(1e-4, rel=0.01)

    def logprobs(mean: float, tokens: int) -> list[CheckResult]:
        metrics = {"max_abs_diff": mean, "mean_abs_diff": mean, "tokens": float(tokens)}
        return [CheckResult(name="logprobs", passed=True, metrics=metrics)]

    min_tokens = VerificationPolicy().logprob_mean_min_tokens
    collected = collect([logprobs(0.04, 100), logprobs(0.15, 2), logprobs(0.05, min_tokens)])
    assert collected["mean_abs_diff"] == [0.04, 0.05]
    assert collected["max_abs_diff"] == [0.04, 0.15, 0.05]


def test_a_policy_is_judged_again_from_measured_metrics():
    """`rejects` re-judges checks measured under another policy: the numeric thresholds
    from their metrics, the short mean not at all, the sampling check from per-token gaps
    (or from the worst gap when the policy allows no mismatch), failed non-numeric checks
    as they were."""
    from protocol.messages import CheckResult, VerificationPolicy
    from verifier.calibration import rejects

    def checks(max_diff=0.1, mean=0.01, tokens=32, gap=0.0, term=True) -> list[CheckResult]:
        return [
            CheckResult(name="termination", passed=term),
            CheckResult(name="support", passed=True, metrics={"tokens_outside": 0.0}),
            CheckResult(name="sampling", passed=True, metrics={"max_score_gap": gap}),
            CheckResult(
                name="logprobs",
                passed=True,
                metrics={"max_abs_diff": max_diff, "mean_abs_diff": mean, "tokens": tokens},
            ),
            CheckResult(
                name="proof",
                passed=True,
                metrics={"exp_mismatches": 1, "mant_err_mean": 0.5, "mant_err_median": 0},
            ),
        ]

    policy = VerificationPolicy(max_sampling_mismatch_fraction=0.0)
    assert not rejects(checks(), policy)
    assert rejects(checks(max_diff=0.6), policy)
    assert rejects(checks(mean=0.06), policy)
    assert not rejects(checks(mean=0.06, tokens=4), policy)  # under logprob_mean_min_tokens
    assert rejects(checks(term=False), policy)
    assert rejects(checks(gap=0.1), policy)
    lenient = VerificationPolicy(max_sampling_mismatch_fraction=0.1)
    assert not rejects(checks(gap=0.1), lenient, score_gaps=[0.1] + [0.0] * 19)
    assert rejects(checks(gap=0.1), lenient, score_gaps=[0.1] * 4 + [0.0] * 16)
    with pytest.raises(ValueError):
        rejects(checks(gap=0.1), lenient)


def test_a_heavier_than_exponential_tail_gets_the_pessimistic_fit():
    """Honest errors with a Pareto tail (the RL run's max logprob error on the H200 is one):
    the fit to the top tenth alone puts the 1e-5 quantile below what a larger honest sample
    reaches; the fit over the top hundredth does not, and the threshold is that one."""
    from verifier.calibration import HeavyTail, TailFit

    rng = np.random.default_rng(7)
    sample = (rng.pareto(4.0, size=4000) * 0.1).tolist()
    fresh = (rng.pareto(4.0, size=400_000) * 0.1).tolist()
    tenth, heavy = TailFit.of(sample, 0.1), HeavyTail.of(sample)
    assert len(heavy.fits) == 3  # 10%, 3%, 1% of 4,000: each at least 30 values
    assert heavy.quantile(1e-5) > tenth.quantile(1e-5)
    over = sum(v > heavy.quantile(1e-5) for v in fresh) / len(fresh)
    assert over < sum(v > tenth.quantile(1e-5) for v in fresh) / len(fresh)
    assert HeavyTail.of(sample[:200]).fits == (TailFit.of(sample[:200], 0.1),)


def test_each_regime_is_fitted_apart_and_the_larger_threshold_holds():
    """A small sample from a noisier regime (a real run) beside a large tame one (a bench):
    fitting their union lets the large one dilute the noisy tail; fitting them apart keeps
    the noisy regime's threshold, and a metric one regime did not measure comes from the
    other."""
    from protocol.messages import CheckResult
    from verifier.calibration import collect, propose, propose_over_regimes, summarize

    rng = np.random.default_rng(8)

    def checks(lp: float, gap: float | None) -> list[CheckResult]:
        out = [CheckResult(name="logprobs", passed=True, metrics={"max_abs_diff": lp})]
        if gap is not None:
            out.append(CheckResult(name="sampling", passed=True, metrics={"max_score_gap": gap}))
        return out

    bench = [checks(v, 0.1) for v in rng.exponential(0.05, size=50_000)]
    run = [checks(v, None) for v in rng.exponential(0.1, size=1000)]
    union = propose(summarize(collect(bench + run)))
    apart = propose_over_regimes([bench, run])
    alone = propose(summarize(collect(run)))
    assert apart.max_logprob_abs_diff == alone.max_logprob_abs_diff > union.max_logprob_abs_diff
    assert apart.sampling_tolerance == propose(summarize(collect(bench))).sampling_tolerance
