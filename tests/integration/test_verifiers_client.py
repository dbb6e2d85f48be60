"""The verifiers library (the trainer's environment layer) runs against a worker unchanged
and gets the token-level data training needs: prompt/completion ids and logprobs.

verifiers fails silently when a server omits token ids (the reward is still computed,
`tokens` is None), so this asserts on them explicitly."""

from __future__ import annotations

import asyncio

import pytest
import verifiers as vf
from datasets import Dataset

from tests.nodes import start_node


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    n = start_node(tmp_path_factory.mktemp("vf"), "n", "--engine.model", "tiny")
    yield n
    n.stop()


def test_single_turn_env_collects_token_ids_and_logprobs(node, monkeypatch):
    monkeypatch.setenv("PRIME_TEST_API_KEY", "unused")
    ds = Dataset.from_list([{"question": q, "answer": q[::-1]} for q in ("abc", "swarm", "node")])

    def reversed_text(completion, answer, **_) -> float:
        return float(bool(completion) and answer in completion[-1]["content"])

    env = vf.SingleTurnEnv(dataset=ds, rubric=vf.Rubric(funcs=[reversed_text]))
    out = asyncio.run(
        env.evaluate(
            client=vf.ClientConfig(api_base_url=f"{node.url}/v1", api_key_var="PRIME_TEST_API_KEY"),
            model="tiny",
            sampling_args={
                "logprobs": True,
                "max_tokens": 16,
                "temperature": 1.0,
                "extra_body": {"return_token_ids": True, "ignore_eos": True},
            },
            num_examples=3,
            rollouts_per_example=2,
            state_columns=["trajectory"],
        )
    )
    outputs = out["outputs"]
    assert len(outputs) == 6
    for o in outputs:
        assert not o["error"], o["error"]
        tokens = o["trajectory"][0]["tokens"]
        assert tokens is not None, "server answer lacked token ids: verifiers dropped them silently"
        assert tokens["prompt_ids"] and len(tokens["completion_ids"]) == 16
        assert len(tokens["completion_logprobs"]) == 16 and all(
            lp <= 0 for lp in tokens["completion_logprobs"]
        )
