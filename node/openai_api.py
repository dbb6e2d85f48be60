"""The OpenAI-compatible surface: request models and response bodies.

Requests are validated into pydantic models (unknown OpenAI parameters are ignored,
unsupported ones refused with a message), responses follow the OpenAI schema plus the
fields vLLM adds and the verifiers library relies on: top-level `prompt_token_ids`,
`choices[i].token_ids` (including the stop token) and per-token logprobs with `token`,
`logprob`, `bytes` and `top_logprobs`. Each answer names its `rollout_id`; the signed
rollout with its proof is at GET /v1/rollouts/{rollout_id}.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protocol.messages import MAX_SEED, SamplingParams


class _OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    request_id: str | None = Field(None, min_length=1, max_length=128)
    """Rollout id to use (as vLLM's); the scheduler sets it so it can fetch the proof."""
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    ignore_eos: bool = False

    @field_validator("n")
    @classmethod
    def check_single_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n = 1 is supported; send several requests instead")
        return v

    @field_validator("stream")
    @classmethod
    def check_not_streaming(cls, v: bool) -> bool:
        if v:
            raise ValueError("streaming is not supported")
        return v

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            max_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
            stop=tuple(stop),
            ignore_eos=self.ignore_eos,
        )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = ""

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(
                part.get("text", "") for part in self.content if part.get("type") == "text"
            )
        return self.content or ""


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

    @model_validator(mode="after")
    def check_no_echo(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def check_one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


def truncate_at_stop(text: str, stops: tuple[str, ...]) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text if cut < 0 else text[:cut]


def _token_entry(tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    token = tokenizer.decode([token_id])
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_response(
    rollout, text: str, tokenizer, model: str, want_logprobs: bool, top
) -> dict[str, Any]:
    logprobs = None
    if want_logprobs:
        content = []
        for k, (tid, lp) in enumerate(zip(rollout.completion_ids, rollout.logprobs, strict=True)):
            entry = _token_entry(tokenizer, tid, lp)
            entry["top_logprobs"] = [
                _token_entry(tokenizer, i, v) for i, v in (top[k] if top else [])
            ]
            content.append(entry)
        logprobs = {"content": content}
    return {
        "id": f"chatcmpl-{rollout.request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "rollout_id": rollout.request_id,
        "prompt_token_ids": rollout.prompt_ids,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": rollout.finish_reason,
                "logprobs": logprobs,
                "token_ids": rollout.completion_ids,
            }
        ],
        "usage": _usage(rollout),
    }


def completion_response(
    rollout, text: str, tokenizer, model: str, n_logprobs: int | None, top
) -> dict[str, Any]:
    logprobs = None
    if n_logprobs is not None:
        tokens = [tokenizer.decode([t]) for t in rollout.completion_ids]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        logprobs = {
            "tokens": tokens,
            "token_logprobs": rollout.logprobs,
            "top_logprobs": [{tokenizer.decode([i]): v for i, v in row} for row in top]
            if top
            else None,
            "text_offset": offsets,
        }
    return {
        "id": f"cmpl-{rollout.request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "rollout_id": rollout.request_id,
        "prompt_token_ids": rollout.prompt_ids,
        "choices": [
            {
                "index": 0,
                "text": text,
                "finish_reason": rollout.finish_reason,
                "logprobs": logprobs,
                "token_ids": rollout.completion_ids,
            }
        ],
        "usage": _usage(rollout),
    }


def _usage(rollout) -> dict[str, int]:
    p, c = len(rollout.prompt_ids), len(rollout.completion_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
