"""TOPLOC proofs over the last-layer hidden states of a completion.

A proof covers the N hidden-state rows that produced the N completion tokens (row k is
the state at position P-1+k), in chunks of `chunk_tokens` rows; each chunk commits to
its top-k values by magnitude as a polynomial (2-byte modulus + top-k 2-byte
coefficients: 258 bytes at top-k 128).

Invariants:
- Proofs are built from and checked against bf16 values, whatever the engine's dtype.
- Verification uses toploc's C++ path (a 2-D tensor with skip_prefill): its Python list
  path falsely rejects chunks whose modulus is not 65497.
- A null proof (modulus 0, what toploc returns when building failed), a chunk of the wrong
  size or a missing chunk fails the check; thresholds come from `VerificationPolicy`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from toploc import build_proofs_bytes, verify_proofs_bytes

from protocol.messages import ProofParams, VerificationPolicy


def build_proof(hidden_states: torch.Tensor, params: ProofParams) -> list[bytes]:
    """Proof chunks for hidden-state rows [N, H] of one completion."""
    rows = hidden_states.to(torch.bfloat16).cpu()
    return build_proofs_bytes(list(rows), params.chunk_tokens, params.topk, skip_prefill=True)


@dataclass(frozen=True)
class ProofCheck:
    passed: bool
    detail: str
    worst_exp_mismatches: float
    worst_mant_err_mean: float
    worst_mant_err_median: float


def _chunk_bytes(params: ProofParams) -> int:
    return 2 + 2 * params.topk


def check_proof(
    hidden_states: torch.Tensor, proof: list[bytes], params: ProofParams, policy: VerificationPolicy
) -> ProofCheck:
    """Check `proof` against the verifier's own rows [N, H]."""
    n = hidden_states.shape[0]
    expected = math.ceil(n / params.chunk_tokens)
    if len(proof) != expected:
        return ProofCheck(
            False, f"{len(proof)} proof chunks, expected {expected}", math.inf, math.inf, math.inf
        )
    for i, chunk in enumerate(proof):
        if len(chunk) != _chunk_bytes(params):
            return ProofCheck(
                False,
                f"chunk {i} has {len(chunk)} bytes, expected {_chunk_bytes(params)}",
                math.inf,
                math.inf,
                math.inf,
            )
        if chunk[:2] == b"\x00\x00":
            return ProofCheck(False, f"chunk {i} is a null proof", math.inf, math.inf, math.inf)
    rows = hidden_states.to(torch.bfloat16).cpu().contiguous()
    try:
        results = verify_proofs_bytes(
            rows, proof, params.chunk_tokens, params.topk, skip_prefill=True
        )
    except Exception as exc:  # toploc raises on malformed coefficients
        return ProofCheck(False, f"proof does not decode: {exc}", math.inf, math.inf, math.inf)
    exp = max(r.exp_mismatches for r in results)
    mean = max(r.mant_err_mean for r in results)
    median = max(r.mant_err_median for r in results)
    failures = [
        i
        for i, r in enumerate(results)
        if r.exp_mismatches > policy.max_exp_mismatches
        or r.mant_err_mean > policy.max_mant_err_mean
        or r.mant_err_median > policy.max_mant_err_median
    ]
    if failures:
        detail = (
            f"{len(failures)}/{len(results)} chunks outside thresholds "
            f"(worst: {exp} exponent mismatches, mantissa error mean {mean:.1f} median {median:.1f})"
        )
        return ProofCheck(False, detail, exp, mean, median)
    return ProofCheck(True, "", exp, mean, median)
