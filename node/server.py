"""The worker's HTTP API (aiohttp).

Routes:
- OpenAI-compatible JSON (`protocol.openai`): GET /v1/models, POST /v1/completions, POST
  /v1/chat/completions (`n`, `stream`), POST /tokenize (as vLLM's); open to anyone on a
  standalone `serve`, behind a bearer key with `--server.api-key`, and closed (403) on a
  pool node (`prime-node join`), which takes work only from its scheduler;
- proof routes (msgpack, signed envelopes): POST /v1/rollouts (a `RolloutRequest` ->
  signed `Rollout`), GET /v1/rollouts/{id} (the signed rollout of an earlier OpenAI call),
  POST /v1/verify (a `VerifyRequest` -> signed `Verdict`);
- weights: POST /v1/weights/update and /v1/weights/reload, accepted only when signed by a
  trusted key (the pool's trainer); an update of a version not newer than the one held
  gets 409 (`node.worker.is_newer`);
- GET /health: status, node id, weights version and hash, outstanding requests, `stats`
  (counts of generated / verified / accepted / rejected rollouts), `busy_s`, the
  seconds spent generating and verifying since start (`{"generate": s, "verify": s}`,
  see `node.worker`), and `worker`, the settings the worker runs with (batch size and
  wait, max_model_len, proof processes).

In a pool (`prime-node join`) the proof routes take work only from the scheduler:
`callers` holds the keys allowed to sign rollout and verify requests (None = anyone, as a
standalone `serve`; an empty set = nobody, before registration). `api_key` says who may
use the OpenAI routes ('' = anyone, a key = callers sending it as a bearer token, None =
nobody: a pool node).

Invariants: every bad input (malformed JSON or msgpack, oversized body, wrong types, bad
/ expired / replayed / untrusted signature) gets a 4xx with a JSON error body and one log
line, and the server keeps serving; signed routes reject a replayed nonce; a
`request_id` this node already holds a signed rollout for is refused (409), never replaced; requests past
`max_concurrent_requests` get 503 instead of queueing without bound; weights are loaded
only under a trusted signature, through one function (`Worker.load_weights`), whether
they come from the trainer's push or relayed by the scheduler (`load_relayed_weights`),
and only when newer than the version held; an update that carries a swarm manifest is
fetched from peers first (`node.swarm_weights`) and loaded when every piece is in and
checked. Every signed route opens its envelope the same way (`_open`): size cap, replay
cache, the senders allowed on that route.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, TypeVar

from aiohttp import web

from node.worker import (
    RequestRejected,
    SignedRollout,
    StaleWeights,
    Worker,
    is_newer,
    require_newer,
)
from protocol.envelope import Opened, ReplayCache, open_envelope
from protocol.http import MSGPACK, body_timeout_middleware, error_middleware, read_json
from protocol.identity import public_key_from_node_id
from protocol.messages import (
    MAX_SEED,
    Message,
    RolloutRequest,
    VerifyRequest,
    WeightReload,
    WeightUpdate,
)
from protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    conversation,
    render,
    respond,
)

if TYPE_CHECKING:
    from node.swarm_weights import SwarmWeights

log = logging.getLogger("prime.node.server")
M = TypeVar("M", bound=Message)


class NodeServer:
    def __init__(
        self,
        worker: Worker,
        *,
        model_name: str,
        trusted_keys: list[str],
        max_body_bytes: int,
        max_concurrent: int,
        rollout_cache_size: int,
        callers: set[bytes] | None = None,
        api_key: str | None = "",
        swarm: SwarmWeights | None = None,
        body_read_timeout_s: float = 30.0,
    ):
        self.worker = worker
        self.model_name = model_name
        self.trusted = {public_key_from_node_id(k) for k in trusted_keys}
        self.callers = callers
        self.api_key = api_key
        self.body_read_timeout_s = body_read_timeout_s
        self.max_body_bytes = max_body_bytes
        self.replay = ReplayCache()
        self.slots = asyncio.Semaphore(max_concurrent)
        self.max_concurrent = max_concurrent
        self.rollouts: OrderedDict[str, bytes] = OrderedDict()
        self.pending_ids: set[str] = set()  # OpenAI calls under way: their ids are taken
        self.rollout_cache_size = rollout_cache_size
        self.swarm = swarm  # its hooks load into `worker` (node.assembly)
        # Requests holding a slot (queued for the engine or being answered): a drain waits on it.
        self.in_flight = 0

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.max_body_bytes,
            middlewares=[
                error_middleware(log, {StaleWeights: 409, RequestRejected: 400}),
                body_timeout_middleware(self.body_read_timeout_s, log),
            ],
        )
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/v1/models", self.models),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.post("/tokenize", self.tokenize),
                web.post("/v1/rollouts", self.rollout),
                web.get("/v1/rollouts/{rollout_id}", self.get_rollout),
                web.post("/v1/verify", self.verify),
                web.post("/v1/weights/update", self.weights_update),
                web.post("/v1/weights/reload", self.weights_reload),
            ]
        )
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app) -> None:
        self.worker.start()
        if self.swarm is not None:
            await asyncio.to_thread(self.swarm.start)

    async def _on_cleanup(self, _app) -> None:
        if self.swarm is not None:
            await self.swarm.close()
        await self.worker.stop()

    # -- helpers -------------------------------------------------------------------
    async def _open(
        self, request: web.Request, model: type[M], senders: set[bytes] | None
    ) -> Opened[M]:
        """The request's signed envelope of `model` from one of `senders` (None: anyone),
        never replayed and within the body cap; any failure is a 4xx (`EnvelopeError`)."""
        return open_envelope(
            await request.read(),
            model,
            replay_cache=self.replay,
            trusted_senders=senders,
            max_bytes=self.max_body_bytes,
        )

    async def _limited(self, coro):
        if self.slots.locked():
            coro.close()
            raise web.HTTPServiceUnavailable(
                text=f"node is saturated ({self.max_concurrent} requests in flight)"
            )
        async with self.slots:
            self.in_flight += 1
            try:
                return await coro
            finally:
                self.in_flight -= 1

    def _remember(self, rollout_id: str, envelope: bytes) -> None:
        if self.rollout_cache_size == 0:
            return
        self.rollouts[rollout_id] = envelope
        while len(self.rollouts) > self.rollout_cache_size:
            self.rollouts.popitem(last=False)

    def _check_openai_caller(self, request: web.Request) -> None:
        if self.api_key is None:
            raise web.HTTPForbidden(
                text="this node works for its pool's scheduler only: call the pool's "
                "OpenAI endpoint (the scheduler) instead"
            )
        if self.api_key:
            sent = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(sent.encode(), self.api_key.encode()):
                raise web.HTTPUnauthorized(text="missing or wrong API key (Authorization: Bearer)")

    def _requests(self, prompt_ids: list[int], body) -> list[RolloutRequest]:
        """One signed-rollout request per choice; ids and seeds as the client chose them."""
        sampling = body.sampling(default_max_tokens=256)
        base = body.request_id or uuid.uuid4().hex
        ids = [base] if body.n == 1 else [f"{base}-{i}" for i in range(body.n)]
        held = [i for i in ids if i in self.rollouts or i in self.pending_ids]
        if held:
            raise web.HTTPConflict(text=f"request_id {held[0]!r} was used before on this node")
        self.pending_ids.update(ids)
        first = body.seed if body.seed is not None else int.from_bytes(os.urandom(8)) & MAX_SEED
        return [
            RolloutRequest(
                request_id=rid,
                pool_id=self.worker.pool_id,
                prompt_ids=prompt_ids,
                sampling=sampling,
                seed=(first + i) & MAX_SEED,
            )
            for i, rid in enumerate(ids)
        ]

    def _chat_ids(self, conv: list[dict], add_generation_prompt: bool = True, prefill: str = ""):
        """A chat prompt's ids: the template over the plain conversation (tools and calls
        written in `protocol.tools`' format), then the tool prefill's own ids."""
        tok = self.worker.engine.tokenizer
        if not tok.chat_template:
            raise RequestRejected("this model has no chat template; use /v1/completions")
        ids = tok.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return ids + (tok.encode(prefill, add_special_tokens=False) if prefill else [])

    def _decode(self, ids: list[int]) -> str:
        return self.worker.engine.tokenizer.decode(ids, skip_special_tokens=True)

    def _token_text(self, token_id: int) -> str:
        return self.worker.engine.tokenizer.decode([token_id])

    # -- routes --------------------------------------------------------------------
    async def health(self, _request: web.Request) -> web.Response:
        engine = self.worker.engine
        return web.json_response(
            {
                "status": "ok",
                "node_id": self.worker.node_id,
                "weights_version": engine.weights_version,
                "weights_hash": engine.weights_hash,
                "outstanding": self.worker.outstanding,
                "stats": self.worker.stats,
                "busy_s": {k: round(v, 6) for k, v in self.worker.busy_s.items()},
                "decode_steps": engine.decode_steps,
                "worker": self.worker.settings,
            }
        )

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "owned_by": "prime-swarm",
                        "max_model_len": self.worker.max_model_len,
                    }
                ],
            }
        )

    async def _openai_generate(
        self, request: web.Request, kind, body, prompt_ids: list[int], top: int, logprobs: bool
    ) -> web.StreamResponse:
        """Generate every choice, keep the signed rollouts for the proof route, answer in
        OpenAI's schema (rendered from the signed rollouts)."""
        reqs = self._requests(prompt_ids, body)

        async def every_choice() -> list[SignedRollout]:
            return await asyncio.gather(*(self.worker.generate(r, top_logprobs=top) for r in reqs))

        try:
            signed = await self._limited(every_choice())
            for s in signed:
                self._remember(s.rollout.request_id, s.envelope)
        finally:
            self.pending_ids.difference_update(r.request_id for r in reqs)
        answer = render(
            kind,
            [s.rollout for s in signed],
            self._decode,
            self._token_text,
            self.model_name,
            logprobs,
            [s.top_logprobs for s in signed] if top else None,
            tools=body.tool_context() if kind == "chat" else None,
        )
        return await respond(request, answer, body.stream, self._decode, body.include_usage)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self._check_openai_caller(request)
        body = await read_json(request, ChatCompletionRequest)
        top = (body.top_logprobs or 0) if body.logprobs else 0
        ids = self._chat_ids(body.conversation(), prefill=body.prefill())
        return await self._openai_generate(request, "chat", body, ids, top, body.logprobs)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self._check_openai_caller(request)
        body = await read_json(request, CompletionRequest)
        tok = self.worker.engine.tokenizer
        ids = (
            body.prompt
            if isinstance(body.prompt, list)
            else tok.encode(body.prompt, add_special_tokens=False)
        )
        if not ids:
            raise RequestRejected("prompt encodes to no tokens")
        wanted = body.logprobs is not None
        return await self._openai_generate(
            request, "completion", body, list(ids), body.logprobs or 0, wanted
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        self._check_openai_caller(request)
        body = await read_json(request, TokenizeRequest)
        tok = self.worker.engine.tokenizer
        if body.messages is not None:
            ids = self._chat_ids(conversation(body.messages), body.add_generation_prompt)
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return web.json_response(
            {"tokens": list(ids), "count": len(ids), "max_model_len": self.worker.max_model_len}
        )

    async def rollout(self, request: web.Request) -> web.Response:
        opened = await self._open(request, RolloutRequest, self.callers)
        signed = await self._limited(self.worker.generate(opened.message))
        return web.Response(body=signed.envelope, content_type=MSGPACK)

    async def get_rollout(self, request: web.Request) -> web.Response:
        envelope = self.rollouts.get(request.match_info["rollout_id"])
        if envelope is None:
            raise web.HTTPNotFound(text="no such rollout on this node (unknown id or evicted)")
        return web.Response(body=envelope, content_type=MSGPACK)

    async def verify(self, request: web.Request) -> web.Response:
        opened = await self._open(request, VerifyRequest, self.callers)
        verdict, envelope = await self._limited(self.worker.verify(opened.message))
        log.info(
            "verified %s from %s: %s",
            verdict.request_id,
            verdict.generator_id,
            "accepted" if verdict.accepted else "rejected (" + "; ".join(verdict.reasons) + ")",
        )
        return web.Response(body=envelope, content_type=MSGPACK)

    async def load_relayed_weights(self, envelope: bytes) -> bool:
        """Load a trainer-signed `WeightUpdate` that the scheduler passed on; True if loaded
        (or, by manifest, fetching).

        The trainer signed it when it published, so it is usually past its expiry by now:
        the signature is what counts, and only a newer version is loaded (`is_newer`), so
        an old envelope replayed by anyone cannot roll the weights back.
        """
        update = open_envelope(
            envelope, WeightUpdate, trusted_senders=self.trusted, check_expiry=False
        ).message
        if not is_newer(update.version, self.worker.engine.weights_version):
            return False
        try:
            return await self.apply_update(update)
        except StaleWeights:  # a newer version was swapped in meanwhile
            return False

    async def apply_update(self, update: WeightUpdate) -> bool:
        """Load a trainer-signed update (filesystem) or start fetching it (swarm: the
        engine swaps when the pieces are in); True if something started."""
        if not update.manifest:
            await self.worker.load_weights(update)
            return True
        if self.swarm is None:
            raise RequestRejected("this node runs no swarm peer: it cannot fetch by manifest")
        try:
            return self.swarm.want(update)
        except ValueError as exc:
            raise RequestRejected(f"weights update refused: {exc}") from exc

    def _weights_response(self) -> web.Response:
        engine = self.worker.engine
        return web.json_response(
            {"weights_version": engine.weights_version, "weights_hash": engine.weights_hash}
        )

    async def weights_update(self, request: web.Request) -> web.Response:
        opened = await self._open(request, WeightUpdate, self.trusted)
        update = opened.message
        require_newer(update.version, self.worker.engine.weights_version)  # 409
        await self.apply_update(update)
        return self._weights_response()

    async def weights_reload(self, request: web.Request) -> web.Response:
        """Re-read the current weights from disk (after a repair of the files, say)."""
        opened = await self._open(request, WeightReload, self.trusted)
        engine = self.worker.engine
        if opened.message.version != engine.weights_version:
            raise RequestRejected(
                f"node holds version {engine.weights_version}, not {opened.message.version}"
            )
        path = self.worker.weights_path or str(getattr(engine, "model_path", ""))
        update = WeightUpdate(version=engine.weights_version, path=path)
        await self.worker.load_weights(update, only_newer=False)  # the same version, again
        return self._weights_response()
