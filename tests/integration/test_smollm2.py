"""The bundled real model, SmolLM2-135M-Instruct, end to end on two real nodes.

Honest rollouts at temperature 1 verify on a second worker with the calibrated CPU
thresholds, the OpenAI client gets a sensible answer, and the cheats that matter most on
a real model (perturbed weights, an edited token, a changed prompt, a colder sampler)
are rejected.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from openai import OpenAI

from protocol.envelope import seal
from protocol.identity import Identity
from tests import adversaries as adv
from tests.integration.test_verification import SAMPLING, generate_all, rejection_rate, verify_all
from tests.nodes import REPO, start_node

pytestmark = pytest.mark.slow
THRESHOLDS = REPO / "configs" / "verification" / "smollm2-torch-cpu-fp32.toml"


@pytest.fixture(scope="module")
def smol_pair(tmp_path_factory):
    from verifier.models import resolve_model

    resolve_model("smollm2")  # dequantize once, before two processes race for it
    work = tmp_path_factory.mktemp("smol")
    a = start_node(work, "a", "--engine.model", "smollm2", "--engine.max-batch-size", "25")
    b = start_node(work, "b", "--engine.model", "smollm2", "@", str(THRESHOLDS))
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(scope="module")
def smol_engine():
    from node.config import EngineConfig
    from node.engines.torch_engine import TorchEngine

    return TorchEngine(EngineConfig(model="smollm2"))


def _requests(tokenizer, n, seed):
    from protocol.messages import RolloutRequest

    rng = random.Random(seed)
    topics = [
        "the sea",
        "prime numbers",
        "copper",
        "a sunrise",
        "Paris",
        "tea",
        "bees",
        "the sky",
        "trains",
    ]
    prompts = []
    for _ in range(n):
        msgs = [{"role": "user", "content": f"Write one sentence about {rng.choice(topics)}."}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return [
        RolloutRequest(
            request_id=f"smol-{seed}-{i}", prompt_ids=p, sampling=SAMPLING, seed=rng.getrandbits(63)
        )
        for i, p in enumerate(prompts)
    ]


def test_smollm2_answers_the_openai_client(smol_pair):
    a, _ = smol_pair
    client = OpenAI(base_url=f"{a.url}/v1", api_key="unused", max_retries=0)
    resp = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    assert "Paris" in resp.choices[0].message.content


def test_smollm2_honest_rollouts_verify(smol_pair, smol_engine, report):
    a, b = smol_pair
    scheduler = Identity.generate()
    requests = _requests(smol_engine.tokenizer, 50, seed=1)
    envelopes = asyncio.run(generate_all(a.url, scheduler, requests, concurrency=25))
    verdicts = asyncio.run(verify_all(b.url, scheduler, envelopes, requests, concurrency=25))
    rejected = [v.reasons for v in verdicts if not v.accepted]
    report(
        "smollm2 honest rollouts", {"rollouts": len(verdicts), "false_rejections": len(rejected)}
    )
    assert not rejected, rejected[:3]


def test_smollm2_cheats_are_rejected(smol_pair, smol_engine, report):
    _, b = smol_pair
    scheduler = Identity.generate()
    cheats = [
        adv.PerturbedWeights(smol_engine, scale=0.01),
        adv.EditedToken(smol_engine),
        adv.ChangedPrompt(smol_engine),
        adv.ProofFromOtherRollout(smol_engine),
        adv.OtherSampling(smol_engine, temperature=0.7),
        adv.MadeUpLogprobs(smol_engine),
    ]
    rates = {}
    for i, cheat in enumerate(cheats):
        reqs = _requests(smol_engine.tokenizer, 8, seed=10 + i)
        envelopes = [seal(cheat.identity, r) for r in cheat.rollouts(reqs, random.Random(i))]
        rates[cheat.name] = rejection_rate(
            asyncio.run(verify_all(b.url, scheduler, envelopes, reqs))
        )
    report("smollm2 rejection rates", rates)
    assert all(r == 1.0 for r in rates.values()), rates


def test_smollm2_smallest_weight_noise_still_caught(smol_pair, smol_engine, report):
    """Relative Gaussian noise on every weight tensor down to 1e-3 x std is rejected on every
    rollout. Where smaller noise slips through one rollout at a time (and how many rollouts
    the per-node evidence needs for it) is measured by tests/bench/bench_trust.py: a sweep
    further down here asserted nothing and cost the suite two minutes."""
    _, b = smol_pair
    scheduler = Identity.generate()
    rates = {}
    for j, scale in enumerate([1e-2, 1e-3]):
        reqs = _requests(smol_engine.tokenizer, 6, seed=40 + j)
        cheat = adv.PerturbedWeights(smol_engine, scale=scale)
        envelopes = [seal(cheat.identity, r) for r in cheat.rollouts(reqs)]
        rates[scale] = rejection_rate(asyncio.run(verify_all(b.url, scheduler, envelopes, reqs)))
        del cheat
    always = [s for s, r in rates.items() if r == 1.0]
    report("smollm2 perturbed-weights rejection rate by noise scale", rates)
    report("smollm2 smallest noise scale always caught", min(always) if always else None)
    assert rates == {1e-2: 1.0, 1e-3: 1.0}, rates
