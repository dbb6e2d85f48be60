"""The OpenAI front benchmark still runs end to end on this checkout (`--quick`: a pool of
two tiny `prime-node join` workers behind a scheduler, one standalone `prime-node serve`,
four calls per path): the JSON holds one run with both paths, their latencies and the
ratio of medians through / direct, and the PNG is drawn."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_openai_front_bench_quick_run_measures_both_paths(tmp_path):
    out = tmp_path / "front"
    proc = subprocess.run(
        [sys.executable, "tests/bench/bench_openai_front.py", "--quick", "--out", str(out)],
        cwd=REPO,
        timeout=280,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["bench"] == "openai_front"
    assert list(report["runs"]) == ["after"]  # this checkout has the signed front
    run = report["runs"]["after"]
    assert run["code"]["signed_front"] is True
    assert set(run["paths"]) == {"direct", "through"}
    for name, path in run["paths"].items():
        assert len(path["latencies_s"]) == run["settings"]["n"] == 4, name
        assert 0 < path["min_s"] <= path["median_s"] <= path["max_s"], (name, path)
    ratio = run["ratio_through_over_direct"]
    assert ratio == pytest.approx(
        run["paths"]["through"]["median_s"] / run["paths"]["direct"]["median_s"]
    )
    assert ratio > 0
    # The answer through the pool is the verified one, as long as the direct one.
    assert run["first_answer"]["through"]["verified"] is True
    assert run["first_answer"]["through"]["completion_tokens"] == 8
    assert run["first_answer"]["direct"]["completion_tokens"] == 8
    assert report["comparison"] is None  # one run only
    assert out.with_suffix(".png").stat().st_size > 10_000
