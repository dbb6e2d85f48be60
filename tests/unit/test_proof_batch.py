"""`verifier.proof_batch` against toploc 0.1.6 itself, on the CPU.

Build: the same bytes as `toploc.build_proofs_bytes` per completion, over batches of
completions of mixed lengths (partial last chunks, chunks too small for the top-k, empty
completions), exactly tied values, and chunks wide enough that the modulus drops below
65497. Verify: the same numbers as toploc's C++ `verify_proofs_bytes` for honest,
perturbed, foreign and hand-crafted proofs (moduli and coefficients toploc never builds),
and None where toploc cannot check (it aborts the process on some of those, so it is only
ever called here on well-formed input).
"""

from __future__ import annotations

import random

import pytest
import torch
from toploc import build_proofs_bytes, verify_proofs_bytes
from toploc.C.csrc.poly import ProofPoly

from protocol.messages import ProofParams
from verifier.proof_batch import (
    MOD_N,
    ChunkStats,
    build_proofs_batched,
    injective_moduli,
    interpolate,
    verify_proofs_batched,
)

LENGTHS = [1, 32, 33, 100, 5, 0]
Numbers = list[tuple[int, float, float]]


def _split(rows: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    return list(rows.to(torch.bfloat16).cpu().split(lengths))


def _toploc_build(rows: torch.Tensor, lengths: list[int], p: ProofParams) -> list[list[bytes]]:
    return [
        build_proofs_bytes(list(r), p.chunk_tokens, p.topk, skip_prefill=True)
        for r in _split(rows, lengths)
    ]


def _toploc_verify(rows: torch.Tensor, proof: list[bytes], p: ProofParams) -> Numbers:
    if not len(proof):
        return []
    results = verify_proofs_bytes(
        rows.contiguous(), proof, p.chunk_tokens, p.topk, skip_prefill=True
    )
    return [(r.exp_mismatches, r.mant_err_mean, r.mant_err_median) for r in results]


def _numbers(stats: ChunkStats | None) -> Numbers:
    assert stats is not None
    return list(zip(stats.exp_mismatches, stats.mant_err_mean, stats.mant_err_median, strict=True))


def _checkable(rows: torch.Tensor, proof: list[bytes], p: ProofParams) -> bool:
    """Whether toploc's C++ verify can run without aborting the process."""
    n, width = rows.shape
    return (
        len(proof) == -(-n // p.chunk_tokens)
        and all(len(b) == 2 + 2 * p.topk and b[:2] != b"\0\0" for b in proof)
        and (n % p.chunk_tokens or p.chunk_tokens) * width >= p.topk
    )


def _assert_verify_matches(
    rows: torch.Tensor, lengths: list[int], proofs: list[list[bytes]], p: ProofParams
) -> list[ChunkStats | None]:
    got = verify_proofs_batched(rows, lengths, proofs, p)
    for r, proof, stats in zip(_split(rows, lengths), proofs, got, strict=True):
        if _checkable(r, proof, p):
            assert _numbers(stats) == _toploc_verify(r, proof, p)
        else:
            assert stats is None
    return got


@pytest.mark.parametrize("width", [64, 128, 576])
@pytest.mark.parametrize(("chunk_tokens", "topk"), [(32, 128), (8, 64)])
def test_build_matches_toploc(width: int, chunk_tokens: int, topk: int) -> None:
    torch.manual_seed(width + chunk_tokens)
    p = ProofParams(chunk_tokens=chunk_tokens, topk=topk)
    rows = torch.randn(sum(LENGTHS), width) * 3  # float32: converted to bf16 on both sides
    built = build_proofs_batched(rows, LENGTHS, p)
    assert built == _toploc_build(rows, LENGTHS, p)
    # Honest proofs check exactly (toploc's null proofs of a failed build come back None).
    for stats in _assert_verify_matches(rows, LENGTHS, built, p):
        if stats is not None:
            assert set(stats.exp_mismatches) <= {0} and set(stats.mant_err_mean) <= {0.0}


@pytest.mark.parametrize(("chunk_tokens", "topk"), [(32, 128), (8, 64)])
def test_exact_ties_pick_toploc_values(chunk_tokens: int, topk: int) -> None:
    torch.manual_seed(1)
    levels = torch.tensor([-2.0, -1.0, -0.5, 0.25, 0.5, 1.0, 2.0])
    lengths = [32, 33, 100, 3]
    rows = levels[torch.randint(len(levels), (sum(lengths), 128))].to(torch.bfloat16)
    p = ProofParams(chunk_tokens=chunk_tokens, topk=topk)
    # A chunk holds far more than topk values of magnitude 2: the choice is all tie-breaking.
    assert (rows[:chunk_tokens].abs() == 2).sum() > 3 * topk
    built = build_proofs_batched(rows, lengths, p)
    assert built == _toploc_build(rows, lengths, p)
    _assert_verify_matches(rows, lengths, built, p)


def _crafted(proofs: list[list[bytes]], moduli: list[int], seed: int) -> list[list[bytes]]:
    """Same chunk counts, every chunk replaced by a random polynomial (coefficients up to
    65535, unreduced, the top one 65535) under a modulus drawn from `moduli`."""
    rng = random.Random(seed)
    out = []
    for proof in proofs:
        chunks = []
        for b in proof:
            n = (len(b) - 2) // 2
            coeffs = [rng.randrange(65536) for _ in range(n - 1)] + [65535]
            chunks.append(ProofPoly(coeffs, rng.choice(moduli)).to_bytes())
        out.append(chunks)
    return out


@pytest.mark.parametrize(
    "case", ["honest", "perturbed", "other_rows", "modulus_300", "any_modulus", "no_exp_match"]
)
def test_verify_matches_toploc(case: str) -> None:
    torch.manual_seed(2)
    p = ProofParams(chunk_tokens=32, topk=128)
    lengths = [1, 32, 33, 100, 8]
    rows = (torch.randn(sum(lengths), 128) * 2).to(torch.bfloat16)
    proofs = build_proofs_batched(rows, lengths, p)
    checked = rows
    if case == "perturbed":  # a slightly different engine: some exponents and mantissas move
        noisy = rows.float() * (1 + 0.02 * torch.randn(rows.shape)) + 0.01 * torch.randn(rows.shape)
        checked = noisy.to(torch.bfloat16)
    elif case == "other_rows":
        checked = torch.randn(rows.shape).to(torch.bfloat16)
    elif case == "modulus_300":
        proofs = _crafted(proofs, [300], seed=3)
    elif case == "any_modulus":
        proofs = _crafted(proofs, [1, 2, 127, 300, 65497, 65498, 65535], seed=4)
    elif case == "no_exp_match":  # constant 0x7F80: exponent 255, which no finite value has
        proofs = [[ProofPoly([0x7F80] + [0] * 127, 65497).to_bytes()] * len(pr) for pr in proofs]
    got = _assert_verify_matches(checked, lengths, proofs, p)
    assert all(stats is not None for stats in got)
    worst = max(max(s.exp_mismatches) for s in got if s is not None)
    if case == "perturbed":
        assert 0 < worst < 64
    if case == "no_exp_match":
        assert all(s.mant_err_median == [2.0**64] * len(s.mant_err_median) for s in got if s)


def test_malformed_proofs_are_none() -> None:
    torch.manual_seed(5)
    p = ProofParams(chunk_tokens=32, topk=128)
    lengths = [32, 40, 64, 10, 33, 70]
    rows = torch.randn(sum(lengths), 128).to(torch.bfloat16)
    proofs = build_proofs_batched(rows, lengths, p)
    proofs[0] = []  # a chunk missing
    proofs[1] = proofs[1] + proofs[1][:1]  # a chunk too many
    proofs[2] = [proofs[2][0], proofs[2][1][:-1]]  # a chunk one byte short
    proofs[3] = [proofs[3][0] + b"\0\0"]  # a chunk one coefficient long
    proofs[4] = [proofs[4][0], b"\0\0" + proofs[4][1][2:]]  # modulus 0
    got = _assert_verify_matches(rows, lengths, proofs, p)  # [5] is honest and checked
    assert [s is None for s in got] == [True] * 5 + [False]

    # Rows whose last chunk holds fewer than topk values: toploc builds one null chunk too
    # many, and its verify would abort the process on a proof of the right shape.
    narrow = torch.randn(33, 64)
    nulls = build_proofs_batched(narrow, [33], p)[0]
    assert nulls == _toploc_build(narrow, [33], p)[0] == [bytes(258)] * 3
    shaped = [ProofPoly(list(range(128)), 65497).to_bytes()] * 2
    assert verify_proofs_batched(narrow, [33], [shaped], p) == [None]
    assert verify_proofs_batched(narrow, [33], [nulls], p) == [None]


def test_wide_chunks_take_toploc_modulus() -> None:
    """Flat indices reach 131071 at H = 4096, so x % 65497 is not always injective."""
    torch.manual_seed(6)
    p = ProofParams(chunk_tokens=32, topk=128)
    lengths = [256, 45, 64]  # 12 chunks; about one in eight needs a smaller modulus
    rows = torch.randn(sum(lengths), 4096).to(torch.bfloat16)
    built = build_proofs_batched(rows, lengths, p)
    assert built == _toploc_build(rows, lengths, p)
    moduli = {int.from_bytes(b[:2], "big") for proof in built for b in proof}
    assert moduli - {MOD_N}, "no chunk needed a smaller modulus: the case is not exercised"
    _assert_verify_matches(rows, lengths, built, p)


def test_modulus_search_and_interpolation_match_toploc() -> None:
    """Rows where the first few dozen moduli collide (across several candidate blocks)."""
    rng = random.Random(7)
    rows = []
    for shift in range(4):
        crafted = [0, MOD_N] + [2 * m for m in range(MOD_N - 40 - shift, MOD_N)]
        pool = set(range(300_000)) - set(crafted)
        rows.append(crafted + rng.sample(sorted(pool), 128 - len(crafted)))
    x = torch.tensor(rows)
    y = torch.randint(0, 65536, x.shape)
    mod = injective_moduli(x)
    coef = interpolate(x % mod[:, None], y)
    for i in range(len(rows)):
        ref = ProofPoly.from_points(rows[i], y[i].tolist())
        assert int(mod[i]) == ref.modulus < MOD_N - 40
        assert coef[i].tolist() == ref.coeffs


def test_empty_batches() -> None:
    p = ProofParams()
    rows = torch.zeros(0, 64)
    assert build_proofs_batched(rows, [], p) == []
    assert build_proofs_batched(rows, [0, 0], p) == [[], []]
    assert verify_proofs_batched(rows, [0], [[]], p) == [ChunkStats([], [], [])]
    assert verify_proofs_batched(rows, [0], [[bytes(258)]], p) == [None]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    """Without exact ties at the k-th place, the GPU builds and checks the CPU's proofs."""
    torch.manual_seed(8)
    p = ProofParams(chunk_tokens=32, topk=128)
    lengths = [1, 32, 33, 100, 256]
    width = 576
    # Distinct magnitudes within every chunk (a tie at the k-th place may be broken either
    # way by another device's top-k): distinct bf16 bit patterns per chunk, random signs.
    parts = []
    for n in lengths:
        for start in range(0, n, p.chunk_tokens):
            rows_in = min(p.chunk_tokens, n - start)
            flat = torch.randperm(0x7F00)[: rows_in * width] + 0x80
            parts.append(flat.view(rows_in, width))
    patterns = torch.cat(parts)
    patterns |= torch.randint(0, 2, patterns.shape) << 15
    rows = patterns.to(torch.int16).view(torch.bfloat16)
    built = build_proofs_batched(rows.cuda(), lengths, p)
    assert built == build_proofs_batched(rows, lengths, p)
    other = rows[torch.randperm(rows.shape[0])]  # other rows: the same distinct magnitudes
    on_gpu = verify_proofs_batched(other.cuda(), lengths, built, p)
    assert on_gpu == verify_proofs_batched(other, lengths, built, p)
    assert verify_proofs_batched(rows.cuda(), lengths, built, p) == verify_proofs_batched(
        rows, lengths, built, p
    )


def test_a_chunk_smaller_than_topk_fails_the_check_instead_of_aborting() -> None:
    """toploc's C++ check aborts the process (SIGABRT) on a chunk of fewer than top-k values:
    `check_proof` must refuse such a proof with a verdict, and keep the verifier alive."""
    from protocol.messages import VerificationPolicy
    from verifier.proofs import check_proof

    p = ProofParams(chunk_tokens=32, topk=128)
    rows = torch.randn(33, 64).to(torch.bfloat16)  # the last chunk: 1 row, 64 values < 128
    proof = [bytes([0xFF, 0xD9]) + bytes(256)] * 2
    result = check_proof(rows, proof, p, VerificationPolicy())
    assert not result.passed and "fewer than top-k" in result.detail
