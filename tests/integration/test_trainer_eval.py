"""`prime-trainer eval`: the mean reward of whatever serves an OpenAI-compatible endpoint
(here one worker on the tiny model), written to `<run_dir>/eval.json`."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.nodes import REPO, start_node


def test_eval_reports_the_mean_reward_of_an_endpoint(tmp_path):
    node = start_node(tmp_path, "n", "--engine.model", "tiny")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "trainer.cli", "eval", "--base-url", f"{node.url}/v1",
             "--model-name", "tiny", "--num-examples", "4", "--rollouts-per-example", "2",
             "--sampling.max-tokens", "8", "--run-dir", str(tmp_path / "eval")],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        node.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["episodes"] == 8
    # A random tiny model reverses nothing exactly; what is printed is what is saved.
    assert result["reward_mean"] < 1.0
    assert f"mean reward {result['reward_mean']:.3f} over 8 episodes" in out.stderr
