"""The per-node evidence's two newer tests (protocol/evidence.py), replayed on honest and
dishonest statistics shaped like measured ones: the replay test (tokens off the seeded
choice, against the mix's honest rate) and the floor watch (errors below the honest
floor). Honest nodes stay unflagged within the budget; the near-tie liar and the
launderer, which pass every per-rollout check, are flagged within a few rollouts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocol.evidence import BELOW, REPLAY, NodeEvidence, RolloutScore, clipped_mean
from protocol.messages import CheckResult, EvidencePolicy
from tests.unit.test_evidence import CAP, rollouts, scores
from verifier.calibration import propose_evidence

# Measured on the tiny model, CPU, 64 rollouts of 48 tokens each (3,072 tokens): the
# bf16 loop decode had 20 tokens off the verifier's replayed choice, fp32 none.
BF16_OFF_RATE = 20 / 3072
EXACT = EvidencePolicy(mu=1e-6, between=1e-4, token=0.0, off_replay=0.0)


def run(policy: EvidencePolicy, sample: list[RolloutScore]) -> NodeEvidence:
    ev = NodeEvidence()
    for s in sample:
        ev.add(policy, *s)
    return ev


def honest_counts(rng, count: int, rate: float, score: float = 1e-6) -> list[RolloutScore]:
    n = rng.integers(16, 256, size=count)
    return [
        RolloutScore(score, int(t), int(k)) for t, k in zip(n, rng.binomial(n, rate), strict=True)
    ]


def test_the_budget_is_split_between_the_tests_a_policy_runs():
    base = EvidencePolicy(mu=0.04, between=0.005, token=0.05, false_flag_rate=1e-6)
    assert base.tests == 1 and base.threshold == pytest.approx(math.log(1e10))
    both = base.model_copy(update={"off_replay": 0.01, "floor_watch": True})
    assert both.tests == 3 and both.threshold == pytest.approx(math.log(3e10))


def test_honest_nodes_of_a_noisy_mix_are_not_flagged_by_their_tokens_off_the_replay():
    """10 nodes x 10,000 rollouts at the measured bf16 rate: no flag, and the peak is far
    below the threshold (a rate's honest fluctuations are all the test ever sees)."""
    rng = np.random.default_rng(10)
    policy = EvidencePolicy(mu=0.009, between=0.003, token=0.02, off_replay=BF16_OFF_RATE)
    peaks = []
    for _ in range(10):
        ev = run(policy, honest_counts(rng, 10_000, BF16_OFF_RATE, score=0.009))
        assert ev.flagged_at is None, ev
        peaks.append(ev.replay)
    print(
        f"\\nhonest replay CUSUM peaks, bf16 rate: max {max(peaks):.1f} of {policy.threshold:.1f}"
    )


@pytest.mark.parametrize(
    ("lies_per_rollout", "median_at_most", "at_most"), [(1.0, 4, 4), (0.1, 60, 150)]
)
def test_lies_under_the_tolerance_flag_a_node_of_an_exact_mix(
    lies_per_rollout, median_at_most, at_most
):
    """On an exact mix an honest token is never off the seeded choice, so each near-tie
    taken the other way (a gap the per-rollout tolerance admits) counts: one in every
    rollout flags within 4 rollouts, one in a tenth of them within 150 (median 60)."""
    rng = np.random.default_rng(11)
    delays = []
    for _ in range(20):
        n = rng.integers(16, 256, size=2000)
        sample = [
            RolloutScore(1e-6, int(t), int(k))
            for t, k in zip(n, rng.binomial(1, lies_per_rollout, n.size), strict=True)
        ]
        ev = run(EXACT, sample)
        assert ev.flagged_by == REPLAY, ev
        delays.append(ev.flagged_at)
    assert max(delays) <= at_most and np.median(delays) <= median_at_most, delays
    # ...and never an honest node of that mix, whatever it generates.
    assert run(EXACT, honest_counts(rng, 100_000, 0.0)).peak == 0.0


def test_a_cheat_well_above_the_honest_rate_is_flagged_and_one_at_it_is_not():
    """Cheaper compute in a noisy mix moves more tokens off the replay (measured on the
    tiny bf16 mix: int8 weights changed most rollouts); at three times the honest rate
    the test flags it within a few hundred rollouts."""
    rng = np.random.default_rng(12)
    policy = EvidencePolicy(mu=0.009, between=0.003, token=0.02, off_replay=BF16_OFF_RATE)
    cheat = run(policy, honest_counts(rng, 2000, 3 * BF16_OFF_RATE, score=0.009))
    assert cheat.flagged_by == REPLAY and cheat.flagged_at <= 400, cheat
    same = run(policy, honest_counts(rng, 2000, BF16_OFF_RATE, score=0.009))
    assert same.flagged_at is None, same


def test_the_floor_watch_flags_claims_more_exact_than_the_mix():
    """The launderer of issue 27: its claims come from a real prefill, so its error score
    (1e-7 measured on the H200) sits far below the honest bf16 floor (0.040). The test
    over errors above noise never moves; the floor watch flags it within 4 rollouts and
    leaves 100,000 honest rollouts alone."""
    rng = np.random.default_rng(13)
    honest = scores(rollouts(rng, 2000))
    fitted = propose_evidence(
        [
            [
                CheckResult(
                    name="logprobs", passed=True, metrics={"clipped_mean_abs_diff": s, "tokens": n}
                )
            ]
            for s, n in honest
        ],
        cap=CAP,
        shift=1.5,
    )
    watched = fitted.model_copy(update={"floor_watch": True})
    launderer = [RolloutScore(1e-7, int(n)) for n in rng.integers(16, 256, size=200)]
    assert run(fitted, launderer).flagged_at is None  # what the issue found
    ev = run(watched, launderer)
    assert ev.flagged_by == BELOW and ev.flagged_at <= 4, ev
    for _ in range(10):
        ev = run(watched, [RolloutScore(s, n) for s, n in scores(rollouts(rng, 10_000))])
        assert ev.flagged_at is None, ev


def test_calibration_fits_the_honest_rate_of_tokens_off_the_replay():
    rng = np.random.default_rng(14)
    verdicts = []
    for e in rollouts(rng, 500):
        n = len(e)
        verdicts.append(
            [
                CheckResult(
                    name="logprobs",
                    passed=True,
                    metrics={
                        "clipped_mean_abs_diff": clipped_mean(list(e), CAP),
                        "tokens": float(n),
                    },
                ),
                CheckResult(
                    name="sampling",
                    passed=True,
                    metrics={"off_replay_tokens": float(rng.binomial(n, BF16_OFF_RATE))},
                ),
            ]
        )
    fitted = propose_evidence(verdicts)
    assert fitted.off_replay == pytest.approx(BF16_OFF_RATE, rel=0.15)
    exact = [
        [
            c
            if c.name == "logprobs"
            else c.model_copy(update={"metrics": {"off_replay_tokens": 0.0}})
            for c in v
        ]
        for v in verdicts
    ]
    assert propose_evidence(exact).off_replay == 0.0
    # Verdicts that never counted (older nodes): no replay test rather than a wrong one.
    assert propose_evidence([v[:1] for v in verdicts]).off_replay is None
