"""Honest rollouts verify on a second worker; every kind of cheating is rejected.

Real processes on loopback: node A generates (POST /v1/rollouts), node B verifies
(POST /v1/verify). Adversaries run in the test process on the same model files and send
their signed rollouts to B, as a cheating node would.
"""

from __future__ import annotations

import asyncio
import random
import statistics

import aiohttp
import pytest

from protocol.client import call
from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from protocol.messages import Rollout, RolloutRequest, SamplingParams, Verdict, VerifyRequest
from tests import adversaries as adv
from tests.conftest import random_chat_prompts

SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=64)


def make_requests(
    tokenizer, n: int, seed: int, sampling: SamplingParams = SAMPLING
) -> list[RolloutRequest]:
    rng = random.Random(seed)
    return [
        RolloutRequest(
            request_id=f"req-{seed}-{i}", prompt_ids=p, sampling=sampling, seed=rng.getrandbits(63)
        )
        for i, p in enumerate(random_chat_prompts(tokenizer, n, seed))
    ]


async def verify_all(
    verifier_url: str,
    scheduler: Identity,
    envelopes: list[bytes],
    requests: list[RolloutRequest],
    concurrency: int = 16,
) -> list[Verdict]:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:

        async def one(env: bytes, req: RolloutRequest) -> Verdict:
            async with sem:
                opened, _ = await call(
                    session,
                    f"{verifier_url}/v1/verify",
                    scheduler,
                    VerifyRequest(rollout_envelope=env, request=req),
                    Verdict,
                )
                return opened.message

        return await asyncio.gather(*(one(e, r) for e, r in zip(envelopes, requests, strict=True)))


async def generate_all(
    generator_url: str, scheduler: Identity, requests: list[RolloutRequest], concurrency: int = 32
) -> list[bytes]:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:

        async def one(req: RolloutRequest) -> bytes:
            async with sem:
                _, raw = await call(
                    session, f"{generator_url}/v1/rollouts", scheduler, req, Rollout
                )
                return raw

        return await asyncio.gather(*(one(r) for r in requests))


def rejection_rate(verdicts: list[Verdict]) -> float:
    return sum(not v.accepted for v in verdicts) / len(verdicts)


def test_honest_tiny_rollouts_verify_on_second_worker(tiny_pair, tiny_engine, report):
    a, b, _ = tiny_pair
    scheduler = Identity.generate()
    requests = make_requests(tiny_engine.tokenizer, 500, seed=1)
    envelopes = asyncio.run(generate_all(a.url, scheduler, requests))
    rollouts = [open_envelope(e, Rollout, check_expiry=False) for e in envelopes]
    assert all(r.sender_id == a.identity.node_id == r.message.node_id for r in rollouts)
    assert all(len(r.message.proof) >= 1 for r in rollouts)
    verdicts = asyncio.run(verify_all(b.url, scheduler, envelopes, requests))
    rejected = [v for v in verdicts if not v.accepted]
    assert all(v.verifier_id == b.identity.node_id for v in verdicts)
    worst = {c.name: c.metrics for c in verdicts[0].checks if c.metrics}
    report(
        "tiny honest rollouts",
        {
            "rollouts": len(verdicts),
            "false_rejections": len(rejected),
            "mean_completion_tokens": statistics.mean(
                len(r.message.completion_ids) for r in rollouts
            ),
            "example_metrics": worst,
        },
    )
    assert not rejected, [v.reasons for v in rejected[:5]]


def _adversaries(engine, other_engine) -> list[adv.Generator]:
    return [
        adv.OtherWeights(other_engine, claim_hash=engine.weights_hash),
        adv.PerturbedWeights(engine, scale=0.01),
        adv.EditedToken(engine),
        adv.ChangedPrompt(engine),
        adv.ProofFromOtherRollout(engine),
        adv.OtherSampling(engine, temperature=0.7),
        adv.OtherSampling(engine, top_p=0.8),
        adv.MadeUpLogprobs(engine),
    ]


@pytest.fixture(scope="module")
def other_tiny_engine():
    from node.config import EngineConfig
    from node.engines.torch_engine import TorchEngine

    return TorchEngine(EngineConfig(model="tiny", seed=1))


def check_cheats(b_url, engine, cheat, reqs, rng) -> tuple[list[Verdict], int]:
    """Verify a cheat's rollouts on B; every accepted one must be token for token what an
    honest node would have sent (a sample from the wrong distribution can coincide with
    the right one on a short completion: then nothing was gained and nothing can be seen).
    Returns the verdicts and how many coincided."""
    rollouts = cheat.rollouts(reqs, rng)
    envelopes = [seal(cheat.identity, r) for r in rollouts]
    verdicts = asyncio.run(verify_all(b_url, Identity.generate(), envelopes, reqs))
    accepted = [k for k, v in enumerate(verdicts) if v.accepted]
    if accepted:
        truth = adv.Generator(engine).rollouts([reqs[k] for k in accepted])
        for k, t in zip(accepted, truth, strict=True):
            assert rollouts[k].completion_ids == t.completion_ids, f"{cheat.name}: cheat accepted"
            assert rollouts[k].logprobs == pytest.approx(t.logprobs, abs=1e-4), (
                f"{cheat.name}: cheat accepted"
            )
    return verdicts, len(accepted)


# Cheats on the sampling parameters can coincide with honest output on short completions.
SAMPLING_CHEATS = ("other_temperature=0.7", "other_top_p=0.8")


def test_each_kind_of_cheating_is_rejected(tiny_pair, tiny_engine, other_tiny_engine, report):
    _, b, _ = tiny_pair
    n = 40
    rates, reasons, coincided = {}, {}, {}
    # Control: the same in-process path, honest, is accepted.
    reqs = make_requests(tiny_engine.tokenizer, n, seed=100)
    verdicts, _ = check_cheats(
        b.url, tiny_engine, adv.Generator(tiny_engine), reqs, random.Random(0)
    )
    assert rejection_rate(verdicts) == 0.0, [v.reasons for v in verdicts if not v.accepted][:3]
    for i, cheat in enumerate(_adversaries(tiny_engine, other_tiny_engine)):
        reqs = make_requests(tiny_engine.tokenizer, n, seed=200 + i)
        verdicts, same = check_cheats(b.url, tiny_engine, cheat, reqs, random.Random(i))
        rates[cheat.name] = rejection_rate(verdicts)
        reasons[cheat.name] = sorted({c.name for v in verdicts for c in v.checks if not c.passed})
        coincided[cheat.name] = same
    report("tiny rejection rates", rates)
    report("tiny failing checks", reasons)
    report("tiny cheats accepted because identical to the honest output", coincided)
    assert all(r == 1.0 for name, r in rates.items() if name not in SAMPLING_CHEATS), rates
    assert all(rates[name] >= 0.75 for name in SAMPLING_CHEATS), rates


def test_sampling_at_other_top_p_than_requested_is_caught(tiny_pair, tiny_engine, report):
    """Requested nucleus 0.9, sampled from the full distribution: tokens fall outside it."""
    _, b, _ = tiny_pair
    requested = SAMPLING.model_copy(update={"top_p": 0.9})
    reqs = make_requests(tiny_engine.tokenizer, 40, seed=300, sampling=requested)
    cheat = adv.OtherSampling(tiny_engine, top_p=1.0)
    verdicts, same = check_cheats(b.url, tiny_engine, cheat, reqs, random.Random(0))
    report(
        "tiny rejection rate, top_p 1.0 used for 0.9 requested",
        {"rate": rejection_rate(verdicts), "identical_to_honest": same},
    )
    assert rejection_rate(verdicts) >= 0.75


def test_perturbed_weights_noise_sweep(tiny_pair, tiny_engine, report):
    """Find the smallest relative weight noise that is still always caught."""
    _, b, _ = tiny_pair
    scheduler = Identity.generate()
    rates = {}
    for j, scale in enumerate([1e-2, 3e-3, 1e-3, 3e-4, 1e-4]):
        reqs = make_requests(tiny_engine.tokenizer, 20, seed=400 + j)
        cheat = adv.PerturbedWeights(tiny_engine, scale=scale)
        rates[scale] = rejection_rate(
            asyncio.run(verify_all(b.url, scheduler, cheat.signed(reqs), reqs))
        )
    smallest = min((s for s, r in rates.items() if r == 1.0), default=None)
    report("tiny perturbed-weights rejection rate by noise scale", rates)
    report("tiny smallest noise scale always caught", smallest)
    assert rates[1e-2] == 1.0 and smallest is not None


def test_forged_signature_and_impersonation_are_rejected(tiny_pair, tiny_engine):
    """A rollout signed by one key but naming another node is not run through the model."""
    a, b, _ = tiny_pair
    scheduler = Identity.generate()
    reqs = make_requests(tiny_engine.tokenizer, 1, seed=500)
    rollout = (
        adv.Generator(tiny_engine)
        .rollouts(reqs)[0]
        .model_copy(update={"node_id": a.identity.node_id})
    )
    forged = seal(Identity.generate(), rollout)
    verdict = asyncio.run(verify_all(b.url, scheduler, [forged], reqs))[0]
    assert not verdict.accepted and verdict.checks[0].name == "signature"
