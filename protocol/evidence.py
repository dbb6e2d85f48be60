"""Per-node evidence: a sequential test over the verification errors of a node's rollouts
(its parameters, `EvidencePolicy`, are part of the pool's verification policy).

One rollout at a time cannot tell honest bf16 noise from cheaper compute (int8 weights,
small weight noise): both stay under any per-rollout threshold an honest pool can afford.
Their errors are systematically larger, though, so the scheduler keeps, per generator, a
one-sided CUSUM over one standardized score per verified rollout, against the honest noise
model of the pool's engine mix (DESIGN.md section 10, "per-node evidence").

The score of a rollout is the mean of its per-token |claimed - recomputed logprob|, each
clipped at `cap` (one wild token cannot decide), over its n tokens. Honest, it has mean
`mu` and variance `between**2 + token**2 / n`: a rollout-to-rollout spread (batch
composition, prompt) plus per-token noise that averages out over long rollouts. With
z = (score - mu) / sd(n), the CUSUM adds the log-likelihood ratio of "shifted by `shift`
standard deviations" against "honest", S = max(0, S + shift * z - shift**2 / 2), and flags
the node when S reaches `threshold`.

Two more tests run beside it, each when the policy asks (`EvidencePolicy.off_replay`,
`floor_watch`):
- the replay test, a Poisson CUSUM over the tokens of each rollout that are not the
  verifier's replayed seeded choice, against the mix's honest rate: on an exact mix every
  such token is a lie, and lies small enough to pass the per-rollout tolerance (a
  near-tie taken the other way) add up across rollouts;
- the floor watch, the same CUSUM as above mirrored: scores that sit systematically
  below honest noise (claims recomputed by a real prefill, in a mix that is noisy).

Invariants (each has a unit test):
- False flags are bounded by the budget: for an honest node S starts a Wald test at every
  rollout, each of which crosses `threshold` with probability at most exp(-threshold), so
  P(flag within `horizon` rollouts) <= horizon * exp(-threshold) = `false_flag_rate` /
  `tests`, and at most `false_flag_rate` over all of the node's tests.
- A node whose scores sit `delta` standard deviations above honest noise is flagged after
  about threshold / (shift * delta - shift**2 / 2) rollouts (`expected_delay`).
- Everything here is pure (no I/O, no clock, no torch): the scheduler's dispatcher feeds
  scores in and acts on the flag (fresh verifiers for the node's recent rollouts, a ban if
  they confirm); calibration fits the model from honest rollouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from protocol.messages import EvidencePolicy


class RolloutScore(NamedTuple):
    """What one verdict says of its rollout, as the tests take it."""

    error: float
    """Clipped mean |logprob error| (nats, at temperature 1)."""
    tokens: int
    off_replay: int | None = None
    """Tokens not the replayed seeded choice (None: the verdict did not count them)."""


def clipped_mean(errors: list[float], cap: float) -> float:
    """The rollout score: mean of per-token absolute errors clipped at `cap`."""
    return sum(min(abs(e), cap) for e in errors) / len(errors) if errors else 0.0


def fit_noise(scores: list[tuple[float, int]], **settings) -> EvidencePolicy:
    """A noise model from honest (score, tokens) pairs: mean, and the variance split into a
    per-rollout part and a 1/n part by least squares on squared deviations (both >= 0)."""
    if len(scores) < 2:
        raise ValueError("fitting honest noise needs at least two rollouts")
    mu = sum(s for s, _ in scores) / len(scores)
    dev = [((s - mu) ** 2, 1.0 / max(n, 1)) for s, n in scores]
    # E[(s - mu)^2] = between^2 + token^2 * (1/n): ordinary least squares on (1/n, dev^2).
    mx = sum(x for _, x in dev) / len(dev)
    my = sum(y for y, _ in dev) / len(dev)
    sxx = sum((x - mx) ** 2 for _, x in dev)
    slope = sum((x - mx) * (y - my) for y, x in dev) / sxx if sxx > 0 else 0.0
    slope = max(slope, 0.0)
    intercept = max(my - slope * mx, 0.0)
    if intercept == 0.0 and slope == 0.0:
        intercept = my
    return EvidencePolicy(mu=mu, between=math.sqrt(intercept), token=math.sqrt(slope), **settings)


def confirm_threshold(policy: EvidencePolicy) -> float:
    """Level the fresh re-verification of a flagged node must reach: an honest node is
    banned only if it is flagged (at most `false_flag_rate`) and its fresh rechecks cross
    this too (at most `false_flag_rate` again, a test started once)."""
    return math.log(1 / policy.false_flag_rate)


# The honest per-token rate the replay test assumes at least: an exact mix's fitted rate
# is 0, and a likelihood ratio against 0 would flag on one token of float noise.
OFF_REPLAY_FLOOR = 1e-6

# What each test flags, as a ban's reason says it.
ABOVE = "errors systematically above honest noise"
BELOW = "errors systematically below the honest floor (claims more exact than the mix)"
REPLAY = "tokens off the seeded choice more often than honest"


def replay_llr(model: EvidencePolicy, off: int, tokens: int) -> float:
    """Log-likelihood ratio of `off` tokens off the seeded choice among `tokens`: the
    honest rate against that rate plus `off_replay_excess` (Poisson counts)."""
    p0 = max(model.off_replay or 0.0, OFF_REPLAY_FLOOR)
    p1 = p0 + model.off_replay_excess
    return off * math.log(p1 / p0) - tokens * (p1 - p0)


@dataclass
class NodeEvidence:
    """The running tests of one node: `statistic` (errors above noise), `below` (errors
    below the floor) and `replay` (tokens off the seeded choice)."""

    statistic: float = 0.0
    below: float = 0.0
    replay: float = 0.0
    rollouts: int = 0
    peak: float = 0.0
    """The highest any of the tests has been."""
    flagged_at: int | None = None
    """Rollout count at which the node was first flagged (None: never)."""
    flagged_by: str | None = None
    """What the test that flagged it watches (`ABOVE`, `BELOW`, `REPLAY`)."""

    def add(
        self, model: EvidencePolicy, score: float, tokens: int, off_replay: int | None = None
    ) -> bool:
        """Take one verified rollout's score (and the count of its tokens off the seeded
        choice, where its verdict has one); True when the node is (now or already) flagged."""
        z, k = model.z(score, tokens), model.shift
        self.statistic = max(0.0, self.statistic + k * z - k**2 / 2)
        if model.floor_watch:
            self.below = max(0.0, self.below - k * z - k**2 / 2)
        if model.off_replay is not None and off_replay is not None:
            self.replay = max(0.0, self.replay + replay_llr(model, off_replay, tokens))
        self.rollouts += 1
        level, why = max((self.statistic, ABOVE), (self.below, BELOW), (self.replay, REPLAY))
        self.peak = max(self.peak, level)
        if self.flagged_at is None and level >= model.threshold:
            self.flagged_at, self.flagged_by = self.rollouts, why
        return self.flagged_at is not None
