"""The OpenAI-compatible surface shared by a node and the scheduler's front: request models,
answers rendered from signed rollouts, and server-sent chunks.

Requests are validated into pydantic models: unknown OpenAI parameters are ignored, the
ones this network cannot honour (response_format, echo, logit_bias, penalties, the legacy
`functions`, ...) are refused with a message rather than silently dropped; tools and tool
calls follow `protocol.tools`, and sampling parameters become a
`SamplingParams`, whose validators are the one place that says what a pool accepts.
Answers follow the OpenAI schema plus what vLLM adds and the verifiers library relies on:
top-level `prompt_token_ids`, `choices[i].token_ids` (including the stop token), per-token
logprobs with `token`, `logprob`, `bytes` and `top_logprobs`, and each choice's
`rollout_id` (the signed rollout it was rendered from).

Invariants: every field of an answer is computed from a `Rollout` (ids, logprobs, finish
reason) and a decode function of the side that renders it, never taken from anyone's
JSON; a streamed answer carries exactly the text, tokens and logprobs of the answer it is
cut from (`stream_chunks`), so streaming changes how an answer travels, not what it says.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protocol import tools as tools_fmt
from protocol.messages import MAX_SEED, Rollout, SamplingParams
from protocol.tools import ToolCall, ToolChoice, ToolDef

MAX_CHOICES = 16
# Parameters of OpenAI's API that this network cannot honour: refused, never ignored.
UNSUPPORTED = (
    "functions",
    "function_call",
    "parallel_tool_calls",
    "response_format",
    "logit_bias",
    "best_of",
    "suffix",
    "audio",
    "modalities",
    "prediction",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
# Parameters accepted only at their neutral value (what the sampler does anyway).
NEUTRAL = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "min_p": 0,
    "min_tokens": 0,
    "echo": False,
}

TokenText = Callable[[int], str]
Decode = Callable[[list[int]], str]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    """Send a last chunk with the token counts."""


class _OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field("", max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=65536)
    max_completion_tokens: int | None = Field(None, ge=1, le=65536)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, ge=-1)
    """-1 or 0: no top-k filter (vLLM's and OpenAI's conventions)."""
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    """A standalone node honours it; the scheduler replaces it (it chooses every seed)."""
    request_id: str | None = Field(None, min_length=1, max_length=128)
    """Rollout id to use (as vLLM's); a standalone node refuses one it already holds."""
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    """Completions per prompt, each its own rollout with its own seed."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_version: int = Field(0, ge=0)
    """Lowest admissible weights version (the scheduler's front; ignored by a node)."""
    priority: int = Field(0, ge=0, le=100)
    """Queue order at the scheduler's front, lower first (as vLLM's; `RolloutSpec.priority`);
    ignored by a node, which serves what it is sent."""

    @model_validator(mode="before")
    @classmethod
    def check_supported_parameters(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name in UNSUPPORTED:
            if data.get(name) is not None:
                raise ValueError(f"'{name}' is not supported by prime-swarm; leave it out")
        for name, neutral in NEUTRAL.items():
            value = data.get(name)
            if value is not None and value != neutral:
                raise ValueError(f"'{name}' is not supported (only {neutral!r}); leave it out")
        return data

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        """The signed sampling parameters (a ValidationError says what is out of range)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            max_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
            stop=tuple(stop),
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = ""
    tool_calls: list[ToolCall] | None = Field(None, max_length=64)
    """An assistant message's calls (as an answer of this surface gave them)."""
    tool_call_id: str | None = Field(None, max_length=128)
    """A tool message: the id of the call it answers."""

    @field_validator("content")
    @classmethod
    def check_text_parts_only(cls, v):
        if isinstance(v, list):
            for part in v:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content)
        return self.content or ""


def conversation(
    messages: list[ChatMessage], tools: list[ToolDef] | None = None, choice: Any = None
) -> list[dict[str, str]]:
    """The plain messages a chat template renders: tools described in the system message
    (unless `choice` is 'none'), calls and tool results written in `protocol.tools`'
    format."""
    out = []
    for m in messages:
        text = m.text()
        if m.role == "assistant" and m.tool_calls:
            blocks = [
                tools_fmt.call_text(c.function.name, c.function.arguments) for c in m.tool_calls
            ]
            text = "\n".join(([text] if text else []) + blocks)
        if m.role == "tool":
            out.append({"role": "user", "content": tools_fmt.response_text(text)})
        else:
            out.append({"role": m.role, "content": text})
    if tools and choice != "none":
        described = tools_fmt.system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    """'auto' (the default with tools), 'none', 'required' or a named function."""
    parallel_tool_calls: bool | None = None
    """Accepted; the model may write several calls whatever it says."""

    @model_validator(mode="after")
    def check_tool_use(self) -> ChatCompletionRequest:
        names = {t.function.name for t in self.tools or []}
        if len(names) != len(self.tools or []):
            raise ValueError("tools: two functions have the same name")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice asks for a call but no tools are given")
        if isinstance(choice, tools_fmt.NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        called: set[str] = set()
        for i, m in enumerate(self.messages):
            if m.role == "assistant":
                called.update(c.id for c in m.tool_calls or [])
            elif m.tool_calls:
                raise ValueError(f"messages[{i}]: only an assistant message has tool_calls")
            if m.role == "tool" and m.tool_call_id not in called:
                raise ValueError(
                    f"messages[{i}]: a tool message must answer a call of an earlier "
                    f"assistant message (tool_call_id {m.tool_call_id!r} matches none)"
                )
        return self

    def tool_context(self) -> tools_fmt.ToolContext | None:
        return tools_fmt.context(self.tools, self.tool_choice)

    def conversation(self) -> list[dict[str, str]]:
        return conversation(self.messages, self.tools, self.tool_choice)

    def prefill(self) -> str:
        """What the trusted side starts the assistant's turn with ('' : nothing)."""
        ctx = self.tool_context()
        return ctx.prefill if ctx is not None else ""


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("prompt")
    @classmethod
    def check_prompt_not_empty(cls, v):
        if not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("prompt token ids must be non-negative")
        return v


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field("", max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=1024)
    add_generation_prompt: bool = True
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def check_one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


# -- answers ------------------------------------------------------------------------------
def truncate_at_stop(text: str, stops: tuple[str, ...]) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text if cut < 0 else text[:cut]


def completion_text(rollout: Rollout, decode: Decode) -> str:
    """What a client (and a rubric) reads of a rollout: its ids decoded without special
    tokens, cut before the first stop string."""
    return truncate_at_stop(decode(rollout.completion_ids), rollout.sampling.stop)


def _token_entry(token_text: TokenText, token_id: int, logprob: float) -> dict[str, Any]:
    token = token_text(token_id)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}


def _usage(rollouts: list[Rollout]) -> dict[str, int]:
    p = len(rollouts[0].prompt_ids)
    c = sum(len(r.completion_ids) for r in rollouts)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _chat_logprobs(r: Rollout, token_text: TokenText, top) -> dict[str, Any]:
    content = []
    for k, (tid, lp) in enumerate(zip(r.completion_ids, r.logprobs, strict=True)):
        entry = _token_entry(token_text, tid, lp)
        entry["top_logprobs"] = [_token_entry(token_text, i, v) for i, v in (top[k] if top else [])]
        content.append(entry)
    return {"content": content}


def _completion_logprobs(r: Rollout, token_text: TokenText, top) -> dict[str, Any]:
    tokens = [token_text(t) for t in r.completion_ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": list(r.logprobs),
        "top_logprobs": [{token_text(i): v for i, v in row} for row in top] if top else None,
        "text_offset": offsets,
    }


def render(
    kind: Literal["chat", "completion"],
    rollouts: list[Rollout],
    decode: Decode,
    token_text: TokenText,
    model: str,
    logprobs: bool,
    tops: list | None = None,
    extra: dict[str, Any] | None = None,
    tools: tools_fmt.ToolContext | None = None,
) -> dict[str, Any]:
    """The OpenAI answer of one request whose n choices are these rollouts (same prompt);
    with `tools`, calls are parsed out of each chat completion (`protocol.tools.parse`)."""
    choices = []
    for i, r in enumerate(rollouts):
        top = tops[i] if tops else None
        text = completion_text(r, decode)
        choice: dict[str, Any] = {"index": i}
        finish = r.finish_reason
        if kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tools is not None:
                content, calls, parsed = tools_fmt.parse(text, tools, r.request_id)
                message["content"] = content
                if calls:
                    message["tool_calls"] = calls
                    finish = parsed
                elif parsed == tools_fmt.INVALID:
                    choice["tool_call_error"] = tools_fmt.INVALID_DETAIL
            choice["message"] = message
            choice["logprobs"] = _chat_logprobs(r, token_text, top) if logprobs else None
        else:
            choice["text"] = text
            choice["logprobs"] = _completion_logprobs(r, token_text, top) if logprobs else None
        choice |= {
            "finish_reason": finish,
            "token_ids": list(r.completion_ids),
            "rollout_id": r.request_id,
            "seed": r.seed,
        }
        choices.append(choice)
    first = rollouts[0].request_id
    return {
        "id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{first}",
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "rollout_id": first,
        "prompt_token_ids": list(rollouts[0].prompt_ids),
        "choices": choices,
        "usage": _usage(rollouts),
        **(extra or {}),
    }


def stream_chunks(answer: dict[str, Any], decode: Decode, include_usage: bool) -> Iterator[dict]:
    """Cut a rendered answer into OpenAI stream chunks, one per completion token.

    Each chunk's text is the growth of the answer's final text that the token brought (a
    token in the middle of a multi-byte character brings none), so the chunks of a choice
    concatenate to its text; the last chunk of a choice carries its finish_reason."""
    chat = answer["object"] == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {k: answer[k] for k in ("id", "created", "model", "rollout_id")} | {"object": obj}
    for choice in answer["choices"]:
        if chat and (choice["message"].get("tool_calls") or "tool_call_error" in choice):
            yield from _tool_chunks(base, choice)
            continue
        final = choice["message"]["content"] if chat else choice["text"]
        ids = choice["token_ids"]
        lps = (choice["logprobs"] or {}).get("content") if chat else None
        sent = 0
        for k in range(len(ids)):
            grown = decode(ids[: k + 1])
            upto = len(grown) if final.startswith(grown) else sent
            if k == len(ids) - 1:
                upto = len(final)
            piece = final[sent:upto]
            sent = max(sent, upto)
            c: dict[str, Any] = {"index": choice["index"], "finish_reason": None}
            if chat:
                c["delta"] = {"content": piece} | ({"role": "assistant"} if k == 0 else {})
                c["logprobs"] = {"content": [lps[k]]} if lps else None
            else:
                c["text"] = piece
                c["logprobs"] = None
            c["token_ids"] = [ids[k]]
            if k == len(ids) - 1:
                c["finish_reason"] = choice["finish_reason"]
                c["rollout_id"] = choice["rollout_id"]
            yield base | {"choices": [c]}
    if include_usage:
        yield base | {"choices": [], "usage": answer["usage"]}


def _tool_chunks(base: dict[str, Any], choice: dict[str, Any]) -> Iterator[dict]:
    """A choice whose text holds tool calls, as OpenAI streams one: its content and every
    token in the first chunk, then one chunk per call (id, name, arguments), then the
    finish reason."""
    index, message = choice["index"], choice["message"]
    first = {"role": "assistant", "content": message["content"] or ""}
    lps = choice["logprobs"]
    yield base | {
        "choices": [
            {"index": index, "delta": first, "logprobs": lps, "finish_reason": None,
             "token_ids": choice["token_ids"]}
        ]
    }  # fmt: skip
    for k, call in enumerate(message.get("tool_calls") or []):
        delta = {"tool_calls": [{"index": k, **call}]}
        yield base | {"choices": [{"index": index, "delta": delta, "finish_reason": None}]}
    last = {"index": index, "delta": {}, "finish_reason": choice["finish_reason"]}
    last |= {k: choice[k] for k in ("rollout_id", "tool_call_error") if k in choice}
    yield base | {"choices": [last]}


async def respond(
    request: web.Request, answer: dict[str, Any], stream: bool, decode: Decode, usage: bool
) -> web.StreamResponse:
    """Send `answer` as one JSON body or as server-sent events ending with [DONE]."""
    if not stream:
        return web.json_response(answer)
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    for chunk in stream_chunks(answer, decode, usage):
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
