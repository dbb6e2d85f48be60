"""Dishonest worker behaviours, for tests only.

Each adversary wraps the real torch engine (or a copy of it with other weights) and
returns rollouts signed with its own key, exactly as a cheating node would send them.
All of them claim the pool's weights hash, as a cheater would.

Behaviours: other weights, perturbed weights, one completion token edited, the prompt
changed, the proof taken from another rollout, sampling at another temperature / top-p
than requested, made-up logprobs.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable

import torch

from node.engines.base import GenerationRequest, InferenceEngine
from node.worker import make_rollout
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import Rollout, RolloutRequest, SamplingParams


class Generator:
    """Honest generation in-process: what an honest node does, minus HTTP."""

    name = "honest"

    def __init__(
        self,
        engine: InferenceEngine,
        identity: Identity | None = None,
        claim_hash: str | None = None,
    ):
        self.engine = engine
        self.identity = identity or Identity.generate()
        self.claim_hash = claim_hash or engine.weights_hash

    def _prompt(self, req: RolloutRequest) -> list[int]:
        return req.prompt_ids

    def _sampling(self, req: RolloutRequest) -> SamplingParams:
        return req.sampling

    def _tamper(self, rollouts: list[Rollout], rng: random.Random) -> list[Rollout]:
        return rollouts

    def rollouts(
        self, requests: list[RolloutRequest], rng: random.Random | None = None
    ) -> list[Rollout]:
        gens = self.engine.generate(
            [GenerationRequest(self._prompt(r), self._sampling(r), r.seed) for r in requests]
        )
        out = [
            make_rollout(r, g, self.identity.node_id, 0, self.claim_hash)
            for r, g in zip(requests, gens, strict=True)
        ]
        return self._tamper(out, rng or random.Random(0))

    def signed(
        self, requests: list[RolloutRequest], rng: random.Random | None = None
    ) -> list[bytes]:
        return [seal(self.identity, r, ttl_s=3600) for r in self.rollouts(requests, rng)]


class OtherWeights(Generator):
    """Generates with another model entirely (e.g. a cheaper one) but claims the pool's."""

    name = "other_weights"


def perturbed_engine(engine, scale: float, seed: int = 0):
    """A copy of a torch engine whose weights carry Gaussian noise of `scale` x each tensor's std."""
    bad = copy.copy(engine)
    bad.model = copy.deepcopy(engine.model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in bad.model.parameters():
            std = p.float().std() if p.numel() > 1 else p.abs().float()
            p.add_((torch.randn(p.shape, generator=gen) * std * scale).to(p.dtype))
    bad.base = bad.model.get_decoder()
    bad.lm_head = bad.model.get_output_embeddings()
    return bad


class PerturbedWeights(Generator):
    name = "perturbed_weights"

    def __init__(self, engine, scale: float, **kw):
        super().__init__(perturbed_engine(engine, scale), claim_hash=engine.weights_hash, **kw)
        self.scale = scale


class EditedToken(Generator):
    """Changes one completion token after the fact, keeping proof and logprobs."""

    name = "edited_token"

    def _tamper(self, rollouts, rng):
        vocab = self.engine.vocab_size
        out = []
        for r in rollouts:
            ids = list(r.completion_ids)
            k = rng.randrange(len(ids) - 1) if len(ids) > 1 else 0
            ids[k] = (ids[k] + rng.randrange(1, vocab)) % vocab
            while ids[k] in self.engine.eos_token_ids:
                ids[k] = (ids[k] + 1) % vocab
            out.append(r.model_copy(update={"completion_ids": ids}))
        return out


class ChangedPrompt(Generator):
    """Generates from another prompt (one token replaced) and claims the requested one."""

    name = "changed_prompt"

    def _prompt(self, req):
        ids = list(req.prompt_ids)
        k = len(ids) // 2
        ids[k] = (ids[k] + 7) % self.engine.vocab_size
        return ids


class ProofFromOtherRollout(Generator):
    """Attaches the proof of another rollout (a cached or cheaper one)."""

    name = "proof_from_other_rollout"

    def _tamper(self, rollouts, rng):
        out = []
        for i, r in enumerate(rollouts):
            donor = rollouts[(i + 1) % len(rollouts)] if len(rollouts) > 1 else r
            proof = list(donor.proof[: len(r.proof)])
            while len(proof) < len(r.proof):
                proof.append(donor.proof[-1])
            if donor is r:  # single rollout: corrupt its own proof instead
                proof = [bytes(reversed(p[:2])) + p[2:] for p in proof]
            out.append(r.model_copy(update={"proof": proof}))
        return out


class OtherSampling(Generator):
    """Samples with other parameters than requested (e.g. colder, for easier text)."""

    name = "other_sampling"

    def __init__(self, engine, **changes):
        super().__init__(engine)
        self.changes = changes
        self.name = "other_" + "_".join(f"{k}={v}" for k, v in changes.items())

    def _sampling(self, req):
        return req.sampling.model_copy(update=self.changes)


class MadeUpLogprobs(Generator):
    """Reports invented logprobs (they poison the trainer's importance ratios)."""

    name = "made_up_logprobs"

    def __init__(self, engine, fake: Callable[[float, random.Random], float] | None = None):
        super().__init__(engine)
        self.fake = fake or (lambda lp, rng: min(0.0, lp + rng.uniform(-1.0, 1.0)))

    def _tamper(self, rollouts, rng):
        return [
            r.model_copy(update={"logprobs": [self.fake(x, rng) for x in r.logprobs]})
            for r in rollouts
        ]


# -- dishonest nodes as whole processes (`python -m tests.adversary_node KIND join ...`) --
# Each is a `Worker` subclass: the node around it (server, registration, heartbeats) is
# the real one, exactly as a cheater would run it.


def _resign(worker, signed, rollout: Rollout):
    from node.worker import SignedRollout

    return SignedRollout(rollout, seal(worker.identity, rollout, ttl_s=3600), signed.top_logprobs)


def _worker_base():
    from node.worker import Worker

    return Worker


class TamperedTokensWorker(_worker_base()):
    """Generates honestly, then edits one completion token and re-signs (keeps the proof)."""

    async def generate(self, request, top_logprobs=0):
        signed = await super().generate(request, top_logprobs)
        r = signed.rollout
        ids = list(r.completion_ids)
        i = len(ids) // 2
        ids[i] = (ids[i] + 1) % self.engine.vocab_size
        return _resign(self, signed, r.model_copy(update={"completion_ids": ids}))


class ForgedProofWorker(_worker_base()):
    """Generates honestly, then sends a made-up proof (random bytes of the right size)."""

    async def generate(self, request, top_logprobs=0):
        signed = await super().generate(request, top_logprobs)
        r = signed.rollout
        rng = random.Random(r.seed)
        fake = [bytes(rng.randrange(256) for _ in range(len(c))) for c in r.proof]
        return _resign(self, signed, r.model_copy(update={"proof": fake}))


class RejectAllVerifier(_worker_base()):
    """Generates honestly but rejects every rollout it is asked to verify, unchecked."""

    async def verify(self, request):
        from protocol.envelope import open_envelope
        from protocol.messages import CheckResult, Verdict

        rollout = open_envelope(request.rollout_envelope, Rollout, check_expiry=False).message
        verdict = Verdict(
            request_id=rollout.request_id,
            rollout_digest=rollout.digest(),
            generator_id=rollout.node_id,
            verifier_id=self.node_id,
            weights_hash=self.engine.weights_hash,
            accepted=False,
            checks=[CheckResult(name="proof", passed=False, detail="(rejects everything)")],
        )
        return verdict, seal(self.identity, verdict, ttl_s=3600)


DISHONEST_WORKERS = {
    "tampered-tokens": TamperedTokensWorker,
    "forged-proof": ForgedProofWorker,
    "reject-all": RejectAllVerifier,
}
