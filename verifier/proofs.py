"""TOPLOC proofs over the last-layer hidden states of a completion.

A proof covers the N hidden-state rows that produced the N completion tokens (row k is
the state at position P-1+k), in chunks of `chunk_tokens` rows; each chunk commits to
its top-k values by magnitude as a polynomial (2-byte modulus + top-k 2-byte
coefficients: 258 bytes at top-k 128).

Invariants:
- Proofs are built from and checked against bf16 values, whatever the engine's dtype.
- Verification uses toploc's C++ path (a 2-D tensor with skip_prefill): its Python list
  path falsely rejects chunks whose modulus is not 65497. `build_proofs` / `check_proofs`
  do the same math batched over many completions in torch (`verifier.proof_batch`, on
  the rows' device: a GPU worker never copies rows to the host); the bytes and numbers
  are toploc's when the top-k runs on the CPU (the GPU's top-k may break exact ties in
  the hidden states differently: honest noise the thresholds absorb).
- A null proof (modulus 0, what toploc returns when building failed), a chunk of the wrong
  size or a missing chunk fails the check; thresholds come from `VerificationPolicy`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from protocol.messages import ProofParams, VerificationPolicy
from verifier.proof_batch import build_proofs_batched, verify_proofs_batched


def build_proof(hidden_states: torch.Tensor, params: ProofParams) -> list[bytes]:
    """Proof chunks for hidden-state rows [N, H] of one completion."""
    from toploc import build_proofs_bytes  # here: the batched GPU path runs without toploc

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


def _format_error(n: int, proof: list[bytes], params: ProofParams) -> str | None:
    """Why `proof` cannot be the proof of `n` rows, or None."""
    expected = math.ceil(n / params.chunk_tokens)
    if len(proof) != expected:
        return f"{len(proof)} proof chunks, expected {expected}"
    for i, chunk in enumerate(proof):
        if len(chunk) != _chunk_bytes(params):
            return f"chunk {i} has {len(chunk)} bytes, expected {_chunk_bytes(params)}"
        if chunk[:2] == b"\x00\x00":
            return f"chunk {i} is a null proof"
    return None


def _failed(detail: str) -> ProofCheck:
    return ProofCheck(False, detail, math.inf, math.inf, math.inf)


def _judge(
    exp_mismatches: list[int],
    mant_err_mean: list[float],
    mant_err_median: list[float],
    policy: VerificationPolicy,
) -> ProofCheck:
    """Pass iff every chunk is within the policy's thresholds; report the worst values."""
    exp, mean, median = max(exp_mismatches), max(mant_err_mean), max(mant_err_median)
    failures = [
        i
        for i, (e, a, m) in enumerate(
            zip(exp_mismatches, mant_err_mean, mant_err_median, strict=True)
        )
        if e > policy.max_exp_mismatches
        or a > policy.max_mant_err_mean
        or m > policy.max_mant_err_median
    ]
    if failures:
        detail = (
            f"{len(failures)}/{len(exp_mismatches)} chunks outside thresholds "
            f"(worst: {exp} exponent mismatches, mantissa error mean {mean:.1f} median {median:.1f})"
        )
        return ProofCheck(False, detail, exp, mean, median)
    return ProofCheck(True, "", exp, mean, median)


def check_proof(
    hidden_states: torch.Tensor, proof: list[bytes], params: ProofParams, policy: VerificationPolicy
) -> ProofCheck:
    """Check `proof` against the verifier's own rows [N, H] (toploc, on the CPU)."""
    bad = _format_error(hidden_states.shape[0], proof, params)
    if bad is not None:
        return _failed(bad)
    n, width = hidden_states.shape
    if (
        n
        and width * min(params.chunk_tokens, n - (len(proof) - 1) * params.chunk_tokens)
        < params.topk
    ):
        # toploc's C++ check aborts the whole process on such a chunk
        return _failed(f"a chunk holds fewer than top-k {params.topk} values")
    from toploc import verify_proofs_bytes

    rows = hidden_states.to(torch.bfloat16).cpu().contiguous()
    try:
        results = verify_proofs_bytes(
            rows, proof, params.chunk_tokens, params.topk, skip_prefill=True
        )
    except Exception as exc:  # toploc raises on malformed coefficients
        return _failed(f"proof does not decode: {exc}")
    return _judge(
        [r.exp_mismatches for r in results],
        [r.mant_err_mean for r in results],
        [r.mant_err_median for r in results],
        policy,
    )


def build_proofs(
    rows: torch.Tensor, sizes: list[int], params: list[ProofParams]
) -> list[list[bytes]]:
    """The proofs of several completions at once (rows [sum N_i, H] in order, on any
    device; completions sharing a layout in one batched pass of `verifier.proof_batch`)."""
    out: list[list[bytes]] = [[] for _ in sizes]
    for layout, members in _by_layout(params).items():
        picked = _rows_of(rows, sizes, members)
        built = build_proofs_batched(picked, [sizes[i] for i in members], layout)
        for i, proof in zip(members, built, strict=True):
            out[i] = proof
    return out


def check_proofs(
    rows: torch.Tensor,
    sizes: list[int],
    proofs: list[list[bytes]],
    params: list[ProofParams],
    policy: VerificationPolicy,
) -> list[ProofCheck]:
    """`check_proof` for several completions at once, batched on the rows' device (the
    same numbers as toploc's C++ path: `verifier.proof_batch`)."""
    out: list[ProofCheck] = [_failed("not checked")] * len(sizes)
    formed = []
    for i, (n, proof, p) in enumerate(zip(sizes, proofs, params, strict=True)):
        bad = _format_error(n, proof, p)
        if bad is None:
            formed.append(i)
        else:
            out[i] = _failed(bad)
    for layout, members in _by_layout([params[i] for i in formed]).items():
        members = [formed[j] for j in members]
        picked = _rows_of(rows, sizes, members)
        stats = verify_proofs_batched(
            picked, [sizes[i] for i in members], [proofs[i] for i in members], layout
        )
        for i, st in zip(members, stats, strict=True):
            out[i] = (
                _failed("proof cannot be checked against these rows")
                if st is None
                else _judge(st.exp_mismatches, st.mant_err_mean, st.mant_err_median, policy)
            )
    return out


def _by_layout(params: list[ProofParams]) -> dict[ProofParams, list[int]]:
    groups: dict[ProofParams, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(p, []).append(i)
    return groups


def _rows_of(rows: torch.Tensor, sizes: list[int], members: list[int]) -> torch.Tensor:
    if len(members) == len(sizes):
        return rows
    parts = rows.split(sizes)
    return torch.cat([parts[i] for i in members])
