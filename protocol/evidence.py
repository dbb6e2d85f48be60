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

Invariants (each has a unit test):
- False flags are bounded by the budget: for an honest node S starts a Wald test at every
  rollout, each of which crosses `threshold` with probability at most exp(-threshold), so
  P(flag within `horizon` rollouts) <= horizon * exp(-threshold) = `false_flag_rate`.
- A node whose scores sit `delta` standard deviations above honest noise is flagged after
  about threshold / (shift * delta - shift**2 / 2) rollouts (`expected_delay`).
- Everything here is pure (no I/O, no clock, no torch): the scheduler's dispatcher feeds
  scores in and acts on the flag (fresh verifiers for the node's recent rollouts, a ban if
  they confirm); calibration fits the model from honest rollouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protocol.messages import EvidencePolicy


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


@dataclass
class NodeEvidence:
    """The running test of one node."""

    statistic: float = 0.0
    rollouts: int = 0
    peak: float = 0.0
    flagged_at: int | None = None
    """Rollout count at which the node was first flagged (None: never)."""

    def add(self, model: EvidencePolicy, score: float, tokens: int) -> bool:
        """Take one verified rollout's score; True when the node is (now or already) flagged."""
        z = model.z(score, tokens)
        self.statistic = max(0.0, self.statistic + model.shift * z - model.shift**2 / 2)
        self.rollouts += 1
        self.peak = max(self.peak, self.statistic)
        if self.flagged_at is None and self.statistic >= model.threshold:
            self.flagged_at = self.rollouts
        return self.flagged_at is not None
