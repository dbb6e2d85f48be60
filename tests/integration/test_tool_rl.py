"""Agentic RL through an untrusted pool (issue 29), on this CPU box: the tiny model, warmed
up on tool-call transcripts (`configs/rl/sft-tool-arithmetic-tiny.toml`), learns
tool-arithmetic (add two numbers with the `add` tool, which runs on the trusted side)
through a real pool of `prime-node join` workers, one of which forges the tool calls a
client reads. Asserts what a researcher would check: the reward rises clearly; episodes
have several turns and call the tool; every trained token of every turn is the signed
rollout the scheduler released for it (the fault audit, calls read by the trusted side);
no tool output carries loss; the forger is banned and nothing it made is trained. And a
verifiers `ToolEnv` written as its documentation shows, with no project code, runs
through the pool unchanged."""

from __future__ import annotations

import json

import pytest
import torch

from tests.rl_runs import (
    TOOL_RL_ARGS,
    RunFailed,
    check_finished,
    reward_trend,
    rl_args,
    serving_pool,
    summarize,
    trainer_cli,
)
from tests.swarm.harness import audit
from trainer.batch import batch_path
from trainer.monitor import read_metrics
from verifier.models import load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    run = tmp_path_factory.mktemp("sft-tools")
    out = trainer_cli(
        "sft", "@", "configs/rl/sft-tool-arithmetic-tiny.toml", "--run-dir", str(run),
        "--monitor.progress", "false",
    )  # fmt: skip
    if out.returncode:
        raise RunFailed(out.stderr[-3000:])
    sft = read_metrics(run, "sft")
    assert sft[-1]["loss"] < sft[0]["loss"] / 4, "the tool warm-up did not learn"
    return run / "final"


def test_tool_rl_through_a_pool_with_a_call_forger(tmp_path, tool_model):
    steps = 24
    with serving_pool(tmp_path, tool_model, workers=4, dishonest=["forged-tool-call"]) as pool:
        run = tmp_path / "run"
        args = rl_args(pool, tool_model, run, *TOOL_RL_ARGS, "--max-steps", str(steps))
        check_finished(trainer_cli(*args, timeout=1200), run)
        forger = pool.node_id("d0")
        honest = {pool.node_id(f"w{i}") for i in range(3)}
        db = pool.db_url.split(":///", 1)[1]
        from trainer.config import EnvConfig
        from trainer.envs import load_environment, tool_context

        tools = tool_context(load_environment(EnvConfig(id="tool-arithmetic")))
        audited = audit(run, db, steps, tool_model, {forger: 0}, set(), honest, tools=tools)
    made = read_metrics(run, "orchestrator")
    s = summarize(run)
    figures = {
        **{k: round(v, 4) for k, v in s.items()},
        "turns_per_episode": sum(r["turns_per_episode"] for r in made) / len(made),
        "tool_calls_per_episode": sum(r["tool_calls_per_episode"] for r in made) / len(made),
        "tool_calls_invalid_share": sum(r["tool_calls_invalid_share"] for r in made) / len(made),
        "audit": audited,
    }
    print("\ntool RL run:", json.dumps(figures))
    # The reward rises clearly: a line through every step rises beyond twice its error.
    rise, se = reward_trend(run)
    assert rise > max(0.03, 2 * se), (rise, se, figures)
    assert figures["turns_per_episode"] > 1.5 and figures["tool_calls_per_episode"] > 0.5
    # Tool outputs are context, never loss: no trained (loss) token is inside a tool
    # response, and second turns hold one in their prompt.
    tok = load_tokenizer(tool_model)
    responses = 0
    for n in range(1, steps + 1):
        for smp in torch.load(batch_path(run, n), weights_only=True)["samples"]:
            trained = [t for t, m in zip(smp["input_ids"], smp["loss_mask"], strict=True) if m]
            assert "<tool_response>" not in tok.decode(trained)
            responses += "<tool_response>" in tok.decode(smp["input_ids"])
    assert responses > 0
    assert audited["banned"] == 1


def test_a_verifiers_tool_env_nobody_here_wrote_runs_through_the_pool(tmp_path, tool_model):
    """`tests.envs.vf_docs_tool_env`: a `vf.ToolEnv` as verifiers' documentation writes one
    (a Python function as the tool, its own rubric), named by 'module:function'."""
    with serving_pool(tmp_path, tool_model, workers=3) as pool:
        run = tmp_path / "run"
        args = rl_args(
            pool, tool_model, run, *TOOL_RL_ARGS, "--max-steps", "2", "--batch-size", "16",
            "--group-size", "4", "--orchestrator.env.id", "tests.envs.vf_docs_tool_env:load_environment",
            "--orchestrator.env.args", "{}",
        )  # fmt: skip
        check_finished(trainer_cli(*args, timeout=600), run)
    made = read_metrics(run, "orchestrator")
    assert [r["step"] for r in made] == [1, 2]
    assert sum(r["episodes"] for r in made) > 0
    assert all(r.get("dropped_mismatch", 0) == 0 for r in made), made
