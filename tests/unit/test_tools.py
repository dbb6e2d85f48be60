"""Tool calls on the OpenAI surface (`protocol.tools`, `protocol.openai`): what a request's
tools put in front of the model, what a completion's text gives back, and that the
official `openai` client reads it, whole and streamed."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from protocol.messages import ProofParams, Rollout, SamplingParams
from protocol.openai import ChatCompletionRequest, render, stream_chunks
from protocol.tools import CALL_OPEN, INVALID, ToolContext, parse

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}
CTX = ToolContext(frozenset({"add"}))


def call(body: str) -> str:
    return f"{CALL_OPEN}\n{body}\n</tool_call>"


def test_well_formed_calls_come_back_as_tool_calls_with_ids_from_the_rollout():
    text = (
        "Let me add.\n"
        + call('{"name": "add", "arguments": {"a": 1}}')
        + call('{"name": "add", "arguments": "{\\"a\\": 2}"}')
    )
    content, calls, finish = parse(text, CTX, "r7")
    assert content == "Let me add."
    assert finish == "tool_calls"
    assert [c["id"] for c in calls] == ["call_r7_0", "call_r7_1"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1}, {"a": 2}]


@pytest.mark.parametrize(
    "text",
    [
        call('{"name": "add", "arguments": {"a": 1'),  # arguments not valid JSON
        call('{"name": "mul", "arguments": {}}'),  # a function the request did not give
        call('{"name": "add", "arguments": "a=1"}'),  # string arguments that are not JSON
        call('["add"]'),
        CALL_OPEN + '\n{"name": "add", "arguments": {}}',  # never closed (length)
        call('{"name": "add", "arguments": {}}') + CALL_OPEN,
    ],
)
def test_a_malformed_call_comes_back_as_the_model_wrote_it_with_an_error_that_says_so(text):
    assert parse(text, CTX, "r") == (text, [], INVALID)
    answer = render("chat", [_rollout(list(range(len(text))))], lambda xs: text[: len(xs)],
                    lambda i: text[i], "m", False, tools=CTX)  # fmt: skip
    (c,) = ChatCompletion.model_validate(answer).choices  # the official client's types
    assert c.message.content == text and not c.message.tool_calls
    assert c.finish_reason == "stop" and "not a JSON object" in c.model_extra["tool_call_error"]
    chunks = [ChatCompletionChunk.model_validate(x) for x in stream_chunks(answer, None, False)]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_text_without_a_call_is_an_ordinary_answer():
    assert parse("just text", CTX, "r") == ("just text", [], None)


def test_the_prefill_of_a_named_choice_is_part_of_what_is_parsed():
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "1+2?"}],
            "tools": [ADD],
            "tool_choice": {"type": "function", "function": {"name": "add"}},
        }
    )
    ctx = body.tool_context()
    assert ctx.prefill.endswith('{"name": "add", "arguments": ')
    content, calls, finish = parse('{"a": 3}}\n</tool_call>', ctx, "r")
    assert (content, finish) == (None, "tool_calls")
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 3}'}


def test_tools_calls_and_results_are_written_into_the_conversation():
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "1+2?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "add", "arguments": '{"a": 1}'},
                        }
                    ],
                },  # fmt: skip
                {"role": "tool", "tool_call_id": "c1", "content": "3"},
            ],
            "tools": [ADD],
        }
    )
    conv = body.conversation()
    assert [m["role"] for m in conv] == ["system", "user", "assistant", "user"]
    assert conv[0]["content"].startswith("Be brief.") and '"name": "add"' in conv[0]["content"]
    assert conv[2]["content"] == call('{"name": "add", "arguments": {"a": 1}}')
    assert conv[3]["content"] == "<tool_response>\n3\n</tool_response>"
    none = body.model_copy(update={"tool_choice": "none"})
    assert none.tool_context() is None and '"name": "add"' not in none.conversation()[0]["content"]


@pytest.mark.parametrize(
    "change, said",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "mul"}}}, "not in tools"),
        ({"tool_choice": "required", "tools": None}, "no tools"),
        ({"messages": [{"role": "tool", "tool_call_id": "x", "content": "3"}]}, "matches none"),
        ({"tools": [ADD, ADD]}, "same name"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "name"),
    ],
)
def test_tool_requests_that_cannot_be_honoured_are_refused(change, said):
    data = {"messages": [{"role": "user", "content": "hi"}], "tools": [ADD]} | change
    with pytest.raises(ValidationError, match=said):
        ChatCompletionRequest.model_validate(data)


def _rollout(text_ids: list[int]) -> Rollout:
    return Rollout(
        request_id="r1",
        node_id="n",
        prompt_ids=[1, 2],
        completion_ids=text_ids,
        logprobs=[-0.5] * len(text_ids),
        sampling=SamplingParams(max_tokens=256),
        seed=1,
        weights_version=0,
        weights_hash="h",
        finish_reason="stop",
        proof=[b"p"] * -(-len(text_ids) // ProofParams().chunk_tokens),
    )


def test_the_openai_client_reads_the_calls_whole_and_streamed():
    text = "ok " + call('{"name": "add", "arguments": {"a": 1}}')
    ids = list(range(len(text)))
    decode = lambda xs: text[: len(xs)]  # noqa: E731 - one character per id
    answer = render("chat", [_rollout(ids)], decode, lambda i: text[i], "m", True, tools=CTX)
    whole = ChatCompletion.model_validate(answer)
    (c,) = whole.choices
    assert c.finish_reason == "tool_calls" and c.message.content == "ok"
    assert c.message.tool_calls[0].function.name == "add"
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"a": 1}
    chunks = [ChatCompletionChunk.model_validate(x) for x in stream_chunks(answer, decode, True)]
    calls: dict[int, dict] = {}
    for ch in chunks:
        for choice in ch.choices:
            for d in choice.delta.tool_calls or []:
                calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "args": ""})
                calls[d.index]["args"] += d.function.arguments or ""
    assert calls == {0: {"id": "call_r1_0", "name": "add", "args": '{"a": 1}'}}
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert (
        sum((ch.choices[0].model_extra.get("token_ids") or [] for ch in chunks if ch.choices), [])
        == ids
    )
