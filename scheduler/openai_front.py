"""The pool's OpenAI-compatible endpoint: a front of the signed dispatch path.

A verifiers environment (or any `openai` client) points here with an API key the pool
owner issued (`prime-scheduler pool api-key`). Each call is tokenized here, on the
trusted side, into one `RolloutSpec` per choice; the dispatcher runs them exactly like
the orchestrator's submissions (a seed the scheduler chooses, a signed `RolloutRequest`,
a generator, a verifier given that request, disputes and audits), and the answer is
rendered from the signed rollouts it released as accepted, with text decoded here from
the verified ids. The results stream carries the same rollouts (source "openai"), so the
orchestrator trains on exactly what this answer showed.

Invariants: no worker's JSON is ever read or passed on; an answer is sent only after
every choice was accepted by verification (a rejected rollout is generated again by
another node; a call that cannot be served gets 503 with Retry-After, one the nodes
refuse as invalid gets 400 with their reason); every call carries a valid key for this
pool, unrevoked and within its rate (401, 403 and 429 otherwise), checked before any
work; the client's `seed` and `request_id` are never used (the answer says so).
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

from aiohttp import web
from jinja2 import TemplateError

from protocol.http import read_json
from protocol.messages import ApiKey, RolloutSpec
from protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    conversation,
    render,
    respond,
)
from protocol.tokenizer import ChatTokenizer, TokenizerError
from scheduler.config import DispatchConfig, OpenAIConfig
from scheduler.dispatch import Dispatcher, Saturated
from scheduler.pool import PoolError, SignedPool, check_api_key
from scheduler.ratelimit import RateLimiter

log = logging.getLogger("prime.scheduler.openai")
# Marks every answer: a client's seed is replaced, so seeded calls do not reproduce.
SEED_NOTE = {"seed_chosen_by": "scheduler", "verified": True}


def load_tokenizer(cfg: OpenAIConfig, pool: SignedPool) -> ChatTokenizer | None:
    """The configured tokenizer, else the pool model's folder, else None (logged)."""
    folder = cfg.tokenizer or Path(pool.config.model).expanduser()
    try:
        return ChatTokenizer(folder)
    except (TokenizerError, OSError) as exc:
        if cfg.tokenizer is not None:
            raise
        log.warning("OpenAI endpoint disabled: no tokenizer (%s); set --openai.tokenizer", exc)
        return None


class OpenAIFront:
    def __init__(
        self,
        dispatcher: Dispatcher,
        pool: SignedPool,
        cfg: OpenAIConfig,
        dispatch_cfg: DispatchConfig,
    ):
        self.dispatcher = dispatcher
        self.pool = pool
        self.cfg = cfg
        self.timeout_s = dispatch_cfg.openai_timeout_s
        self.tokenizer = load_tokenizer(cfg, pool)
        self.revoked = set(cfg.revoked_keys)
        # One bucket set per (rate, burst) pair: keys carry their own limits.
        self.limiters: dict[tuple[float, int], RateLimiter] = {}

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.models),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.post("/tokenize", self.tokenize),
        ]

    # -- who may call ---------------------------------------------------------------------
    def authorize(self, request: web.Request) -> ApiKey:
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer "):
            raise web.HTTPUnauthorized(
                text="this pool's endpoint needs an API key (Authorization: Bearer psk-...) "
                "issued by its owner with `prime-scheduler pool api-key`"
            )
        try:
            key = check_api_key(header.removeprefix("Bearer ").strip(), self.pool)
        except PoolError as exc:
            raise web.HTTPUnauthorized(text=str(exc)) from exc
        if key.key_id in self.revoked:
            raise web.HTTPForbidden(text=f"API key {key.key_id} was revoked")
        limiter = self.limiters.get((key.rate_per_s, key.burst))
        if limiter is None:
            limiter = RateLimiter(key.rate_per_s, key.burst, "API key")
            self.limiters[(key.rate_per_s, key.burst)] = limiter
        limiter.check(key.key_id, key.key_id)
        return key

    def _tok(self) -> ChatTokenizer:
        if self.tokenizer is None:
            raise web.HTTPNotImplemented(
                text="this scheduler has no tokenizer: start it with --openai.tokenizer "
                "<model folder> to serve OpenAI calls"
            )
        return self.tokenizer

    # -- routes ---------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        self.authorize(request)
        pool = self.pool.config
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": pool.model, "object": "model", "owned_by": pool.pool_id}],
            }
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        self.authorize(request)
        body = await read_json(request, TokenizeRequest)
        tok = self._tok()
        if body.messages is not None:
            ids = self._chat_ids(conversation(body.messages), body.add_generation_prompt)
        else:
            ids = tok.encode(body.prompt or "")
        return web.json_response({"tokens": ids, "count": len(ids)})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self.authorize(request)
        body = await read_json(request, ChatCompletionRequest)
        if body.logprobs and body.top_logprobs:
            raise web.HTTPBadRequest(
                text="top_logprobs is not offered by a pool (it is not part of what is "
                "verified); ask for logprobs only"
            )
        ids = self._chat_ids(body.conversation(), prefill=body.prefill())
        return await self._serve(request, "chat", body, ids)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.authorize(request)
        body = await read_json(request, CompletionRequest)
        if body.logprobs:
            raise web.HTTPBadRequest(text="logprobs > 0 (top logprobs) is not offered by a pool")
        prompt = body.prompt if isinstance(body.prompt, list) else self._tok().encode(body.prompt)
        if not prompt:
            raise web.HTTPBadRequest(text="prompt encodes to no tokens")
        return await self._serve(request, "completion", body, prompt)

    # -- one call -------------------------------------------------------------------------
    def _chat_ids(
        self, conv: list[dict], add_generation_prompt: bool = True, prefill: str = ""
    ) -> list[int]:
        """As a node computes them (`node.server`): the template over the plain
        conversation, then the tool prefill's own ids."""
        try:
            ids = self._tok().chat_ids(conv, add_generation_prompt)
        except (TokenizerError, TemplateError) as exc:
            raise web.HTTPBadRequest(text=str(exc)) from exc
        return ids + (self._tok().encode(prefill) if prefill else [])

    async def _serve(self, request: web.Request, kind, body, prompt_ids: list[int]):
        tok = self._tok()
        sampling = body.sampling(self.cfg.default_max_tokens)
        specs = [
            RolloutSpec(
                request_id="oa-" + secrets.token_hex(12),
                prompt_ids=prompt_ids,
                sampling=sampling,
                min_version=body.min_version,
                priority=body.priority,
            )
            for _ in range(body.n)
        ]
        try:
            released = await self.dispatcher.call(specs, self.timeout_s)
        except Saturated as exc:
            raise web.HTTPServiceUnavailable(text=str(exc), headers={"Retry-After": "1"}) from exc
        except TimeoutError as exc:
            raise web.HTTPServiceUnavailable(
                text=f"not served within {self.timeout_s:.0f} s; retry later",
                headers={"Retry-After": "1"},
            ) from exc
        for r in released:
            if r.refused:
                raise web.HTTPBadRequest(text=r.detail)
            if r.status != "accepted" or r.rollout is None:
                raise web.HTTPServiceUnavailable(
                    text=f"no node could serve this call ({r.detail}); retry later",
                    headers={"Retry-After": "1"},
                )
        rollouts = [r.rollout for r in released if r.rollout is not None]
        answer = render(
            kind,
            rollouts,
            tok.decode,
            tok.token_text,
            self.pool.config.model,
            bool(body.logprobs is not None if kind == "completion" else body.logprobs),
            extra=SEED_NOTE,
            tools=body.tool_context() if kind == "chat" else None,
        )
        return await respond(request, answer, body.stream, tok.decode, body.include_usage)
