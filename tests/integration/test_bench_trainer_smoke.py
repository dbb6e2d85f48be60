"""The trainer MFU benchmark still runs end to end: its --tiny CPU mode (a tiny Qwen2, 2
samples x 128 tokens, 2 timed steps) writes JSON with every variant, and each variant that
ran (the compile ones are skipped on CPU) reports positive tokens/s and MFU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "bench"))


@pytest.mark.timeout(180)
def test_trainer_bench_tiny_mode_produces_its_figures(tmp_path):
    from bench_trainer import VARIANTS

    out = tmp_path / "trainer_tiny"
    subprocess.run(
        [sys.executable, "tests/bench/bench_trainer.py", "--tiny", "--out", str(out)],
        cwd=REPO,
        check=True,
        timeout=170,
        capture_output=True,
    )
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {r["name"]: r for r in report["variants"]}
    assert list(rows) == [v.name for v in VARIANTS]
    ran = [r for r in rows.values() if r["status"] == "ok"]
    assert {"hf_baseline", "trainer_default", "trainer_rows4"} <= {r["name"] for r in ran}
    assert all(r["status"] in ("ok", "skipped") for r in rows.values()), rows
    for r in ran:
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and len(r["step_times_s"]) == 2, r
    # one [2, 128] micro-batch gives the numbers of two [1, 128] ones (same loss, same batch)
    assert rows["trainer_rows4"]["loss"] == pytest.approx(rows["trainer_default"]["loss"], rel=1e-4)
    assert report["meta"]["params"]["tied"] is True
    assert report["best"]["name"] in rows
    assert any("ms" in r for r in report["logprob_micro"])
    assert out.with_suffix(".png").stat().st_size > 5_000
