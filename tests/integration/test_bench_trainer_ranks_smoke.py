"""The trainer scaling benchmark still runs end to end: its --tiny CPU mode launches the
real trainer under torchrun on 1 and then 2 gloo ranks (FSDP2 on 2), and reports positive
tokens/s and scaling efficiency for both. Both runs start from the same weights and train
the same global batch, so their first-step loss is the same: if the ranks trained
different batches (or one rank all of it twice) the numbers would differ and this fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_trainer_ranks_bench_tiny_mode_scales_the_same_batch(tmp_path):
    out = tmp_path / "trainer_ranks_tiny"
    proc = subprocess.run(
        [sys.executable, "tests/bench/bench_trainer_ranks.py", "--tiny", "--out", str(out)],
        cwd=REPO,
        timeout=220,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["meta"]["smoke_only"] is True
    rows = {r["ranks"]: r for r in report["runs"]}
    assert sorted(rows) == [1, 2]
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["tokens_per_s"] > 0 and r["efficiency"] > 0 and r["mfu"] > 0, r
        assert len(r["step_times_s"]) == 2 and len(r["per_rank"]) == r["ranks"], r
        assert r["tokens_per_step"] == report["meta"]["global_tokens_per_step"], r
    assert rows[1]["fsdp_applied"] is False and rows[2]["fsdp_applied"] is True
    assert rows[2]["backend"] == "gloo"
    # each of the 2 ranks trains half of the global batch's micro-batches
    assert [p["micro_batches"] for p in rows[2]["per_rank"]] == [
        rows[1]["per_rank"][0]["micro_batches"] // 2
    ] * 2
    # same weights, same global batch, fp32 on CPU: the same first step
    assert rows[2]["first_loss"] == pytest.approx(rows[1]["first_loss"], rel=1e-4)
    assert rows[2]["first_grad_norm"] == pytest.approx(rows[1]["first_grad_norm"], rel=1e-4)
    assert out.with_suffix(".png").stat().st_size > 5_000
