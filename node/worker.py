"""The worker's core, independent of HTTP: generate signed rollouts, verify others'.

Owns the engine (through two batchers that share one engine thread), the node identity
and the verification thresholds. Invariants:
- Every rollout leaves signed by this node's key, with its proof, the seed and
  sampling params it was asked for, and the weights version/hash it was generated with.
- A verdict is computed only from the verifier's own prefill of the claimed tokens; the
  generator's signature is checked first, and a rollout whose signer is not the node it
  names is rejected without running the model.
- Requests that cannot fit (prompt + max_tokens > max_model_len, token id outside the
  vocabulary) are refused before they reach the engine.
- Weights only move forward: `is_newer` is the one rule (a version newer than the one
  held), checked by every caller before it fetches or loads, and by `load_weights` on the
  engine thread right before the swap, so two updates racing never leave the older one
  loaded. Only an explicit reload of the version held (`only_newer=False`) is exempt.

Accounting: `busy_s` holds the seconds this node has spent on each kind of work since it
started: `generate` (engine generation batches, then building each rollout's proof) and
`verify` (engine prefill + sampling replay batches, then each verdict's checks). Wall
time of the work itself, queueing excluded; the engine thread and the post-processing
threads may overlap, so the sum can exceed wall time on a busy node. The server reports
it on `GET /health`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from node.batcher import Batcher
from node.config import EngineConfig
from node.engines.base import GenerationRequest, GenerationResult, InferenceEngine
from node.proof_pool import ProofPool
from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from protocol.messages import (
    CheckResult,
    Rollout,
    RolloutRequest,
    Verdict,
    VerificationPolicy,
    VerifyRequest,
    WeightUpdate,
)
from verifier.checks import check_rollout, check_rollout_proofs, replay_rollouts
from verifier.proofs import ProofCheck, build_proof, build_proofs
from verifier.sampling import ReplayResult

T = TypeVar("T")
log = logging.getLogger("prime.node.worker")


class RequestRejected(ValueError):
    """A request the engine must not run (too long, bad token ids)."""


class StaleWeights(RequestRejected):
    """A weights update not newer than the version the node holds (HTTP 409)."""


def is_newer(version: int, held: int) -> bool:
    """The rule for every weights update, whoever brings it: a node moves only to a
    version newer than the one it holds (a replayed or late update never rolls it back)."""
    return version > held


def require_newer(version: int, held: int) -> None:
    """`is_newer`, or `StaleWeights` saying why not."""
    if not is_newer(version, held):
        raise StaleWeights(
            f"this node holds weights version {held}: it loads only a newer one, not {version}"
        )


@dataclass
class Generated:
    """One generation result and the weights version it was produced with."""

    result: GenerationResult
    version: int
    weights_hash: str
    proof: list[bytes] | None = None  # built on the engine's GPU with the batch, else later


@dataclass
class Replayed:
    """The verifier's side of one rollout: replay results, hidden rows, weights used."""

    replay: ReplayResult | None
    hidden_states: torch.Tensor | None  # for the proof check, when not done in the batch
    weights_hash: str
    proof_check: ProofCheck | None = None  # the batch's proof check (on a GPU)


@dataclass
class SignedRollout:
    rollout: Rollout
    envelope: bytes
    top_logprobs: list[list[tuple[int, float]]] | None = None


def make_rollout(
    request: RolloutRequest,
    result: GenerationResult,
    node_id: str,
    version: int,
    weights_hash: str,
    proof: list[bytes] | None = None,
) -> Rollout:
    """The rollout answering `request`, with its TOPLOC proof of `result`'s rows (`proof`
    when already built, e.g. by a `ProofPool`, else built here)."""
    return Rollout(
        request_id=request.request_id,
        pool_id=request.pool_id,
        node_id=node_id,
        prompt_ids=request.prompt_ids,
        completion_ids=result.completion_ids,
        logprobs=result.logprobs,
        finish_reason=result.finish_reason,
        sampling=request.sampling,
        seed=request.seed,
        weights_version=version,
        weights_hash=weights_hash,
        proof_params=request.proof,
        proof=build_proof(result.hidden_states, request.proof) if proof is None else proof,
    )


class Worker:
    def __init__(
        self,
        engine: InferenceEngine,
        identity: Identity,
        policy: VerificationPolicy,
        *,
        max_batch_size: int,
        batch_wait_s: float,
        max_model_len: int,
        pool_id: str = "local",
        proof_processes: int = 0,
    ):
        self.engine = engine
        self.identity = identity
        self.policy = policy
        self.max_model_len = max_model_len
        self.pool_id = pool_id
        self.weights_path: str | None = None  # folder of the last update loaded
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.proofs = ProofPool(proof_processes)
        self.swaps_waiting = 0  # weight swaps queued behind the running generation
        # Proofs built and checked batched on the GPU (`verifier.proof_batch`) go with the
        # slot decode: its top-k may break ties between equal |values| unlike toploc's CPU
        # top-k, and the shipped CUDA thresholds were fitted to toploc on both sides.
        self.gpu_proofs = getattr(engine, "decode", "loop") == "slots"
        self.gen_batcher: Batcher[GenerationRequest, Generated] = Batcher(
            self._generate_stream,
            self.executor,
            max_batch_size,
            batch_wait_s,
            streaming=True,
            hold=lambda: self.swaps_waiting > 0,
        )
        self.prefill_batcher: Batcher[Rollout, Replayed] = Batcher(
            self._prefill_and_replay, self.executor, max_batch_size, batch_wait_s
        )
        self.stats = {
            "generated": 0,
            "generated_tokens": 0,
            "verified": 0,
            "accepted": 0,
            "rejected": 0,
        }
        # Tokens of accepted requests not answered yet (prompt + max_tokens for a generation,
        # prompt + completion for a verification): the load the node reports to the scheduler.
        self.outstanding_tokens = 0
        # Seconds of work by kind (module docstring); added to from several threads.
        self.busy_s = {"generate": 0.0, "verify": 0.0}
        self._busy_lock = threading.Lock()

    @classmethod
    def from_config(
        cls,
        engine: InferenceEngine,
        identity: Identity,
        policy: VerificationPolicy,
        cfg: EngineConfig,
        pool_id: str,
    ) -> Worker:
        """The worker of `engine` with every worker-side setting of `cfg` (the engine
        itself was built from the same `cfg`)."""
        return cls(
            engine,
            identity,
            policy,
            max_batch_size=cfg.max_batch_size,
            batch_wait_s=cfg.batch_wait_ms / 1000,
            max_model_len=cfg.max_model_len,
            pool_id=pool_id,
            proof_processes=cfg.proof_processes,
        )

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    @property
    def settings(self) -> dict[str, float | int]:
        """The settings this worker runs with, read off its parts (for `/health`)."""
        return {
            "max_batch_size": self.gen_batcher.max_batch,
            "batch_wait_ms": round(self.gen_batcher.wait_s * 1000, 3),
            "max_model_len": self.max_model_len,
            "proof_processes": self.proofs.processes,
        }

    def start(self) -> None:
        self.gen_batcher.start()
        self.prefill_batcher.start()

    async def stop(self) -> None:
        await self.gen_batcher.stop()
        await self.prefill_batcher.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.proofs.close()

    def _timed(self, kind: Literal["generate", "verify"], fn: Callable[[], T]) -> T:
        """Run `fn` and add its wall time to `busy_s[kind]`."""
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            with self._busy_lock:
                self.busy_s[kind] += time.perf_counter() - t0

    @property
    def outstanding(self) -> int:
        return self.gen_batcher.pending + self.prefill_batcher.pending

    def _check_tokens(self, ids: list[int], what: str) -> None:
        vocab = self.engine.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(
                f"{what} has token id {bad[0]} outside the vocabulary (size {vocab})"
            )

    # -- generation ----------------------------------------------------------------
    async def generate(self, request: RolloutRequest, top_logprobs: int = 0) -> SignedRollout:
        total = len(request.prompt_ids) + request.sampling.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.sampling.max_tokens}) "
                f"exceeds max_model_len {self.max_model_len}"
            )
        self._check_tokens(request.prompt_ids, "prompt")
        self.outstanding_tokens += total
        try:
            done = await self.gen_batcher.submit(
                GenerationRequest(
                    request.prompt_ids, request.sampling, request.seed, top_logprobs, request.proof
                )
            )
            result = done.result
            t0 = time.perf_counter()
            proof = done.proof or await self.proofs.build(result.hidden_states, request.proof)
            rollout = make_rollout(
                request, result, self.node_id, done.version, done.weights_hash, proof
            )
            with self._busy_lock:
                self.busy_s["generate"] += time.perf_counter() - t0
        finally:
            self.outstanding_tokens -= total
        self.stats["generated"] += 1
        self.stats["generated_tokens"] += len(result.completion_ids)
        return SignedRollout(rollout, seal(self.identity, rollout, ttl_s=3600), result.top_logprobs)

    def _generate_stream(self, requests: list[GenerationRequest], more, deliver) -> None:
        """Engine thread: one continuous-batching run; requests queued meanwhile join it
        (`Batcher` streaming mode). The version read here is the one the run uses: a swap
        waits on this thread, and `more` hands out nothing once one is waiting."""
        version, weights_hash = self.engine.weights_version, self.engine.weights_hash
        handed = dict(enumerate(requests))

        def more_(k: int) -> list[tuple[int, GenerationRequest]]:
            got = more(k)
            handed.update(got)
            return got

        def emit(group: list[tuple[int, GenerationResult]]) -> None:
            proofs = self._proofs_on_device([handed[i] for i, _ in group], [r for _, r in group])
            for (i, result), proof in zip(group, proofs, strict=True):
                deliver(i, Generated(result, version, weights_hash, proof))

        self._timed("generate", lambda: self.engine.generate_stream(requests, more_, emit))

    def _proofs_on_device(
        self, requests: list[GenerationRequest], results: list[GenerationResult]
    ) -> list[list[bytes] | None]:
        """Rows an engine left on its GPU: every proof of the group in one batched pass
        there (None where the rows are on the CPU: `ProofPool` builds those)."""
        proofs: list[list[bytes] | None] = [None] * len(results)
        on_gpu = [
            i
            for i, (q, r) in enumerate(zip(requests, results, strict=True))
            if q.proof is not None and r.hidden_states.device.type != "cpu"
        ]
        if on_gpu:
            rows = torch.cat([results[i].hidden_states for i in on_gpu])
            sizes = [results[i].hidden_states.shape[0] for i in on_gpu]
            built = build_proofs(rows, sizes, [requests[i].proof for i in on_gpu])
            for i, proof in zip(on_gpu, built, strict=True):
                proofs[i] = proof
        return proofs

    async def load_weights(self, update: WeightUpdate, *, only_newer: bool = True) -> None:
        """Swap `update`'s weights in (the caller checked who signed it) on the engine
        thread, between generation runs: a running one stops taking new requests,
        finishes the ones it holds, then the swap runs. The version is checked there,
        against the one held at that moment (`StaleWeights`); a folder that cannot be
        loaded is a `RequestRejected`."""

        def swap() -> None:
            if only_newer:
                require_newer(update.version, self.engine.weights_version)
            self.engine.load_weights(update.path, update.version, update.weights_hash)

        self.swaps_waiting += 1
        try:
            await asyncio.get_running_loop().run_in_executor(self.executor, swap)
        except StaleWeights:
            raise
        except (FileNotFoundError, ValueError, RuntimeError) as exc:
            raise RequestRejected(f"cannot load weights from {update.path}: {exc}") from exc
        finally:
            self.swaps_waiting -= 1
        self.weights_path = update.path
        log.info(
            "loaded weights version %d (%s)",
            self.engine.weights_version,
            self.engine.weights_hash[:12],
        )

    # -- verification --------------------------------------------------------------
    def _prefill_and_replay(self, rollouts: list[Rollout]) -> list[Replayed]:
        """Engine thread: one prefill and one batched sampling replay for a batch of rollouts."""
        weights_hash = self.engine.weights_hash  # under the engine thread: no swap in between

        def run() -> list[Replayed]:
            batch = self.engine.prefill_batch([(r.prompt_ids, r.completion_ids) for r in rollouts])
            reps = replay_rollouts(rollouts, batch.logits, self.policy.support_tolerance)
            if not self.gpu_proofs or batch.rows.device.type == "cpu":
                # toploc checks each proof later, per rollout, on the CPU
                return [
                    Replayed(rep, rows, weights_hash)
                    for rep, rows in zip(reps, batch.rows.cpu().split(batch.sizes), strict=True)
                ]
            checks = check_rollout_proofs(rollouts, batch.rows, batch.sizes, self.policy)
            return [
                Replayed(rep, None, weights_hash, pc) for rep, pc in zip(reps, checks, strict=True)
            ]

        return self._timed("verify", run)

    async def verify(self, request: VerifyRequest) -> tuple[Verdict, bytes]:
        """Judge someone else's rollout; returns the verdict and its signed envelope."""
        opened = open_envelope(request.rollout_envelope, Rollout, check_expiry=False)
        rollout = opened.message
        if opened.sender_id != rollout.node_id:
            checks = [
                CheckResult(
                    name="signature",
                    passed=False,
                    detail=f"signed by {opened.sender_id}, claims to be from {rollout.node_id}",
                )
            ]
        elif (
            request.expected_weights_hash
            and request.expected_weights_hash != self.engine.weights_hash
        ):
            raise RequestRejected(
                f"this node holds weights {self.engine.weights_hash[:12]}, not {request.expected_weights_hash[:12]}"
            )
        elif len(rollout.prompt_ids) + len(rollout.completion_ids) > self.max_model_len:
            checks = [CheckResult(name="request", passed=False, detail="longer than max_model_len")]
        elif max(rollout.prompt_ids + rollout.completion_ids) >= self.engine.vocab_size:
            checks = [
                CheckResult(name="support", passed=False, detail="token id outside the vocabulary")
            ]
        else:
            tokens = len(rollout.prompt_ids) + len(rollout.completion_ids)
            self.outstanding_tokens += tokens
            try:
                done = await self.prefill_batcher.submit(rollout)
            finally:
                self.outstanding_tokens -= tokens
            tok = self.engine.tokenizer
            checks = await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: self._timed(
                    "verify",
                    lambda: check_rollout(
                        rollout,
                        done.replay,
                        done.hidden_states,
                        self.policy,
                        weights_hash=done.weights_hash,
                        eos_ids=self.engine.eos_token_ids,
                        decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
                        request=request.request,
                        proof_check=done.proof_check,
                    ),
                ),
            )
        verdict = Verdict(
            request_id=rollout.request_id,
            rollout_digest=rollout.digest(),
            generator_id=rollout.node_id,
            verifier_id=self.node_id,
            weights_hash=self.engine.weights_hash,
            accepted=all(c.passed for c in checks),
            checks=checks,
        )
        self.stats["verified"] += 1
        self.stats["accepted" if verdict.accepted else "rejected"] += 1
        return verdict, seal(self.identity, verdict, ttl_s=3600)
