"""The delta benchmark still runs end to end in its quick mode (tiny model, 3 RL steps per
learning rate through a real SwarmTransport, 2 capped `prime-node fetch` peers for the
full version and for the delta): the JSON has every lr's per-step numbers and summary,
the side by side completed both broadcasts, and the version rebuilt from the fetched
delta is byte-identical to the trainer's and matches its signed full manifest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LRS = [1e-6, 1e-5, 5e-4]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_delta_bench_quick_rebuilds_the_version_byte_for_byte(tmp_path):
    out = tmp_path / "delta_quick"
    proc = subprocess.run(
        [sys.executable, "tests/bench/bench_delta.py", "--quick", "--out", str(out)],
        cwd=REPO,
        timeout=230,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    settings = result["settings"]
    assert settings["quick"] and settings["model"] == "tiny" and settings["steps"] == 3
    assert settings["weights"]["dtype"] == "bfloat16" and settings["weights"]["deltas"]

    runs = {r["lr"]: r for r in result["runs"]}
    assert sorted(runs) == LRS
    for lr, run in runs.items():
        assert [r["step"] for r in run["steps"]] == [1, 2, 3], lr
        for r in run["steps"]:
            assert r["full_bytes"] > 0 and r["delta_bytes"] > 0, (lr, r)
            assert r["delta_over_full"] == pytest.approx(r["delta_bytes"] / r["full_bytes"])
            assert 0 <= r["changed_fraction"] <= 1 and r["elements"] > 0, (lr, r)
            assert r["publish_s"] > 0 and r["save_s"] >= r["publish_s"], (lr, r)
            assert r["shipped_over_full"] == (r["delta_over_full"] if r["delta_published"] else 1)
        s = run["summary"]
        assert s["min_delta_over_full"] <= s["median_delta_over_full"] <= s["max_delta_over_full"]
        for key in ("median_changed_fraction", "median_publish_s", "amortised_with_keyframes"):
            assert key in s, (lr, key)
    # A larger lr moves more bf16 elements (Adam: each step is about lr per element).
    changed = [runs[lr]["summary"]["median_changed_fraction"] for lr in LRS]
    assert changed[0] < changed[1] < changed[2], changed

    sbs = result["side_by_side"]
    assert sbs["lr"] == 1e-6 and sbs["step"] == 2 and sbs["fetchers"] == 2
    full, delta = sbs["full"], sbs["delta"]
    assert full["ok"], full["reason"]
    assert delta["ok"], delta["reason"]
    assert full["all_identical"] and full["identical"] == [True, True]
    assert delta["rebuilt_identical"] == [True, True]
    assert delta["rebuilt_manifest_matches"] == [True, True]
    assert full["bad_pieces"] == 0 and delta["bad_pieces"] == 0
    assert delta["size_bytes"] < full["size_bytes"]
    assert full["last_done_s"] > 0 and delta["hold_s"] >= delta["last_done_s"] > 0
    assert len(delta["apply_verify_s"]) == 2
    assert result["checks"] == dict.fromkeys(result["checks"], True) and len(result["checks"]) == 7
    target = result["targets"]["delta_over_full_at_1e-6"]
    assert target["limit"] == 0.05 and isinstance(target["met"], bool)
    assert out.with_suffix(".png").stat().st_size > 10_000
