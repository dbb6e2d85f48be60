"""Tools on the trusted side (issue 29, item 3): `trainer.envs.tool_sandbox` bounds a tool
in time and memory, and tool-arithmetic ends an episode whose tool failed with a reward
of 0 and a log line, never the run."""

from __future__ import annotations

import logging
import time

import pytest

from trainer.envs.tool_sandbox import ToolFailed, ToolRunner


def hang(a: int, b: int) -> int:
    time.sleep(60)
    return 0


def hog(a: int, b: int) -> int:
    return len(bytearray(2**31))  # 2 GiB, over the cap


def boom(a: int, b: int) -> int:
    raise ValueError("no such number")


def add(a: int, b: int) -> int:
    return a + b


@pytest.fixture(scope="module")
def runner():
    r = ToolRunner(timeout_s=1.0, memory_mb=256, processes=1)
    yield r
    r.close()


@pytest.mark.parametrize(
    "tool, said",
    [(hang, "did not return within 1 s"), (hog, "out of its memory"), (boom, "ValueError")],
)
def test_a_tool_that_hangs_hogs_or_raises_fails_alone_and_the_next_call_works(runner, tool, said):
    t0 = time.monotonic()
    with pytest.raises(ToolFailed, match=said):
        runner.run(tool, {"a": 1, "b": 2})
    assert time.monotonic() - t0 < 10
    assert runner.run(add, {"a": 1, "b": 2}) == 3


async def test_a_failed_tool_ends_the_episode_with_reward_zero_and_a_log_line(caplog):
    import verifiers as vf

    from trainer.envs.tool_arithmetic import load_environment, reward_sum

    env = load_environment(num_examples=2, tool_timeout_s=1.0)
    call = vf.ToolCall(id="c0", name="add", arguments='{"a": 1, "b": 2}')
    asked = [vf.AssistantMessage(role="assistant", content=None, tool_calls=[call])]
    ok_state: dict = {}
    (answer,) = await env.env_response(asked, ok_state)
    assert answer.content == "3" and not await env.tool_failed(ok_state)

    env.tool_map["add"] = hang
    state: dict = {}
    with caplog.at_level(logging.WARNING, logger="prime.envs"):
        await env.env_response(asked, state)
    assert "a tool failed, the episode ends" in caplog.text
    assert await env.tool_failed(state)
    done = [*asked, answer, {"role": "assistant", "content": "3"}]
    assert reward_sum(done, "3", state) == 0.0
    assert reward_sum(done, "3", ok_state) == 1.0
    assert reward_sum(done[-1:], "3", ok_state) == 0.0  # answered without the tool
