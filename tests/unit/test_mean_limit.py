"""The mean-logprob limit widens for short completions (VerificationPolicy.logprob_mean_limit):
measured on the H200's honest bf16 errors, a length-blind threshold rejects short honest
completions far above the pool's 1e-4 budget; the widened limit does not, and long
completions keep the fitted threshold."""

from __future__ import annotations

import gzip
import json
import math
import statistics
import tomllib
from pathlib import Path

from protocol.messages import VerificationPolicy

ROOT = Path(__file__).resolve().parents[2]
CUDA = ROOT / "configs/verification/smollm2-torch-cuda-bf16.toml"
HONEST = ROOT / "tests/bench/results/trust_stats_h200_smollm2_bf16_honest_seed1.json.gz"


def cuda_policy() -> VerificationPolicy:
    return VerificationPolicy(**tomllib.loads(CUDA.read_text())["verification"])


def test_no_evidence_means_the_fitted_threshold_and_short_ones_are_not_judged():
    p = VerificationPolicy(max_logprob_mean_abs_diff=0.07, logprob_mean_min_tokens=16)
    assert p.logprob_mean_limit(15) == math.inf
    assert p.logprob_mean_limit(16) == p.logprob_mean_limit(4096) == 0.07


# The threshold fitted to the bench's honest means alone (mostly long completions), before
# an RL run's short honest means (up to 0.119 at 16 tokens) were added to the calibration.
BENCH_FITTED = 0.0954


def test_short_completions_get_a_wider_limit_long_ones_the_fitted_one():
    p = cuda_policy()
    assert p.logprob_mean_limit(16) > p.max_logprob_mean_abs_diff
    assert p.logprob_mean_limit(128) == p.max_logprob_mean_abs_diff
    limits = [p.logprob_mean_limit(n) for n in (16, 24, 32, 64)]
    assert limits == sorted(limits, reverse=True)


def test_honest_16_token_windows_on_the_h200_stay_within_budget():
    shipped = cuda_policy()
    p = shipped.model_copy(update={"max_logprob_mean_abs_diff": BENCH_FITTED})
    rollouts = json.loads(gzip.decompress(HONEST.read_bytes()))["strategies"]
    errs = [r["logprob_err"] for s in rollouts.values() for r in s["rollouts"]]
    n = 16
    means = [statistics.fmean(e[i : i + n]) for e in errs for i in range(0, len(e) - n + 1, n)]
    assert len(means) > 15_000
    old = sum(m > p.max_logprob_mean_abs_diff for m in means) / len(means)
    new = sum(m > p.logprob_mean_limit(n) for m in means) / len(means)
    assert old > 3e-4  # the length-blind threshold: 6 in 10,000 (the budget is 1 in 10,000)
    # 2 of 16,754 windows (at exactly the budget 1.7 are expected): consistent with 1e-4,
    # which 16,754 samples cannot pin down more tightly.
    assert new <= 2e-4 and old >= 4 * new
    assert sum(m > shipped.logprob_mean_limit(n) for m in means) <= sum(
        m > p.logprob_mean_limit(n) for m in means
    )
