"""Proofs built in child processes (`node.proof_pool`): the same bytes as in-process, and a
worker that builds them there answers rollouts its peers accept."""

from __future__ import annotations

import asyncio
import tomllib

import torch

from node.proof_pool import ProofPool
from node.worker import Worker
from protocol.identity import Identity
from protocol.messages import (
    ProofParams,
    RolloutRequest,
    SamplingParams,
    VerificationPolicy,
    VerifyRequest,
)
from tests.conftest import random_chat_prompts
from tests.nodes import REPO
from verifier.proofs import build_proof

POLICY = VerificationPolicy(
    **tomllib.loads((REPO / "configs/verification/tiny-torch-cpu-fp32.toml").read_text())[
        "verification"
    ]
)


def test_a_proof_built_in_a_child_is_the_one_built_here():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(n, 96, generator=g) for n in (1, 31, 70)]  # fp32: cast to bf16 there
    params = ProofParams(chunk_tokens=16, topk=32)
    pool = ProofPool(2)

    async def build_all():
        return await asyncio.gather(*(pool.build(r, params) for r in rows))

    try:
        got = asyncio.run(build_all())
    finally:
        pool.close()
    assert got == [build_proof(r, params) for r in rows]
    assert [len(p) for p in got] == [1, 2, 5]


def test_a_worker_with_proof_processes_answers_rollouts_a_peer_accepts(tiny_engine):
    prompts = random_chat_prompts(tiny_engine.tokenizer, 4, seed=3)
    requests = [
        RolloutRequest(
            request_id=f"pp-{i}",
            prompt_ids=p,
            sampling=SamplingParams(temperature=1.0, max_tokens=40),
            seed=100 + i,
        )
        for i, p in enumerate(prompts)
    ]

    async def run():
        small = {"max_batch_size": 4, "batch_wait_s": 0.01, "max_model_len": 512}
        gen = Worker(tiny_engine, Identity.generate(), POLICY, **small, proof_processes=1)
        peer = Worker(tiny_engine, Identity.generate(), POLICY, **small)
        gen.start()
        peer.start()
        try:
            signed = await asyncio.gather(*(gen.generate(r) for r in requests))
            verdicts = [
                (await peer.verify(VerifyRequest(rollout_envelope=s.envelope, request=r)))[0]
                for r, s in zip(requests, signed, strict=True)
            ]
            return signed, verdicts
        finally:
            await gen.stop()
            await peer.stop()

    signed, verdicts = asyncio.run(run())
    assert all(v.accepted for v in verdicts), [v.reasons for v in verdicts]
    for s in signed:  # the proof is a real one of the rollout's tokens, not an empty list
        assert len(s.rollout.proof) == -(-len(s.rollout.completion_ids) // 32)
