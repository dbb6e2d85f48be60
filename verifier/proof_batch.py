"""TOPLOC proofs of many completions at once, in plain torch (any device), byte for byte
the proofs of toploc 0.1.6 (`verifier.proofs` builds and checks one completion at a time
with toploc's C++ code on the CPU).

Every chunk of every completion goes through the same few batched ops: one top-k per
group of chunks with the same row count, then arithmetic mod 65497 over all chunks at
once (Python loops only over coefficient positions, modulus candidates and chunk groups,
never over chunks or completions in the math; only byte packing loops per chunk). The
modular arithmetic runs on integer-valued float64 with lazy signed reduction: every value
stays an exact integer below 2**53, and only the final residues are made canonical.

Invariants:
- Build: the bytes are those of `toploc.build_proofs_bytes(list(rows_i.to(bf16).cpu()),
  chunk_tokens, topk, skip_prefill=True)`, including toploc's failure shape: a completion
  with any chunk of fewer than `topk` values gets 1 + ceil(N / chunk_tokens) null chunks
  (modulus 0), one more than it has chunks. The interpolating polynomial of degree < topk
  through topk distinct points of GF(65497) is unique, so the batched Newton interpolation
  here gives toploc's coefficients whatever order it works in.
- Verify: the numbers are those of toploc's C++ path (`verify_proofs_bytes` on a 2-D tensor
  with skip_prefill), including its Horner evaluation of coefficients that are not
  reduced mod 65497 and of moduli other than 65497. A proof of the wrong shape (chunk
  count, chunk size), with a modulus 0, or over a chunk of fewer than `topk` values gives
  None: toploc's C++ verify aborts the whole process on a chunk too many, a modulus 0
  (SIGFPE) or a chunk too small, and silently checks fewer chunks or other sizes.
- Identity with toploc holds when the top-k runs on the CPU; on a GPU the top-k may pick
  another of several exactly tied values at the k-th place (a different, equally valid
  proof), and everything after the top-k is exact integer arithmetic on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocol.messages import ProofParams

MOD_N = 65497  # toploc's prime field, whatever a proof's modulus
_MOD_BLOCK = 16  # moduli tried at once per chunk; ~88% of chunks take the first one
_inverse_tables: dict[torch.device, torch.Tensor] = {}


def _inverses(device: torch.device) -> torch.Tensor:
    """float64 table t[d + MOD_N - 1] = d^-1 mod MOD_N for d in (-MOD_N, MOD_N) (0 at d = 0),
    so a signed difference of two residues indexes it directly. Fermat: d^(MOD_N - 2)."""
    table = _inverse_tables.get(device)
    if table is None:
        base = torch.arange(MOD_N, dtype=torch.int64, device=device)
        inv = torch.ones_like(base)
        e = MOD_N - 2
        while e:
            if e & 1:
                inv = inv * base % MOD_N
            base = base * base % MOD_N
            e >>= 1
        signed = torch.arange(-(MOD_N - 1), MOD_N, device=device) % MOD_N
        table = inv[signed].to(torch.float64)
        _inverse_tables[device] = table
    return table


def _reduce(a: torch.Tensor) -> torch.Tensor:
    """In place: a value congruent to `a` mod MOD_N, in about [-MOD_N/2, MOD_N/2], for
    integer-valued float64 |a| < 2**40. Exact: the quotient only needs to be near
    a / MOD_N, and q * MOD_N and the difference are integers below 2**53. Products of two
    reduced values stay below 2**32. float64 rather than int64 because int64 % is a
    scalar division per element on the CPU (about 3x slower here, and slow on GPUs too)."""
    q = torch.mul(a, 1.0 / MOD_N).round_()
    return a.sub_(q, alpha=MOD_N)  # in place: callers pass temporaries


def _canonical(a: torch.Tensor) -> torch.Tensor:
    """int64 in [0, MOD_N) from a reduced float64 tensor."""
    return a.to(torch.int64) % MOD_N


@dataclass
class _Layout:
    """Chunk j of completion i covers rows [start, start + nrows) of the batch."""

    owner: np.ndarray  # [C] completion of each chunk
    start: np.ndarray  # [C] first row
    nrows: np.ndarray  # [C] rows in the chunk
    counts: np.ndarray  # [B] chunks per completion


def _layout(lengths: list[int], chunk_tokens: int) -> _Layout:
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if (lens < 0).any():
        raise ValueError("negative completion length")
    offsets = np.cumsum(lens) - lens
    counts = -(-lens // chunk_tokens)
    owner = np.repeat(np.arange(len(lens)), counts)
    j = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    start = offsets[owner] + j * chunk_tokens
    nrows = np.minimum(chunk_tokens, lens[owner] - j * chunk_tokens)
    return _Layout(owner, start, nrows, counts)


def _chunk_topk(
    rows: torch.Tensor, start: np.ndarray, nrows: np.ndarray, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk: flat indices of the top-k |values| and the values' bf16 bits (0..65535).

    Chunks are grouped by row count so each group is one [G, rows * H] top-k, the same
    kernel per row as toploc's 1-D call (so CPU ties break the same way)."""
    n, device = len(start), rows.device
    idx = torch.empty((n, topk), dtype=torch.int64, device=device)
    bits = torch.empty((n, topk), dtype=torch.int64, device=device)
    for r in np.unique(nrows):
        sel = np.flatnonzero(nrows == r)
        row_idx = torch.from_numpy(start[sel][:, None] + np.arange(r)).to(device)
        flat = rows[row_idx].reshape(len(sel), -1)
        top = flat.abs().topk(topk, dim=1).indices
        sel_t = torch.from_numpy(sel).to(device)
        idx[sel_t] = top
        bits[sel_t] = flat.gather(1, top).view(torch.int16).to(torch.int64) & 0xFFFF
    return idx, bits


def injective_moduli(x: torch.Tensor) -> torch.Tensor:
    """Per row of distinct x: the largest m <= MOD_N (counting down) with x % m injective,
    0 where there is none. Rows whose x all lie below MOD_N take MOD_N outright."""
    mod = torch.full((x.shape[0],), MOD_N, dtype=torch.int64, device=x.device)
    pending = torch.nonzero(x.max(dim=1).values >= MOD_N).flatten()
    top = MOD_N
    while pending.numel() and top > 0:
        cands = torch.arange(top, max(top - _MOD_BLOCK, 0), -1, device=x.device)
        res = (x[pending][:, None, :] % cands[None, :, None]).sort(dim=-1).values
        ok = (res[..., 1:] != res[..., :-1]).all(dim=-1)  # [P, candidates]
        found = ok.any(dim=1)
        first = ok.to(torch.int8).argmax(dim=1)  # argmax returns the first maximum
        mod[pending[found]] = cands[first[found]]
        pending = pending[~found]
        top -= _MOD_BLOCK
    mod[pending] = 0
    return mod


def interpolate(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Coefficients (ascending, int64 in [0, MOD_N)) of the polynomial of degree < n through
    the n points (x[c, i], y[c, i]) of each row c, x distinct and in [0, MOD_N) (int64)."""
    inv = _inverses(x.device)
    n = x.shape[1]
    x_shift = x + (MOD_N - 1)  # x_i - x_j + MOD_N - 1 indexes the signed inverse table
    dd = _reduce(y.to(torch.float64, copy=True))
    for k in range(1, n):  # divided differences, each level over all chunks at once
        slot = (x_shift[:, k:] - x[:, :-k]).reshape(-1)
        inv_den = torch.gather(inv, 0, slot).view(-1, n - k)
        dd[:, k:] = _reduce((dd[:, k:] - dd[:, k - 1 : -1]) * inv_den)
    # Newton form to monomials from the innermost factor out: p <- p * (X - x_i) + dd_i;
    # after the step for x_i, p has degree n - 1 - i, so only its first n - i columns move.
    xf = x.to(torch.float64)
    coef = torch.zeros_like(dd)
    coef[:, 0] = dd[:, n - 1]
    for i in range(n - 2, -1, -1):
        m = n - i
        low = coef[:, : m - 1]
        new = -xf[:, i : i + 1] * low
        new[:, 1:] += low[:, :-1]
        new[:, 0] += dd[:, i]
        coef[:, m - 1] = low[:, -1]  # the leading coefficient moves up unchanged
        coef[:, : m - 1] = _reduce(new)
    return _canonical(coef)


def _null_count(length: int, chunk_tokens: int) -> int:
    """How many null chunks toploc returns when building a completion fails."""
    return 1 + (length - 1 + chunk_tokens) // chunk_tokens


def build_proofs_batched(
    rows: torch.Tensor, lengths: list[int], params: ProofParams
) -> list[list[bytes]]:
    """rows: [sum(lengths), H] (any float dtype, any device; converted to bf16 like
    verifier.proofs.build_proof); completion i owns rows[offset_i : offset_i + lengths[i]].
    Returns, per completion, exactly the bytes toploc.build_proofs_bytes(list(rows_i.to(bf16)
    .cpu()), params.chunk_tokens, params.topk, skip_prefill=True) returns (when the top-k is
    computed on the CPU)."""
    c, k = params.chunk_tokens, params.topk
    if rows.dim() != 2 or rows.shape[0] != sum(lengths):
        raise ValueError(f"rows {tuple(rows.shape)} do not hold {sum(lengths)} rows")
    lay = _layout(lengths, c)
    width = rows.shape[1]
    # toploc's top-k raises on a chunk of fewer than k values and nulls the whole completion.
    failed = np.bincount(lay.owner[lay.nrows * width < k], minlength=len(lengths)) > 0
    computed = ~failed  # completions whose chunks go through the math, in chunk order
    keep = np.flatnonzero(computed[lay.owner])
    out: np.ndarray = np.zeros((0, 1 + k), dtype=">u2")
    if keep.size:
        idx, bits = _chunk_topk(rows.to(torch.bfloat16), lay.start[keep], lay.nrows[keep], k)
        mod = injective_moduli(idx)
        # No injective modulus: toploc raises and nulls the whole completion (not seen in
        # practice: k distinct indices always have one far above k).
        nomod = (mod == 0).cpu().numpy()
        if nomod.any():
            failed[np.unique(lay.owner[keep][nomod])] = True
        coef = interpolate(idx % mod.clamp(min=1)[:, None], bits)
        out = torch.cat([mod[:, None], coef], dim=1).cpu().numpy().astype(">u2")
    size = 2 + 2 * k
    raw = out.tobytes()
    chunks = [raw[i * size : (i + 1) * size] for i in range(len(keep))]
    ends = np.cumsum(np.where(computed, lay.counts, 0))  # completion i: chunks[end - n : end]
    null = bytes(size)
    return [
        [null] * _null_count(length, c) if failed[i] else chunks[ends[i] - lay.counts[i] : ends[i]]
        for i, length in enumerate(lengths)
    ]


@dataclass
class ChunkStats:
    """Per completion: one entry per proof chunk, as toploc's VerificationResult."""

    exp_mismatches: list[int]
    mant_err_mean: list[float]
    mant_err_median: list[float]


def verify_proofs_batched(
    rows: torch.Tensor, lengths: list[int], proofs: list[list[bytes]], params: ProofParams
) -> list[ChunkStats | None]:
    """Same numbers as toploc.verify_proofs_bytes(rows_i.to(bf16).cpu().contiguous(),
    proofs[i], chunk_tokens, topk, skip_prefill=True) (the C++ path) for every completion i.
    None for a completion whose proof is malformed (wrong number of chunks, a chunk whose
    byte length is not 2 + 2*topk, modulus 0) or that toploc cannot check (a chunk of fewer
    than topk values): the caller (verifier.proofs.check_proof) reports those itself."""
    c, k = params.chunk_tokens, params.topk
    if rows.dim() != 2 or rows.shape[0] != sum(lengths):
        raise ValueError(f"rows {tuple(rows.shape)} do not hold {sum(lengths)} rows")
    if len(proofs) != len(lengths):
        raise ValueError(f"{len(proofs)} proofs for {len(lengths)} completions")
    lay = _layout(lengths, c)
    size = 2 + 2 * k
    ok = np.array(
        [
            len(p) == n and all(len(b) == size for b in p)
            for p, n in zip(proofs, lay.counts.tolist(), strict=True)
        ],
        dtype=bool,
    )
    ok &= np.bincount(lay.owner[lay.nrows * rows.shape[1] < k], minlength=len(lengths)) == 0
    raw = b"".join(b for p, good in zip(proofs, ok, strict=True) if good for b in p)
    parsed = np.frombuffer(raw, dtype=">u2").astype(np.int64).reshape(-1, 1 + k)
    owner = lay.owner[ok[lay.owner]]  # completion of each parsed chunk
    ok[owner[parsed[:, 0] == 0]] = False  # modulus 0: toploc's C++ divides by it
    good = ok[owner]
    parsed, owner = parsed[good], owner[good]
    keep = np.flatnonzero(ok[lay.owner])
    stats = np.zeros((0, 3), dtype=np.float64)
    if keep.size:
        stats = _chunk_stats(rows, lay.start[keep], lay.nrows[keep], parsed, k)
    ends = np.cumsum(np.where(ok, lay.counts, 0))
    results: list[ChunkStats | None] = []
    for i in range(len(lengths)):
        if not ok[i]:
            results.append(None)
            continue
        s = stats[ends[i] - lay.counts[i] : ends[i]]
        results.append(ChunkStats(s[:, 0].astype(int).tolist(), s[:, 1].tolist(), s[:, 2].tolist()))
    return results


def _chunk_stats(
    rows: torch.Tensor, start: np.ndarray, nrows: np.ndarray, parsed: np.ndarray, k: int
) -> np.ndarray:
    """[C, 3] float64: exponent mismatches, mantissa error mean and median per chunk, as
    toploc's `verify_proofs` (poly.cpp) computes them from chunk rows and parsed proofs."""
    idx, bits = _chunk_topk(rows.to(torch.bfloat16), start, nrows, k)
    proof = torch.from_numpy(parsed).to(rows.device)
    x = (idx % proof[:, :1]).to(torch.float64)
    coef = proof[:, 1:].to(torch.float64)
    # toploc's Horner reduces canonically at every step; any congruent reduction ends at the
    # same residue of the polynomial's value, so lazy signed reduction is exact here too.
    val = coef[:, k - 1 : k].expand(-1, k)
    for i in range(k - 2, -1, -1):
        val = _reduce(torch.addcmul(coef[:, i : i + 1], val, x))
    val = _canonical(val)
    exp_p, mant_p = (val >> 7) & 0xFF, val & 0x7F
    exp_v, mant_v = (bits >> 7) & 0xFF, bits & 0x7F
    match = exp_p == exp_v
    err = torch.where(match, (mant_p - mant_v).abs(), 1 << 20)  # unmatched sort last
    n_match = match.sum(dim=1)
    median = err.sort(dim=1).values.gather(1, (n_match // 2).clamp(max=k - 1)[:, None])[:, 0]
    total = torch.where(match, err, 0).sum(dim=1)
    cols = torch.stack([k - n_match, n_match, total, median], dim=1).cpu().numpy()
    mism, n_match_np, total_np, med = cols.T
    # Integer sums divided once in float64: toploc's double accumulation of small ints is exact.
    none = n_match_np == 0
    mean = np.where(none, 2.0**64, total_np / np.maximum(n_match_np, 1))
    return np.stack([mism, mean, np.where(none, 2.0**64, med)], axis=1).astype(np.float64)
