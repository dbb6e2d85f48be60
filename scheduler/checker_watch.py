"""Each checker's sequential test: how often the other checkers outvote its verdicts.

A verifier, judge or auditor is outvoted when the verdicts of a settled rollout go
against it: its rejection was overturned, or it accepted a rollout two others rejected
(`scheduler.verification`: the roles a decision punishes). Honest checkers are outvoted
at `CheckerPolicy.honest_wrong_rate` (their engines' noise). Reputation alone lets a
checker that is wrong one time in twenty keep its standing (its upheld verdicts earn
more than its overturned ones cost) while every wrong verdict costs the pool a dispute
and, where the judge colludes, an honest generator its reputation. So each checker's
verdicts feed a CUSUM of Bernoulli log-likelihood ratios, honest rate against
`suspect_wrong_rate`, as `protocol.evidence` watches each generator's error scores.

Invariants: a decision about the verdicts is a value (`observe` returns whether this
verdict raised the alarm); an honest checker raises it at most once in about
1 / `false_alarm_rate` verdicts (Lorden's bound for a CUSUM with threshold
log(1 / false_alarm_rate)); every verdict of a checker counts, checked by others or not,
so the rate is per verdict given, as the honest rate is; the statistic never goes below
zero, so credit banked while honest does not hide a turn; after an alarm it starts again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protocol.messages import CheckerPolicy


@dataclass(frozen=True)
class WrongRateTest:
    """The CUSUM's steps and threshold for one pool's `CheckerPolicy`."""

    step_wrong: float
    step_right: float
    threshold: float

    @classmethod
    def of(cls, policy: CheckerPolicy) -> WrongRateTest:
        p0, p1 = policy.honest_wrong_rate, policy.suspect_wrong_rate
        return cls(
            step_wrong=math.log(p1 / p0),
            step_right=math.log((1 - p1) / (1 - p0)),
            threshold=math.log(1 / policy.false_alarm_rate),
        )

    def verdicts_to_alarm(self, wrong_rate: float) -> float:
        """Expected verdicts before the alarm of a checker wrong at `wrong_rate` (inf when
        its statistic drifts down): threshold over drift, Wald's approximation."""
        drift = wrong_rate * self.step_wrong + (1 - wrong_rate) * self.step_right
        return self.threshold / drift if drift > 0 else math.inf


class CheckerWatch:
    """The statistic of every checker, by node id."""

    def __init__(self, policy: CheckerPolicy):
        self.test = WrongRateTest.of(policy)
        self.statistic: dict[str, float] = {}

    def observe(self, node_id: str, wrong: bool) -> bool:
        """One settled verdict of `node_id` (`wrong`: outvoted); True if it raised the alarm
        (the statistic then starts again from zero)."""
        t = self.test
        s = max(0.0, self.statistic.get(node_id, 0.0) + (t.step_wrong if wrong else t.step_right))
        if s >= t.threshold:
            self.statistic.pop(node_id, None)
            return True
        self.statistic[node_id] = s
        return False

    def forget(self, node_id: str) -> None:
        self.statistic.pop(node_id, None)
