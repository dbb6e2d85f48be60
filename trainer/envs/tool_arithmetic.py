"""tool-arithmetic: add integers with a calculator tool that runs on the trusted side
(issue 29: agentic RL through an untrusted pool).

The model is asked for the sum of `terms` integers and offered one tool, `add(a, b)`. An
episode: the model calls `add` (one call per turn; `terms - 1` of them chain the partial
sums), the environment runs each call in a bounded worker process
(`trainer.envs.tool_sandbox`) and answers with the result, and the model's last turn
answers with the sum. Every assistant turn is its own rollout through the pool, its
request carrying the whole conversation so far (tools, calls, results), written by the
trusted side in `protocol.tools`' format.

Reward, computed here from the conversation: 0 unless the model called the tool (a call
the trusted side parsed); then the LCS ratio of the final answer and the sum (1.0 only
for the exact sum; partial credit for near misses). A tool that raises,
runs past its time or over its memory ends the episode with a reward of 0 and a log
line. Data are generated from a seed; `sft_examples` gives the warm-up transcripts (one
example per assistant turn, in the same format) from another seed range.
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any

from protocol.openai import ChatMessage, conversation
from protocol.tools import ToolDef, call_text
from trainer.envs.reverse_text import lcs_ratio
from trainer.envs.tool_sandbox import ToolFailed, ToolRunner

log = logging.getLogger("prime.envs")

SYSTEM_PROMPT = "Add with the add tool, then answer with the sum."


def add(a: int, b: int) -> int:
    """Add two integers."""
    return int(a) + int(b)


def problems(num: int, seed: int, terms: int, max_value: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(1, max_value) for _ in range(terms)] for _ in range(num)]


def question(numbers: list[int]) -> str:
    return "What is " + " + ".join(map(str, numbers)) + "?"


def final_answer(completion: Any) -> str:
    # Not trainer.rollouts.scored_text: that module imports torch, and this one is
    # imported by every tool worker (to unpickle `add`) under its memory cap.
    for m in reversed(completion or []):
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", "")
        if role == "assistant":
            content = m.get("content") if isinstance(m, dict) else getattr(m, "content", "")
            return (content if isinstance(content, str) else "").strip()
    return ""


def called_a_tool(completion: Any) -> bool:
    for m in completion or []:
        calls = m.get("tool_calls") if isinstance(m, dict) else getattr(m, "tool_calls", None)
        if calls:
            return True
    return False


def reward_sum(completion, answer: str, state, **_) -> float:
    """0 if a tool failed or none was called (the task is to add with the tool); else the
    LCS ratio of the final answer and the sum."""
    if state.get("tool_failed") or not called_a_tool(completion):
        return 0.0
    return lcs_ratio(final_answer(completion), answer)


def load_environment(
    num_examples: int = 1000,
    seed: int = 0,
    terms: int = 2,
    max_value: int = 99,
    tool_timeout_s: float = 5.0,
    tool_memory_mb: int = 512,
):
    import asyncio

    import verifiers as vf
    from datasets import Dataset

    if terms < 2:
        raise ValueError("tool-arithmetic needs terms >= 2 (a sum of one number calls no tool)")
    runner = ToolRunner(tool_timeout_s, tool_memory_mb)

    class ToolArithmetic(vf.ToolEnv):
        """`vf.ToolEnv` whose calls run bounded in `runner` and whose failed call ends the
        episode (reward 0)."""

        async def call_tool(self, tool_name, tool_args, tool_call_id, **kwargs):
            result = await asyncio.to_thread(runner.run, self.tool_map[tool_name], tool_args)
            return vf.ToolMessage(role="tool", content=str(result), tool_call_id=tool_call_id)

        async def env_response(self, messages, state, **kwargs):
            try:
                return await super().env_response(messages, state, **kwargs)
            except vf.ToolCallError as exc:
                reason = str(exc.__cause__ or exc)
                log.warning("tool-arithmetic: a tool failed, the episode ends: %s", reason)
                state["tool_failed"] = reason
                last = messages[-1].tool_calls[0].id
                return [vf.ToolMessage(role="tool", content="error", tool_call_id=last)]

        @vf.stop
        async def tool_failed(self, state) -> bool:
            return bool(state.get("tool_failed"))

    rows = [
        {"question": question(n), "answer": str(sum(n))}
        for n in problems(num_examples, seed, terms, max_value)
    ]
    return ToolArithmetic(
        dataset=Dataset.from_list(rows),
        system_prompt=SYSTEM_PROMPT,
        tools=[add],
        max_turns=terms + 1,
        stop_errors=[ToolFailed],
        rubric=vf.Rubric(funcs=[reward_sum]),
    )


def tool_defs() -> list[ToolDef]:
    """The tools as a request carries them (what verifiers' client sends for `add`)."""
    from verifiers.legacy.utils.tool_utils import convert_func_to_tool_def

    from trainer.envs import request_tools

    return request_tools([convert_func_to_tool_def(add)])


def transcript(numbers: list[int]) -> list[tuple[list[dict], str]]:
    """The ideal episode for `numbers`, one (prompt messages, assistant text) per turn, the
    prompt written as the trusted side writes a request's conversation."""
    tools = tool_defs()
    messages = [
        ChatMessage(role="system", content=SYSTEM_PROMPT),
        ChatMessage(role="user", content=question(numbers)),
    ]
    turns = []
    total = numbers[0]
    for k, b in enumerate(numbers[1:]):
        args = json.dumps({"a": total, "b": b})
        turns.append((conversation(messages, tools), call_text("add", args)))
        call = {"id": f"c{k}", "type": "function", "function": {"name": "add", "arguments": args}}
        messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        total += b
        messages.append(ChatMessage(role="tool", tool_call_id=f"c{k}", content=str(total)))
    turns.append((conversation(messages, tools), str(total)))
    return turns


def sft_examples(
    num_examples: int, seed: int, terms: int = 2, max_value: int = 99, **_
) -> list[dict]:
    """One example per assistant turn of ideal episodes, from a seed range the RL data
    never use (each turn is one sample in RL too)."""
    out = []
    for numbers in problems(num_examples, seed + 1_000_003, terms, max_value):
        for prompt, text in transcript(numbers):
            out.append({"prompt": prompt, "completion": [{"role": "assistant", "content": text}]})
    return out[:num_examples]
