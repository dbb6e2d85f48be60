"""Tool calls on the OpenAI surface (issue 29): how a request's tools reach the model's
prompt, and how calls are read back out of a verified completion.

One format for every model (neither SmolLM2's nor the tiny model's chat template has a
tool section; a template's own tool format is not used yet), the one Hermes and Qwen2.5
models are trained on:

- the tools are described in the system message (appended to the first one, or a new
  one at the start): `TOOLS_INTRO`, then one JSON object per line with each function's
  name, description and parameters (JSON Schema), then `CALL_INSTRUCTIONS`;
- an assistant's call is `<tool_call>\\n{"name": <name>, "arguments": <object>}\\n</tool_call>`
  after its text (several calls: several blocks);
- a tool's result goes back as a user message `<tool_response>\\n<content>\\n</tool_response>`
  (templates without a `tool` role render it; the call it answers is the one before);
- `tool_choice` "required" starts the assistant's turn with `<tool_call>\\n`, a named
  function with `<tool_call>\\n{"name": "<name>", "arguments": ` (the prefill is part of
  the signed prompt, so the verifier checks the completion against it); "none" puts no
  tools in front of the model and reads no call out.

Invariants: calls are parsed only from the trusted decoding of a rollout's signed ids
(plus the prefill the trusted side itself put in the prompt), never from anyone's JSON;
a call's id is derived from the rollout id and its position, so the same rollout always
renders the same answer; a completion whose call blocks are not all well-formed JSON
naming a function of the request comes back as the model wrote it, as content, with its
own finish reason and `tool_call_error` beside it saying why (never a server error; a
finish reason outside OpenAI's five is refused by the official client's types); a `tool` message must answer a
call of an earlier assistant message, or the request is refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOLS_INTRO = "Functions you may call, one JSON object per line:"
CALL_INSTRUCTIONS = (
    f'To call one, write {CALL_OPEN}\n{{"name": <name>, "arguments": <JSON object>}}\n{CALL_CLOSE}'
)
INVALID = "invalid_tool_call"  # parse's verdict on a malformed call (never a finish reason)
INVALID_DETAIL = (
    "the completion opened a <tool_call> block that is not a JSON object naming one of "
    "the request's functions with object arguments, or never closed it"
)
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str = Field("", max_length=8192)
    parameters: dict[str, Any] = {}
    """JSON Schema of the arguments (shown to the model as is; not enforced on its calls)."""


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(max_length=64)
    arguments: str = ""
    """The arguments as JSON text (as OpenAI sends them back)."""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: CallFunction


@dataclass(frozen=True)
class ToolContext:
    """What the trusted side put in front of the model for one request: the function
    names a call may name, and the prefill it started the assistant's turn with."""

    names: frozenset[str]
    prefill: str = ""


def context(tools: list[ToolDef] | None, choice: ToolChoice | None) -> ToolContext | None:
    """The request's tool context (None: no tools in front of the model, no parsing)."""
    if not tools or choice == "none":
        return None
    prefill = ""
    if choice == "required":
        prefill = CALL_OPEN + "\n"
    elif isinstance(choice, NamedToolChoice):
        prefill = (
            CALL_OPEN + "\n" + '{"name": ' + json.dumps(choice.function.name) + ', "arguments": '
        )
    return ToolContext(frozenset(t.function.name for t in tools), prefill)


def system_text(tools: list[ToolDef]) -> str:
    lines = [
        json.dumps(
            {
                "name": t.function.name,
                "description": t.function.description,
                "parameters": t.function.parameters,
            },
            ensure_ascii=False,
        )
        for t in tools
    ]
    return "\n\n".join([TOOLS_INTRO, "\n".join(lines), CALL_INSTRUCTIONS])


def call_text(name: str, arguments: str) -> str:
    """The block of one call as the model writes it (arguments that are not JSON stay
    text, as they were written)."""
    try:
        args: Any = json.loads(arguments) if arguments else {}
    except ValueError:
        args = arguments
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def response_text(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def parse(
    text: str, ctx: ToolContext, rollout_id: str
) -> tuple[str | None, list[dict], str | None]:
    """(content, tool calls, finish reason) of a completion whose trusted text is `text`
    (the prefill is put back in front). No call block: (text, [], None), the rollout's own
    finish reason stands. Every block a JSON object naming a function of the request:
    the text before the first block (None if empty), the calls, 'tool_calls'. Anything
    else that opens a block: the whole text, no call, `INVALID`."""
    full = ctx.prefill + text
    if CALL_OPEN not in full:
        return text, [], None
    calls = []
    for i, m in enumerate(_BLOCK.finditer(full)):
        call = _call(m.group(1), ctx.names)
        if call is None:
            return full, [], INVALID
        name, arguments = call
        calls.append(
            {
                "id": f"call_{rollout_id}_{i}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    rest = _BLOCK.sub("", full)
    if not calls or CALL_OPEN in rest:  # a block opened and never closed (length, stop)
        return full, [], INVALID
    content = full[: full.index(CALL_OPEN)].strip()
    return content or None, calls, "tool_calls"


def _call(body: str, names: frozenset[str]) -> tuple[str, str] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)
