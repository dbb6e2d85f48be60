"""`prime-node calibrate` on two different engine configs measures both directions.

A mixed pool's nodes each generate and verify for the other kind, so a calibration for it
(here: torch float32 and torch bfloat16 on the tiny model, a handful of rollouts) splits its
rollouts between the two directions, fits one policy on the pooled verdicts and lists both
engine mixes; with one engine config it lists only the generator's mix. It says whether
the mix is exact (issue 27's definition), and an exact one gets the exact tier.
"""

from __future__ import annotations

import io
import tomllib

from rich.console import Console

from node.calibrate import run_calibration
from node.config import CalibrateConfig, EngineConfig
from protocol.messages import CheckResult, EngineMix, VerificationPolicy
from verifier.calibration import collect, exactness, propose, propose_exact, summarize

FP32 = EngineConfig(kind="torch", model="tiny", device="cpu", dtype="float32")
BF16 = EngineConfig(kind="torch", model="tiny", device="cpu", dtype="bfloat16")


def calibrate(tmp_path, **kw) -> tuple[str, VerificationPolicy]:
    out = tmp_path / "cal.toml"
    cfg = CalibrateConfig(
        rollouts=6, batch_size=3, verify_batch_size=2, max_tokens=12, out=out, **kw
    )
    run_calibration(cfg, Console(file=io.StringIO()))
    text = out.read_text()
    policy = VerificationPolicy(**tomllib.loads(text)["verification"])
    return text, policy


def test_two_engine_configs_calibrate_both_directions(tmp_path):
    text, policy = calibrate(tmp_path, generator=FP32, verifier=BF16)
    fp32 = EngineMix(engine="torch", dtype="float32", device="cpu")
    bf16 = EngineMix(engine="torch", dtype="bfloat16", device="cpu")
    assert policy.engine_mixes == [fp32, bf16]
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert "both directions" in header[0]
    assert (
        "3 rollouts generated on torch/float32/cpu and verified on torch/bfloat16/cpu" in header[0]
    )
    assert "3 generated on torch/bfloat16/cpu and verified on torch/float32/cpu" in header[0]
    assert header[1].startswith("# 6 honest rollouts")
    assert "#   torch/float32/cpu -> torch/bfloat16/cpu:" in header
    assert "#   torch/bfloat16/cpu -> torch/float32/cpu:" in header
    assert policy.evidence is not None


def test_one_engine_config_lists_only_its_mix(tmp_path):
    text, policy = calibrate(tmp_path, generator=FP32)
    assert policy.engine_mixes == [EngineMix(engine="torch", dtype="float32", device="cpu")]
    first = text.splitlines()[0]
    assert first == (
        "# prime-node calibrate: generated on torch/float32/cpu, verified on torch/float32/cpu, "
        "model tiny"
    )
    assert "->" not in text


def test_calibration_says_whether_the_mix_is_exact(tmp_path):
    """A handful of fp32 rollouts: no token off the replay, but too few to prove the mix
    exact; fp32 against bf16 is not exact (their logprobs differ far above float noise)."""
    fp32_text, fp32 = calibrate(tmp_path / "a", generator=FP32)
    assert "# The mix is not proven exact (" in fp32_text
    assert "0 off the replayed seeded choice" in fp32_text and "it takes 100,000" in fp32_text
    mixed_text, _ = calibrate(tmp_path / "b", generator=FP32, verifier=BF16)
    assert "# The mix is not exact (" in mixed_text


def _verdict(tokens: int, off: int, err: float, gap: float = 0.0) -> list[CheckResult]:
    return [
        CheckResult(
            name="logprobs",
            passed=True,
            metrics={"tokens": float(tokens), "max_abs_diff": err, "mean_abs_diff": err / 2},
        ),
        CheckResult(
            name="sampling",
            passed=True,
            metrics={"off_replay_tokens": float(off), "max_score_gap": gap},
        ),
    ]


def test_an_exact_mix_gets_the_exact_tier_and_a_noisy_one_does_not():
    exact = [_verdict(1_000, 0, 4e-6) for _ in range(100)]  # 100,000 tokens at float noise
    assert exactness(exact).exact
    assert not exactness(exact[:99]).exact  # 99,000 tokens: not proven
    assert not exactness([*exact, _verdict(100, 1, 4e-6, gap=0.02)]).exact
    assert not exactness([*exact, _verdict(100, 0, 0.05)]).exact
    stats = summarize(collect(exact))
    tier = propose_exact(stats, propose(stats))
    assert (tier.sampling_tolerance, tier.max_sampling_mismatch_fraction) == (1e-3, 0.0)
    assert tier.max_logprob_abs_diff == tier.max_logprob_mean_abs_diff == 1e-3
    # Never below the worst honest value measured.
    worse = [*exact[:-1], _verdict(1_000, 0, 2.5e-3)]
    assert propose_exact(summarize(collect(worse)), propose(stats)).max_logprob_abs_diff == 2.5e-3
