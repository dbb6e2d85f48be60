"""The pool's OpenAI-compatible endpoint: a verifiers environment points its client here.

A call goes to a generator chosen like any rollout request, with a seed and a rollout id
chosen by the scheduler. As soon as the node answers, the scheduler fetches the node's
signed rollout (GET /v1/rollouts/{id}), checks it is the answer the client got, stores
it, answers the client (the answer carries `rollout_id`), and verifies the rollout
behind the answer. The verdict reaches the orchestrator through the results stream
(source "openai", status accepted / rejected / failed): it trains only on episodes whose
every turn was accepted.

Invariants: the client's `seed` and `request_id` are replaced (a worker must not choose
its seed, and ids must be unique); an answer whose signed rollout is missing or differs
from what the node returned is never passed on (the call goes to another node); a call
that no node could serve gets 503 with Retry-After, bad input gets the node's 4xx.
"""

from __future__ import annotations

import json
import logging
import secrets
import time

import aiohttp
from aiohttp import web

from protocol.codec import CodecError
from protocol.envelope import EnvelopeError, open_envelope
from protocol.http import read_json
from protocol.messages import Rollout, RolloutSpec
from scheduler.config import DispatchConfig
from scheduler.dispatch import Dispatcher, new_seed
from scheduler.registry import NodeRecord, Registry

log = logging.getLogger("prime.scheduler.openai")


class BadAnswer(Exception):
    """A node's answer that cannot be passed on."""


class OpenAIProxy:
    def __init__(self, dispatcher: Dispatcher, registry: Registry, cfg: DispatchConfig):
        self.dispatcher = dispatcher
        self.registry = registry
        self.cfg = cfg
        self.session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=self.cfg.openai_timeout_s),
        )

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.models),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.post("/tokenize", self.tokenize),
        ]

    async def models(self, _request: web.Request) -> web.Response:
        pool = self.dispatcher.pool.config
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": pool.model, "object": "model", "owned_by": pool.pool_id}],
            }
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        node = self._any_node(0, set())
        status, answer = await self._post(node, "/tokenize", body)
        return web.json_response(answer, status=status)

    async def chat_completions(self, request: web.Request) -> web.Response:
        return await self._generate(request, "/v1/chat/completions")

    async def completions(self, request: web.Request) -> web.Response:
        return await self._generate(request, "/v1/completions")

    # -- helpers -----------------------------------------------------------------------
    def _any_node(self, min_version: int, tried: set[str]) -> NodeRecord:
        node = self.registry.pick_generator(min_version, tried)
        if node is None:
            raise web.HTTPServiceUnavailable(
                text=f"no node of pool {self.dispatcher.pool_id!r} can take this call now "
                f"(weights version >= {min_version}); retry later",
                headers={"Retry-After": "1"},
            )
        return node

    async def _post(self, node: NodeRecord, path: str, body: dict) -> tuple[int, dict]:
        assert self.session is not None
        async with self.session.post(node.http_url + path, json=body) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except json.JSONDecodeError as exc:
                raise BadAnswer(f"{node.label} answered non-JSON ({resp.status})") from exc

    async def _generate(self, request: web.Request, path: str) -> web.Response:
        body = await read_json(request)
        min_version = body.pop("min_version", 0)
        if not isinstance(min_version, int) or min_version < 0:
            raise web.HTTPBadRequest(text="min_version must be a non-negative integer")
        tried: set[str] = set()
        last_error = "no attempt"
        for _ in range(self.cfg.max_attempts):
            node = self._any_node(min_version, tried)
            rollout_id = "oa-" + secrets.token_hex(12)
            seed = new_seed()
            forwarded = {**body, "seed": seed, "request_id": rollout_id}
            node.in_flight += 1
            node.outstanding_tokens += 1
            try:
                status, answer = await self._post(node, path, forwarded)
                if status >= 500:
                    raise BadAnswer(f"{node.label} failed with {status}")
                if status >= 400:
                    return web.json_response(answer, status=status)  # the client's input
                raw, rollout = await self._fetch_rollout(node, rollout_id, seed, body, answer)
            except (aiohttp.ClientError, TimeoutError, BadAnswer) as exc:
                last_error = str(exc) or type(exc).__name__
                log.info("OpenAI call on %s failed: %s; trying another node", node.label, exc)
                tried.add(node.node_id)
                if isinstance(exc, TimeoutError):  # heartbeats but never answers: bench it
                    self.dispatcher.note_timeout(node)
                continue
            finally:
                node.in_flight -= 1
                node.outstanding_tokens -= 1
                self.dispatcher.kick()
            node.timeouts = 0
            node.generated += 1
            node.tokens += len(rollout.completion_ids)
            node.first_work = node.first_work or time.time()
            spec = RolloutSpec(
                request_id=rollout_id,
                prompt_ids=rollout.prompt_ids,
                sampling=rollout.sampling,
                min_version=min_version,
            )
            await self.dispatcher.adopt_openai(rollout_id, spec, seed, raw, node)
            answer["rollout_id"] = rollout_id
            return web.json_response(answer)
        raise web.HTTPServiceUnavailable(
            text=f"no node could serve this call ({last_error}); retry later",
            headers={"Retry-After": "1"},
        )

    async def _fetch_rollout(
        self, node: NodeRecord, rollout_id: str, seed: int, body: dict, answer: dict
    ) -> tuple[bytes, Rollout]:
        assert self.session is not None
        url = f"{node.http_url}/v1/rollouts/{rollout_id}"
        async with self.session.get(url) as resp:
            if resp.status != 200:
                raise BadAnswer(
                    f"{node.label} has no signed rollout for its answer ({resp.status})"
                )
            raw = await resp.read()
        try:
            opened = open_envelope(raw, Rollout, check_expiry=False)
        except (EnvelopeError, CodecError, ValueError) as exc:
            raise BadAnswer(f"{node.label} sent an unreadable rollout: {exc}") from exc
        r = opened.message
        choice = (answer.get("choices") or [{}])[0]
        token_ids = choice.get("token_ids")
        asked = (
            float(body.get("temperature", 1.0)),
            float(body.get("top_p", 1.0)),
            max(int(body.get("top_k", 0)), 0),
        )
        used = (r.sampling.temperature, r.sampling.top_p, r.sampling.top_k)
        if (
            opened.sender != node.public_key
            or r.request_id != rollout_id
            or r.seed != seed
            or used != asked
            or (token_ids is not None and list(token_ids) != r.completion_ids)
        ):
            raise BadAnswer(f"{node.label}'s signed rollout does not match its answer")
        return raw, r
