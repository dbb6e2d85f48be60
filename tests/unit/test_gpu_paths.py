"""The GPU paths of a worker against their CPU references (issue "GPU throughput of a worker").

On a CUDA machine: the fused sampling kernel chooses what `verifier.sampling` chooses; the
slot decode with CUDA graphs picks the tokens the loop decode picks (fp32, where both
engines compute the same logits to rounding) and its bf16 rollouts pass the engine's own
verification; proofs built and checked batched on the GPU agree with toploc on the CPU.
Skipped without CUDA (the CPU halves of these paths are tested in test_slot_decode.py,
test_fused_sampling.py and test_proof_batch.py).
"""

from __future__ import annotations

import pytest
import torch

from node.config import EngineConfig
from node.engines.base import GenerationRequest
from node.engines.torch_engine import TorchEngine
from node.worker import make_rollout
from protocol.messages import ProofParams, RolloutRequest, SamplingParams, VerificationPolicy
from verifier.checks import check_rollout, replay_rollouts
from verifier.noise import noise_from_keys
from verifier.proofs import build_proof, build_proofs, check_proof, check_proofs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_fused_kernel_chooses_what_the_reference_chooses():
    from verifier.fused_sampling import row_best_and_lse, row_best_and_lse_torch, triton_available

    dev = torch.device("cuda")
    assert triton_available(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    for rows, vocab, dtype in ((256, 49152, torch.bfloat16), (1000, 4099, torch.float32)):
        logits = (torch.randn(rows, vocab, device=dev, generator=g) * 3).to(dtype)
        logits[:8, 100] = logits[:8].max(dim=-1).values + 5  # a clear winner, then exact ties
        logits[8:16, 7] = logits[8:16, 9] = logits[8:16].max(dim=-1).values + 50
        logits[16:24, :50] = float("-inf")
        t = torch.where(torch.arange(rows, device=dev) % 3 == 0, 0.7, 1.0)
        keys = torch.randint(-(2**62), 2**62, (rows,), device=dev, generator=g)
        stoch = torch.arange(rows, device=dev) % 5 != 0
        best, idx, lse = row_best_and_lse(logits, t, keys, stoch)
        rbest, ridx, rlse = row_best_and_lse_torch(logits, t, keys, stoch)
        assert torch.equal(idx, ridx)
        assert torch.equal(best, rbest)
        assert torch.allclose(lse, rlse, atol=1e-5, rtol=1e-6)
        # and the reference is argmax(scaled + noise): the sampler's rule
        noise = noise_from_keys(keys, vocab) * stoch[:, None]
        assert torch.equal(idx, (logits.float() / t[:, None] + noise).argmax(-1))


def _requests(n: int, vocab: int) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        prompt = torch.randint(
            3, vocab, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g
        )
        kw = [{}, {"top_k": 20}, {"top_p": 0.9, "temperature": 0.8}, {"temperature": 0.0}][i % 4]
        sp = SamplingParams(max_tokens=int(torch.randint(1, 200, (1,), generator=g)), **kw)
        out.append(GenerationRequest(prompt.tolist(), sp, seed=7 * i + 1, proof=ProofParams()))
    return out


def test_slot_decode_with_graphs_picks_the_loop_decodes_tokens_in_fp32():
    common = {"model": "tiny", "device": "cuda", "dtype": "float32", "max_batch_size": 16}
    loop = TorchEngine(EngineConfig(decode="loop", **common))
    slots = TorchEngine(EngineConfig(decode="slots", max_model_len=512, **common))
    reqs = _requests(40, loop.vocab_size)
    a = [loop.generate([r])[0] for r in reqs]
    b = slots.generate(reqs)
    assert slots._slots is not None and slots._slots.graphs and slots._slots._graphs
    same = sum(x.completion_ids == y.completion_ids for x, y in zip(a, b, strict=True))
    assert same == len(reqs)
    for x, y in zip(a, b, strict=True):
        assert x.finish_reason == y.finish_reason
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-3


def test_bf16_slot_rollouts_pass_verification_and_gpu_proofs_match_toploc():
    pytest.importorskip("toploc")
    eng = TorchEngine(
        EngineConfig(
            model="tiny", device="cuda", dtype="bfloat16", max_batch_size=16, decode="slots"
        )
    )
    reqs = _requests(48, eng.vocab_size)
    results = eng.generate(reqs)
    assert all(r.hidden_states.device.type == "cuda" for r in results)
    sizes = [r.hidden_states.shape[0] for r in results]
    rows = torch.cat([r.hidden_states for r in results])
    gpu_proofs = build_proofs(rows, sizes, [ProofParams()] * len(results))
    cpu_proofs = [build_proof(r.hidden_states, ProofParams()) for r in results]
    chunks = [
        (a, b)
        for p, q in zip(gpu_proofs, cpu_proofs, strict=True)
        for a, b in zip(p, q, strict=True)
    ]
    same = sum(a == b for a, b in chunks)
    # A tie at the k-th largest |value| may be broken differently by the GPU's top-k: such a
    # chunk differs from toploc's and costs the verifier an exponent mismatch or two.
    print(f"GPU proofs byte-identical to toploc's: {same}/{len(chunks)} chunks")
    assert same >= 0.5 * len(chunks), f"{same}/{len(chunks)} chunks byte-identical"
    rollouts = [
        make_rollout(
            RolloutRequest(
                request_id=f"r{i}", prompt_ids=q.prompt_ids, sampling=q.sampling, seed=q.seed
            ),
            r,
            "gpu-test",
            0,
            eng.weights_hash,
            proof,
        )
        for i, (q, r, proof) in enumerate(zip(reqs, results, gpu_proofs, strict=True))
    ]
    policy = VerificationPolicy(
        max_logprob_abs_diff=1.0, max_logprob_mean_abs_diff=0.2, sampling_tolerance=1.0
    )
    batch = eng.prefill_batch([(r.prompt_ids, r.completion_ids) for r in rollouts])
    reps = replay_rollouts(rollouts, batch.logits, policy.support_tolerance)
    pcs = check_proofs(
        batch.rows, batch.sizes, [r.proof for r in rollouts], [ProofParams()] * 48, policy
    )
    tok = eng.tokenizer
    for r, rep, pc, h in zip(rollouts, reps, pcs, batch.rows.split(batch.sizes), strict=True):
        toploc = check_proof(h, r.proof, r.proof_params, policy)
        assert pc.passed == toploc.passed
        checks = check_rollout(
            r,
            rep,
            None,
            policy,
            weights_hash=eng.weights_hash,
            eos_ids=eng.eos_token_ids,
            decode=tok.decode,
            proof_check=pc,
        )
        assert all(c.passed for c in checks), [c for c in checks if not c.passed]
