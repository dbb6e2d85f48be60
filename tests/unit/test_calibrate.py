"""`prime-node calibrate` on two different engine configs measures both directions.

A mixed pool's nodes each generate and verify for the other kind, so a calibration for it
(here: torch float32 and torch bfloat16 on the tiny model, a handful of rollouts) splits its
rollouts between the two directions, fits one policy on the pooled verdicts and lists both
engine mixes; with one engine config it lists only the generator's mix.
"""

from __future__ import annotations

import io
import tomllib

from rich.console import Console

from node.calibrate import run_calibration
from node.config import CalibrateConfig, EngineConfig
from protocol.messages import EngineMix, VerificationPolicy

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
