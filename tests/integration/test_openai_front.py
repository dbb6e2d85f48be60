"""The pool's OpenAI endpoint as a front of the signed path (DESIGN.md sections 2, 3, 10).

A real scheduler and three real `prime-node join` tiny-model workers on loopback, called
with the official `openai` client: only the pool owner's keys get in; every answer is
exactly a signed rollout that a second worker verified (streamed or not, one choice or
several); a client's odd sampling parameters never cost an honest worker anything.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from protocol.envelope import open_envelope
from protocol.messages import Rollout
from protocol.openai import completion_text
from protocol.tokenizer import ChatTokenizer
from tests.pools import FAST_LIFECYCLE, Pool, collect, make_pool
from verifier.models import resolve_model

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = make_pool(tmp_path_factory.mktemp("front"))
    p.start_scheduler(*FAST_LIFECYCLE)
    p.join_many(["w0", "w1", "w2"])
    yield p
    p.close()


async def released(pool: Pool, ids: set[str]) -> dict[str, Rollout]:
    """The signed rollouts the results stream released for these rollout ids."""
    async with pool.client() as client:
        found: dict[str, Rollout] = {}
        after = 0
        while len(found) < len(ids):
            page = await collect(client, 1, 60, after=after)
            after = page[-1].seq
            for r in page:
                if r.request_id in ids:
                    assert (r.source, r.status) == ("openai", "accepted"), r
                    found[r.request_id] = open_envelope(
                        r.rollout_envelope, Rollout, check_expiry=False
                    ).message
        return found


def test_only_the_pool_owners_keys_open_the_endpoint(pool: Pool):
    for key in ("", "sk-anything", "psk-" + "A" * 40):
        c = openai.OpenAI(base_url=f"{pool.url}/v1", api_key=key or "none", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            c.chat.completions.create(**CHAT)
    # A pool worker's own OpenAI routes are closed to everyone: it works for its scheduler.
    node = next(iter(pool.nodes.values()))
    r = httpx.post(
        node.health_url.replace("/health", "/v1/chat/completions"),
        json={"messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 403
    # A key's own rate applies.
    slow = openai.OpenAI(
        base_url=f"{pool.url}/v1", api_key=pool.api_key("slow", 0.01, 1), max_retries=0
    )
    slow.models.list()
    with pytest.raises(openai.RateLimitError):
        slow.models.list()


async def test_answers_are_the_verified_signed_rollouts_streamed_or_not(pool: Pool):
    client = pool.openai(max_retries=0)
    tok = ChatTokenizer(resolve_model("tiny"))
    whole = client.chat.completions.create(**CHAT, logprobs=True, n=2, seed=1)
    assert whole.model_extra["seed_chosen_by"] == "scheduler"
    chunks = list(
        client.chat.completions.create(
            **CHAT, stream=True, stream_options={"include_usage": True}, extra_body={}
        )
    )
    streamed_id = next(
        c.choices[0].model_extra["rollout_id"]
        for c in chunks
        if c.choices and c.choices[0].finish_reason
    )
    ids = {c.model_extra["rollout_id"] for c in whole.choices} | {streamed_id}
    assert len(ids) == 3
    signed = await released(pool, ids)
    for c in whole.choices:
        r = signed[c.model_extra["rollout_id"]]
        assert c.model_extra["token_ids"] == r.completion_ids
        assert [e.logprob for e in c.logprobs.content] == r.logprobs
        assert c.message.content == completion_text(r, tok.decode)
        assert c.finish_reason == r.finish_reason
    assert whole.model_extra["prompt_token_ids"] == signed[streamed_id].prompt_ids
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == completion_text(signed[streamed_id], tok.decode)
    assert chunks[-1].usage.completion_tokens == len(signed[streamed_id].completion_ids)


def test_unsupported_and_out_of_range_parameters_get_a_clear_400(pool: Pool):
    client = pool.openai(max_retries=0)
    for extra, said in (
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "not in tools",
        ),
        ({"messages": [{"role": "tool", "tool_call_id": "c9", "content": "3"}]}, "matches none"),
        ({"response_format": {"type": "json_object"}}, "'response_format'"),
        ({"temperature": 1e-300}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    ):
        with pytest.raises(openai.BadRequestError, match=said):
            client.chat.completions.create(**(CHAT | extra))


async def test_a_clients_tiny_top_p_bans_nobody(pool: Pool):
    """The attack of the issue: top_p = 1e-300 (0 in float32) used to make every verifier
    reject the honest generator's rollout; nine such calls banned a worker."""
    client = pool.openai(max_retries=0)
    answers = [client.chat.completions.create(**CHAT, top_p=1e-300) for _ in range(12)]
    ids = {a.choices[0].model_extra["rollout_id"] for a in answers}
    await released(pool, ids)
    state = pool.state()
    assert {n["state"] for n in state["nodes"]} == {"healthy"}
    assert {n["reputation"] for n in state["nodes"]} == {1.0}
    assert state["totals"]["rejections"] == 0


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
}


async def test_tool_calls_through_the_pool_are_read_from_the_verified_rollout(pool: Pool):
    """The official client with tools: a named tool_choice starts the assistant's turn
    with the call's opening (in the signed prompt); what comes back, whole or streamed, is
    parsed from the verified rollout's trusted text alone: tool calls, or (the tiny
    model's random weights rarely write JSON) the text as written, its own finish reason
    and `tool_call_error` beside it, never a server error. A conversation that carries a call and its
    result is rendered by the trusted side as `protocol.tools` says."""
    from protocol.openai import ChatCompletionRequest
    from protocol.tools import INVALID, parse

    client = pool.openai(max_retries=0)
    tok = ChatTokenizer(resolve_model("tiny"))
    named = {"type": "function", "function": {"name": "add"}}
    ask = CHAT | {"messages": [{"role": "user", "content": "1+2?"}], "max_tokens": 12}
    whole = client.chat.completions.create(**ask, tools=[ADD], tool_choice=named)
    chunks = list(
        client.chat.completions.create(**ask, tools=[ADD], tool_choice=named, stream=True)
    )
    body = ChatCompletionRequest.model_validate(ask | {"tools": [ADD], "tool_choice": named})
    ctx = body.tool_context()
    (c,) = whole.choices
    rid = c.model_extra["rollout_id"]
    streamed = next(
        ch.choices[0].model_extra["rollout_id"]
        for ch in chunks
        if ch.choices and ch.choices[0].finish_reason
    )
    signed = await released(pool, {rid, streamed})
    r = signed[rid]
    assert r.prompt_ids == tok.chat_ids(body.conversation()) + tok.encode(ctx.prefill)
    content, calls, finish = parse(completion_text(r, tok.decode), ctx, rid)
    assert c.finish_reason == ("tool_calls" if calls else r.finish_reason)
    assert ("tool_call_error" in c.model_extra) == (finish == INVALID)
    assert c.message.content == content
    assert [tc.model_dump() for tc in c.message.tool_calls or []] == calls
    s = signed[streamed]
    content, calls, finish = parse(completion_text(s, tok.decode), ctx, streamed)
    got = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert got == (content or "")
    last = [ch.choices[0] for ch in chunks if ch.choices][-1]
    assert last.finish_reason == ("tool_calls" if calls else s.finish_reason)
    assert ("tool_call_error" in last.model_extra) == (finish == INVALID)

    # The next turn: the call and its result, rendered by the trusted side.
    history = ask["messages"] + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                }
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    follow = client.chat.completions.create(**(ask | {"messages": history}), tools=[ADD])
    body = ChatCompletionRequest.model_validate(ask | {"messages": history, "tools": [ADD]})
    assert follow.model_extra["prompt_token_ids"] == tok.chat_ids(body.conversation())
    text = tok.decode(follow.model_extra["prompt_token_ids"])
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<tool_response>\n3\n</tool_response>" in text
    # What a client asked (tools, a forced call) cost no honest worker anything.
    await released(pool, {follow.choices[0].model_extra["rollout_id"]})
    state = pool.state()
    assert {n["state"] for n in state["nodes"]} == {"healthy"}
    assert state["totals"]["rejections"] == 0
