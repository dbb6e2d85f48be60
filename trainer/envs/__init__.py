"""The environment adapter: the only place that knows verifiers' API (0.3.x, classic,
in-process; 0.4 runs rollouts in uv-managed subprocesses that download packages, which a
training run must not depend on).

`load_environment(EnvConfig)` returns a verifiers Environment: a bundled one by id, or any
'module:function' that returns one. Bundled: 'reverse-text' (single turn),
'reverse-text-chain' (two turns, so the multi-turn path is exercised) and
'tool-arithmetic' (tool calls, the tool run on the trusted side, bounded).

Invariant: rewards are computed here, on the trusted side, by the environment's rubric;
nothing a worker returns is taken as a reward.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from protocol.tools import FunctionDef, ToolContext, ToolDef, context
from trainer.config import EnvConfig, SamplingConfig

BUNDLED = {
    "reverse-text": "trainer.envs.reverse_text:load_environment",
    "reverse-text-chain": "trainer.envs.reverse_text_chain:load_environment",
    "tool-arithmetic": "trainer.envs.tool_arithmetic:load_environment",
}


def _resolve(target: str):
    module, _, func = target.partition(":")
    if not func:
        raise ValueError(
            f"environment {target!r} is neither bundled {sorted(BUNDLED)} nor 'module:function'"
        )
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load environment {target!r}: {exc}") from exc


API_KEY_VAR = "PRIME_POOL_API_KEY"  # verifiers reads the key from a variable


def openai_client(base_url: str, api_key_file: Path | None = None) -> Any:
    """A verifiers client config for an OpenAI-compatible endpoint (`.../v1`), sending the
    key in `api_key_file` (a pool's endpoint refuses calls without one)."""
    import verifiers as vf

    key = api_key_file.expanduser().read_text().strip() if api_key_file else "none"
    os.environ[API_KEY_VAR] = key
    return vf.ClientConfig(api_base_url=base_url, api_key_var=API_KEY_VAR)


def pool_sampling_args(s: SamplingConfig, min_version: int, priority: int = 0) -> dict:
    """verifiers `sampling_args` of a request to the pool: token ids and logprobs back (the
    trusted side checks them against the signed rollout), `min_version`, and the
    scheduler's queue priority when not training's (0)."""
    extra: dict[str, Any] = {"return_token_ids": True, "min_version": min_version}
    if priority:
        extra["priority"] = priority
    return {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "max_tokens": s.max_tokens,
        "logprobs": True,
        "extra_body": extra,
    }


def resolved_client(config: Any) -> Any:
    """The verifiers client of a client config, made once and shared by every episode
    (`Environment.run_rollout` would otherwise build one per call)."""
    from verifiers.legacy.clients import resolve_client

    return resolve_client(config)


def load_environment(cfg: EnvConfig) -> Any:
    """A verifiers Environment for `cfg` (with `cfg.args` passed to its loader), its turns
    and context capped as `cfg` says."""
    env = _resolve(BUNDLED.get(cfg.id, cfg.id))(**cfg.args)
    if cfg.max_turns is not None:
        current = getattr(env, "max_turns", -1)
        env.max_turns = cfg.max_turns if current <= 0 else min(current, cfg.max_turns)
    if cfg.max_context_tokens is not None:
        env.set_max_seq_len(cfg.max_context_tokens)
    return env


def request_tools(defs: list[Any]) -> list[ToolDef]:
    """verifiers `Tool`s as a request carries them (what its OpenAI client sends)."""
    return [
        ToolDef(function=FunctionDef(name=t.name, description=t.description or "",
                                     parameters=t.parameters or {}))
        for t in defs
    ]  # fmt: skip


def tool_context(env: Any) -> ToolContext | None:
    """The tools an environment puts in front of the model (verifiers sends them as each
    request's `tools`, tool_choice 'auto'), as the trusted side reads calls with them."""
    return context(request_tools(getattr(env, "tool_defs", None) or []), None)


def sft_examples(cfg: EnvConfig, num_examples: int, seed: int) -> list[dict]:
    """Chat-format SFT examples (`{"prompt": [...], "completion": [...]}`) of a bundled
    environment that ships them."""
    target = BUNDLED.get(cfg.id, cfg.id)
    module = importlib.import_module(target.partition(":")[0])
    make = getattr(module, "sft_examples", None)
    if make is None:
        raise ValueError(f"environment {cfg.id!r} ships no SFT data (no sft_examples function)")
    return make(num_examples=num_examples, seed=seed, **cfg.args)
