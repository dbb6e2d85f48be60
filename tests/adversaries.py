"""Dishonest worker behaviours, for tests only.

Two layers:
- In-process `Generator` classes (used by the verification tests): each wraps the real
  torch engine (or a copy of it with other weights) and returns rollouts signed with its
  own key, exactly as a cheating node would send them, claiming the pool's weights hash.
  Behaviours: other weights, perturbed weights, one completion token edited, the prompt
  changed, the proof taken from another rollout, sampling at another temperature / top-p
  than requested, made-up logprobs.
- Whole dishonest nodes (`DISHONEST_WORKERS`, run by `python -m tests.adversary_node KIND
  <join flags>` or `tests.pools.Pool.join(name, dishonest=KIND)`): `Worker` subclasses
  inside the real `prime-node join` (server, registration, heartbeats, weight updates
  over the swarm, leave), each honest except for its one cheat, so they can join real
  training runs. The docstring of each class says what it does and what catches it.

Invariant: nothing here is imported by production code; production code offers at most
a documented class-attribute hook (`PoolNode.worker_cls`, `PoolNode.swarm_cls`,
`SwarmWeights.host_cls`).
"""

from __future__ import annotations

import asyncio
import copy
import os
import random
from collections.abc import Callable

import torch

from node.engines.base import GenerationRequest, InferenceEngine
from node.worker import make_rollout
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import MAX_SEED, Rollout, RolloutRequest, SamplingParams


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
# Each is a `Worker` subclass: the node around it (server, registration, heartbeats, the
# weight swarm) is the real one, exactly as a cheater would run it. Torch-heavy imports
# happen inside, so importing this module for the in-process classes stays as it was.
#
# Generator cheats verify honestly (with the real engine): they cheat where it pays, on
# the expensive side, and an honest node can then lose a dispute only if two verifiers
# lie. Every generator cheat's rollout is wrong in a way the calibrated tiny-model
# thresholds catch (the module-level constants below were measured for that).

# Relative Gaussian weight noise of `perturbed-weights`: 2x the smallest scale that the
# tiny-model thresholds (configs/verification/tiny-torch-cpu-fp32.toml) rejected on every
# rollout (measured, 80 rollouts each of 16 and of 64 tokens: 1e-3 caught 160/160, 7e-4
# missed 1 in 80, 5e-4 missed 10-20%, 3e-4 missed 90% of 16-token rollouts).
# On the SFT-warmed model's confident 12-token reverse-text answers it is weaker: 9 of 16
# rollouts at 2e-3 passed two honest verifiers (tests/swarm/test_faults.py sets 2e-2 via
# PRIME_PERTURB_SCALE there).
PERTURB_SCALE = float(os.environ.get("PRIME_PERTURB_SCALE", "2e-3"))
# Temperature `other-sampling` uses whatever was asked (it signs the requested one).
OTHER_TEMPERATURE = 0.3
# Seed of the random model `other-weights` generates with.
OTHER_WEIGHTS_SEED = 1234


def _resign(worker, signed, rollout: Rollout):
    from node.worker import SignedRollout

    return SignedRollout(rollout, seal(worker.identity, rollout, ttl_s=3600), signed.top_logprobs)


def _worker_base():
    from node.worker import Worker

    return Worker


class TamperedTokensWorker(_worker_base()):
    """Generates honestly, then edits one completion token and re-signs (keeps the proof).
    Caught by the verifier: the sampling replay (and the proof) disagree at that token."""

    async def generate(self, request, top_logprobs=0):
        signed = await super().generate(request, top_logprobs)
        r = signed.rollout
        ids = list(r.completion_ids)
        i = len(ids) // 2
        ids[i] = (ids[i] + 1) % self.engine.vocab_size
        return _resign(self, signed, r.model_copy(update={"completion_ids": ids}))


class ForgedProofWorker(_worker_base()):
    """Generates honestly, then sends a made-up proof (random bytes of the right size).
    Caught by the verifier's proof check."""

    async def generate(self, request, top_logprobs=0):
        signed = await super().generate(request, top_logprobs)
        r = signed.rollout
        rng = random.Random(r.seed)
        fake = [bytes(rng.randrange(256) for _ in range(len(c))) for c in r.proof]
        return _resign(self, signed, r.model_copy(update={"proof": fake}))


class ReplayedProofWorker(_worker_base()):
    """Generates honestly, but attaches the proof of its previous rollout instead of this
    one's (a cheater reusing proofs to skip building them). Its very first rollout gets
    the proof of a throwaway generation (another seed), so no rollout of it is ever
    honest. Caught by the verifier's proof check."""

    _last_proof: list[bytes] | None = None

    async def generate(self, request, top_logprobs=0):
        if self._last_proof is None:
            decoy = request.model_copy(update={"seed": (request.seed + 1) % (MAX_SEED + 1)})
            self._last_proof = (await super().generate(decoy)).rollout.proof
        signed = await super().generate(request, top_logprobs)
        r = signed.rollout
        old, self._last_proof = self._last_proof, r.proof
        proof = [old[min(i, len(old) - 1)] for i in range(len(r.proof))]
        return _resign(self, signed, r.model_copy(update={"proof": proof}))


class MadeUpLogprobsWorker(_worker_base()):
    """Generates honestly but reports invented logprobs (each 0.5 to 1.5 nats below the
    truth, as a node that never computed them might): they would poison the trainer's
    importance ratios. Caught by the verifier's logprob check."""

    async def generate(self, request, top_logprobs=0):
        signed = await super().generate(request, top_logprobs)
        r = signed.rollout
        rng = random.Random(r.seed)
        fake = [lp - rng.uniform(0.5, 1.5) for lp in r.logprobs]
        return _resign(self, signed, r.model_copy(update={"logprobs": fake}))


class OtherSamplingWorker(_worker_base()):
    """Samples at `OTHER_TEMPERATURE` whatever temperature was asked, and signs the
    requested sampling parameters. Caught by the verifier's sampling replay (and the
    logprob check: logprobs come from the tempered distribution)."""

    async def generate(self, request, top_logprobs=0):
        asked = request.sampling
        used = asked.model_copy(update={"temperature": OTHER_TEMPERATURE})
        signed = await super().generate(request.model_copy(update={"sampling": used}), top_logprobs)
        return _resign(self, signed, signed.rollout.model_copy(update={"sampling": asked}))


class _CheatEngineWorker(_worker_base()):
    """Generates with a cheat copy of the engine (`_cheat_engine`), rebuilt from the real
    one whenever the real engine's weights change (weight updates load into the real
    engine as usual); claims the real engine's version and hash; verifies honestly."""

    _cheat = None
    _cheat_for = ""

    def _cheat_engine(self, engine):
        raise NotImplementedError

    def _generate_batch(self, requests):
        from node.worker import Generated

        # Engine thread: weight swaps run on it too, so the copy cannot race a load.
        real = self.engine
        if self._cheat is None or self._cheat_for != real.weights_hash:
            self._cheat, self._cheat_for = self._cheat_engine(real), real.weights_hash
        version, weights_hash = real.weights_version, real.weights_hash
        return [Generated(r, version, weights_hash) for r in self._cheat.generate(requests)]


def _with_model(engine, model):
    """A shallow copy of a torch engine that runs `model` (same tokenizer, device, lock)."""
    bad = copy.copy(engine)
    bad.model = model.eval()
    bad.dtype = next(model.parameters()).dtype
    bad.base = model.get_decoder()
    bad.lm_head = model.get_output_embeddings()
    return bad


class OtherWeightsWorker(_CheatEngineWorker):
    """Generates with another random model of the same architecture (seeded
    `OTHER_WEIGHTS_SEED`), claiming the pool's weights. Caught by the proof check (and the
    logprob and sampling checks)."""

    def _cheat_engine(self, engine):
        from transformers import AutoModelForCausalLM

        with torch.random.fork_rng():
            torch.manual_seed(OTHER_WEIGHTS_SEED)
            model = AutoModelForCausalLM.from_config(engine.model.config)
        return _with_model(engine, model.to(device=engine.device, dtype=engine.dtype))


class PerturbedWeightsWorker(_CheatEngineWorker):
    """Generates with the pool's weights plus Gaussian noise of `PERTURB_SCALE` x each
    tensor's std (re-drawn on every weight update). Caught by the logprob and proof
    checks."""

    def _cheat_engine(self, engine):
        return perturbed_engine(engine, PERTURB_SCALE, seed=OTHER_WEIGHTS_SEED)


class LowerPrecisionWorker(_CheatEngineWorker):
    """Runs the pool's weights in bfloat16 (about half the cost on most hardware) while
    the pool computes in fp32, and claims fp32 results. The calibrated tiny-model fp32
    thresholds catch every bf16 rollout (measured 30/30: logprob, proof and sampling
    checks). NOT reliably caught: the same cheat in float16 (`dtype = torch.float16`):
    only 63% of 16-token rollouts were rejected (logprob check only), so a pool cannot
    count on catching fp16 with these thresholds."""

    dtype = torch.bfloat16

    def _cheat_engine(self, engine):
        return _with_model(engine, copy.deepcopy(engine.model).to(self.dtype))


class _StaleEngine:
    """A real engine that never swaps weights in: `load_weights` only records the version
    and hash it was asked to load, which the engine then claims to serve."""

    def __init__(self, engine):
        self._real = engine
        self.weights_version = engine.weights_version
        self.weights_hash = engine.weights_hash

    def __getattr__(self, name):  # everything else is the real engine's
        return getattr(self._real, name)

    def load_weights(self, path, version: int, weights_hash: str = "") -> None:
        from node.engines.base import hash_weights_dir

        self.weights_version = version
        self.weights_hash = weights_hash or hash_weights_dir(path)


class WrongVersionWorker(_worker_base()):
    """Fetches every weight update over the swarm like an honest node (and seeds it) but
    never loads it: it keeps generating (and verifying) with the weights it started with
    while claiming the newest version and its hash in heartbeats and rollouts. Caught by
    the verifier, who holds the weights of the claimed hash (proof, logprob checks), as
    long as the versions differ by more than the thresholds' tolerance; a claim of a
    (version, hash) pair the trainer never published is caught by the scheduler itself."""

    def __init__(self, engine, *args, **kwargs):
        super().__init__(_StaleEngine(engine), *args, **kwargs)


class SilentWorker(_worker_base()):
    """Takes generation requests and never answers them, while heartbeating (and
    verifying) normally. The scheduler times the calls out, sends the work elsewhere and
    benches the node after repeated timeouts."""

    async def generate(self, request, top_logprobs=0):
        await asyncio.sleep(10**9)
        raise AssertionError("unreachable")


class SlowWorker(_worker_base()):
    """An honest straggler: waits `PRIME_SLOW_S` seconds (default 2) before each
    generation. Must never be punished."""

    async def generate(self, request, top_logprobs=0):
        await asyncio.sleep(float(os.environ.get("PRIME_SLOW_S", "2")))
        return await super().generate(request, top_logprobs)


class RejectAllVerifier(_worker_base()):
    """Generates honestly but rejects every rollout it is asked to verify, unchecked.
    Disputes prove it wrong (a judge accepts the honest rollouts it rejected)."""

    async def verify(self, request):
        return self._verdict(request, accepted=False)

    def _verdict(self, request, accepted: bool):
        from protocol.envelope import open_envelope
        from protocol.messages import CheckResult, Verdict

        rollout = open_envelope(request.rollout_envelope, Rollout, check_expiry=False).message
        detail = "(accepts everything)" if accepted else "(rejects everything)"
        verdict = Verdict(
            request_id=rollout.request_id,
            rollout_digest=rollout.digest(),
            generator_id=rollout.node_id,
            verifier_id=self.node_id,
            weights_hash=self.engine.weights_hash,
            accepted=accepted,
            checks=[CheckResult(name="proof", passed=accepted, detail=detail)],
        )
        return verdict, seal(self.identity, verdict, ttl_s=3600)


class AcceptAllVerifier(RejectAllVerifier):
    """Generates honestly but accepts every rollout it is asked to verify, unchecked (it
    saves the prefill, or vouches for an accomplice). Caught by audits
    (`VerificationPolicy.audit_rate`): when a cheater's rollout it accepted is rejected by
    the auditor and the judge, it loses reputation like the cheater."""

    async def verify(self, request):
        return self._verdict(request, accepted=True)


def _corrupting_swarm():
    """The node's weight-swarm peer with a host that corrupts every piece it uploads."""
    from node.swarm_weights import SwarmWeights
    from protocol.swarm.host import SwarmHost
    from protocol.swarm.store import PieceStore

    class CorruptingStore(PieceStore):
        def read(self, index: int) -> bytes:
            data = bytearray(super().read(index))
            data[len(data) // 2] ^= 0xFF  # one flipped byte: the piece hash no longer matches
            return bytes(data)

    class CorruptingHost(SwarmHost):
        async def _add(self, manifest, envelope, store):
            # Downloads are stored honestly (`put` checks hashes); only uploads are corrupt.
            store.__class__ = CorruptingStore
            return await super()._add(manifest, envelope, store)

    return type("CorruptingSwarmWeights", (SwarmWeights,), {"host_cls": CorruptingHost})


class CorruptPiecesWorker(_worker_base()):
    """An honest generator and verifier whose weight-swarm peer serves corrupted pieces
    (one flipped byte in every piece it uploads); what it downloads and loads is correct.
    Its peers ban it at the first bad piece (every piece is hash-checked) and still load
    the weights from the others. `swarm_cls` is read by tests/adversary_node.py."""

    @staticmethod
    def swarm_cls():
        return _corrupting_swarm()


DISHONEST_WORKERS = {
    # generator cheats (verify honestly)
    "other-weights": OtherWeightsWorker,
    "perturbed-weights": PerturbedWeightsWorker,
    "lower-precision": LowerPrecisionWorker,
    "tampered-tokens": TamperedTokensWorker,
    "forged-proof": ForgedProofWorker,
    "replayed-proof": ReplayedProofWorker,
    "made-up-logprobs": MadeUpLogprobsWorker,
    "other-sampling": OtherSamplingWorker,
    "wrong-version": WrongVersionWorker,
    # verifier cheats (generate honestly)
    "reject-all": RejectAllVerifier,
    "accept-all": AcceptAllVerifier,
    # other
    "corrupt-pieces": CorruptPiecesWorker,
    "silent": SilentWorker,
    "slow": SlowWorker,  # honest
}
GENERATOR_CHEATS = (
    "other-weights",
    "perturbed-weights",
    "lower-precision",
    "tampered-tokens",
    "forged-proof",
    "replayed-proof",
    "made-up-logprobs",
    "other-sampling",
    "wrong-version",
)
