"""Statistics of honest verification errors, and thresholds proposed from them.

Input: the metrics of verdicts on honest rollouts, checked with no thresholds at all.
Output: per metric the median, 99th percentile and maximum, and a `VerificationPolicy`
whose thresholds sit above the worst honest value by a margin (so an honest node is not
rejected) while staying far below what tampering produces.

Invariant: proposed thresholds are never below the worst honest value measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protocol.messages import CheckResult, VerificationPolicy

# metric name in CheckResult.metrics -> (check name, policy field, margin factor, floor)
_FIELDS = {
    "exp_mismatches": ("proof", "max_exp_mismatches", 2.0, 4),
    "mant_err_mean": ("proof", "max_mant_err_mean", 2.0, 1.0),
    "mant_err_median": ("proof", "max_mant_err_median", 2.0, 1.0),
    "max_abs_diff": ("logprobs", "max_logprob_abs_diff", 3.0, 0.01),
    "mean_abs_diff": ("logprobs", "max_logprob_mean_abs_diff", 3.0, 0.002),
    "max_score_gap": ("sampling", "sampling_tolerance", 3.0, 0.001),
    "mismatch_fraction": ("sampling", "max_sampling_mismatch_fraction", 2.0, 0.0),
}

# Upper bounds: a threshold above these would let tampering through (see tests/bench).
_CAPS = {
    "max_exp_mismatches": 64,
    "max_mant_err_mean": 16.0,
    "max_mant_err_median": 16.0,
    "max_logprob_abs_diff": 1.0,
    "max_logprob_mean_abs_diff": 0.1,
    "sampling_tolerance": 0.5,
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


@dataclass
class MetricStats:
    name: str
    median: float
    p99: float
    maximum: float


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def collect(verdict_checks: list[list[CheckResult]]) -> dict[str, list[float]]:
    """Metric name -> values over all verdicts."""
    out: dict[str, list[float]] = {k: [] for k in _FIELDS}
    for checks in verdict_checks:
        for c in checks:
            for k, v in c.metrics.items():
                if k in out and _FIELDS[k][0] == c.name:
                    out[k].append(v)
    return out


def summarize(values: dict[str, list[float]]) -> list[MetricStats]:
    return [
        MetricStats(k, _quantile(v, 0.5), _quantile(v, 0.99), max(v))
        for k, v in values.items()
        if v
    ]


def propose(stats: list[MetricStats], base: VerificationPolicy | None = None) -> VerificationPolicy:
    """Thresholds = max(worst honest value x margin, floor), capped where tampering starts."""
    fields = dict((base or VerificationPolicy()).model_dump())
    for s in stats:
        _, field, margin, floor = _FIELDS[s.name]
        value = max(s.maximum * margin, floor)
        value = max(min(value, _CAPS[field]), s.maximum)
        fields[field] = math.ceil(value) if field == "max_exp_mismatches" else round(value, 4)
    return VerificationPolicy(**fields)
