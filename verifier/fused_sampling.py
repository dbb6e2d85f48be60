"""One fused pass per row for the replay of seeded sampling: the best perturbed score, its
index and the log-sum-exp of the scaled logits, without the [rows, V] temporaries of
`verifier.sampling` (`verifier.noise` is ~20 elementwise passes over int64 and float64
arrays, which on a GPU are memory-bound and slower than the model's forward).

Owns a Triton kernel (CUDA only) and a pure-torch fallback with the same signature. Imports
only `verifier.noise` from the project (the sampler imports this module, not the reverse).

Invariants:
- Bit-identical choices to `verifier.sampling`: the same SplitMix64 noise in wrapping int64
  (`verifier.noise`'s constants), the same float64 transforms in the same order, the same
  float32 rounding of ``logits / T`` (IEEE round-to-nearest division) and of
  ``scaled + noise``.
- Ties: the first index of the maximum wins, as with ``torch.argmax``.
- A -inf logit gives a -inf score and adds nothing to the log-sum-exp; a row that is all
  -inf gives index 0 and a log-sum-exp of -inf, as torch does. NaN logits are not handled.
- Where Triton or CUDA is unavailable, `row_best_and_lse` runs the torch fallback.
"""

from __future__ import annotations

import functools

import torch

from verifier.noise import C1, C2, GOLDEN, noise_from_keys, to_int64

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: the torch fallback serves
    triton = None
    tl = None

# Rows of the torch fallback per block: bounds its float64 noise temporaries (as the replay does).
_TORCH_BLOCK_ELEMS = 2**24
# Vocabulary elements a Triton program handles per tile.
_BLOCK = 1024
# Programs per multiprocessor to aim for: R = 256 rows alone would leave a 132-SM H200 half idle.
_PROGRAMS_PER_SM = 4


def triton_available(device: torch.device) -> bool:
    """True when `device` is a CUDA device and Triton imports (the fused kernel runs); the
    import is tried once, when this module loads."""
    return triton is not None and torch.device(device).type == "cuda"


def row_best_and_lse(
    logits: torch.Tensor, t: torch.Tensor, keys: torch.Tensor, stochastic: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [R, V] (bf16 or fp32, row-contiguous), t [R] float32 temperature scale (1.0 for
    greedy), keys [R] int64 row keys (= `verifier.noise.row_key(seed, position)` per row,
    i.e. already mixed), stochastic [R] bool (T > 0).

    scaled = logits.float() / t[:, None]; score = scaled + noise * stochastic, with noise =
    `verifier.noise.noise_from_keys(keys, V)`. Returns best [R] float32 = max(score),
    best_idx [R] int64 = first index of that max (torch.argmax semantics), lse [R] float32 =
    logsumexp(scaled). No [R, V] temporary is allocated on the Triton path."""
    if triton_available(logits.device):
        with torch.cuda.device(logits.device):
            return row_best_and_lse_triton(logits, t, keys, stochastic, _sm_count(logits.device))
    return row_best_and_lse_torch(logits, t, keys, stochastic)


def row_best_and_lse_torch(
    logits: torch.Tensor, t: torch.Tensor, keys: torch.Tensor, stochastic: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`row_best_and_lse` from `verifier.noise`'s own operations (the reference)."""
    vocab = logits.shape[-1]
    rows = max(1, _TORCH_BLOCK_ELEMS // max(vocab, 1))
    best, best_idx, lse = [], [], []
    for i in range(0, logits.shape[0], rows):
        scaled = logits[i : i + rows].float() / t[i : i + rows, None]
        stoch = stochastic[i : i + rows]
        scores = scaled
        if bool(stoch.any()):
            scores = scaled + noise_from_keys(keys[i : i + rows], vocab) * stoch[:, None]
        idx = scores.argmax(dim=-1)
        best.append(scores.gather(-1, idx[:, None])[:, 0])
        best_idx.append(idx)
        lse.append(torch.logsumexp(scaled, dim=-1))
    if not best:  # no rows
        empty = logits.new_empty((0,), dtype=torch.float32)
        return empty, torch.empty(0, dtype=torch.int64, device=logits.device), empty.clone()
    return torch.cat(best), torch.cat(best_idx), torch.cat(lse)


@functools.cache
def _sm_count_cached(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count_cached(index)


def _segments(rows: int, vocab: int, programs: int, block: int) -> tuple[int, int]:
    """(segment length, a multiple of `block`; number of segments, none empty) so that
    rows * segments reaches `programs` where the vocabulary allows."""
    tiles = triton.cdiv(vocab, block)
    want = min(tiles, max(1, triton.cdiv(programs, max(rows, 1))))
    seg_len = triton.cdiv(tiles, want) * block
    return seg_len, triton.cdiv(vocab, seg_len)


def row_best_and_lse_triton(
    logits: torch.Tensor,
    t: torch.Tensor,
    keys: torch.Tensor,
    stochastic: torch.Tensor,
    sm_count: int,
    block: int = _BLOCK,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the fused kernel on the tensors' device: CUDA, or CPU tensors under Triton's
    interpreter (TRITON_INTERPRET=1 set before this module is imported; tests only)."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    seg_len, segs = _segments(rows, vocab, _PROGRAMS_PER_SM * sm_count, block)
    dev = logits.device
    seg_best = torch.empty((rows, segs), dtype=torch.float32, device=dev)
    seg_idx = torch.empty((rows, segs), dtype=torch.int32, device=dev)
    seg_max = torch.empty((rows, segs), dtype=torch.float32, device=dev)
    seg_sum = torch.empty((rows, segs), dtype=torch.float32, device=dev)
    if rows > 0:
        _row_segment_kernel[(rows, segs)](
            logits,
            logits.stride(0),
            t.to(torch.float32).contiguous(),
            keys.to(torch.int64).contiguous(),
            stochastic.to(torch.int8).contiguous(),
            seg_best,
            seg_idx,
            seg_max,
            seg_sum,
            vocab,
            seg_len,
            segs,
            BLOCK=block,
            num_warps=num_warps,
        )
    # Segments are in index order, so the first segment holding the maximum holds its first index.
    seg = seg_best.argmax(dim=1, keepdim=True)
    best = seg_best.gather(1, seg)[:, 0]
    best_idx = seg_idx.gather(1, seg)[:, 0].to(torch.int64)
    top = seg_max.max(dim=1, keepdim=True).values
    shift = top.masked_fill(top == float("-inf"), 0.0)  # an all -inf row: log(0) = -inf
    lse = torch.log((seg_sum * torch.exp(seg_max - shift)).sum(dim=1)) + shift[:, 0]
    return best, best_idx, lse


if triton is not None:
    # verifier.noise's constants as signed int64 (Triton types them int64: out of int32 range).
    _GOLDEN_I64 = tl.constexpr(to_int64(GOLDEN))
    _C1_I64 = tl.constexpr(to_int64(C1))
    _C2_I64 = tl.constexpr(to_int64(C2))
    _MASK34 = tl.constexpr((1 << 34) - 1)
    _MASK37 = tl.constexpr((1 << 37) - 1)
    _MASK33 = tl.constexpr((1 << 33) - 1)
    _MASK53 = tl.constexpr((1 << 53) - 1)

    @triton.jit
    def tile_noise(key, idx):
        """`verifier.noise.noise_from_keys` for one row key and a tile of vocabulary
        indices, operation for operation: wrapping int64, arithmetic shifts then masks,
        float64."""
        z = key + idx.to(tl.int64) * _GOLDEN_I64
        z ^= (z >> 30) & _MASK34
        z *= _C1_I64
        z ^= (z >> 27) & _MASK37
        z *= _C2_I64
        z ^= (z >> 31) & _MASK33
        u = ((z >> 11) & _MASK53).to(tl.float64)
        u = (u + 0.5) * 1.1102230246251565e-16  # 2**-53
        return (-tl.log(-tl.log(u))).to(tl.float32)

    @triton.jit
    def _row_segment_kernel(
        logits_ptr,
        stride_row,
        t_ptr,
        keys_ptr,
        stochastic_ptr,
        seg_best_ptr,
        seg_idx_ptr,
        seg_max_ptr,
        seg_sum_ptr,
        vocab,
        seg_len,
        segs,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2**31
        seg = tl.program_id(1)
        start = seg * seg_len
        end = tl.minimum(start + seg_len, vocab)
        t = tl.load(t_ptr + row)
        key = tl.load(keys_ptr + row)
        stochastic = tl.load(stochastic_ptr + row) != 0
        row_ptr = logits_ptr + row * stride_row
        lanes = tl.arange(0, BLOCK)

        best = tl.full((), float("-inf"), tl.float32)
        best_idx = start  # an all -inf segment: its first index, as argmax gives
        run_max = tl.full((), float("-inf"), tl.float32)
        run_sum = tl.full((), 0.0, tl.float32)
        for tile in range(start, end, BLOCK):
            idx = tile + lanes
            live = idx < end
            x = tl.load(row_ptr + idx, mask=live, other=float("-inf")).to(tl.float32)
            # torch divides with IEEE rounding; Triton's `/` is an approximate division.
            scaled = tl.math.div_rn(x, t)
            score = scaled
            if stochastic:  # greedy rows skip the noise's int64 and float64 work
                score = scaled + tile_noise(key, idx)
            # Best: strictly greater across tiles, first index within one: argmax's tie-break.
            tile_best = tl.max(score, axis=0)
            tile_idx = tl.min(tl.where(live & (score == tile_best), idx, 2147483647), axis=0)
            better = tile_best > best
            best_idx = tl.where(better, tile_idx, best_idx)
            best = tl.where(better, tile_best, best)
            # Online log-sum-exp; a shift of 0 while everything is -inf avoids -inf - -inf.
            new_max = tl.maximum(run_max, tl.max(scaled, axis=0))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(scaled - shift), axis=0)
            run_max = new_max
        out = row * segs + seg
        tl.store(seg_best_ptr + out, best)
        tl.store(seg_idx_ptr + out, best_idx)
        tl.store(seg_max_ptr + out, run_max)
        tl.store(seg_sum_ptr + out, run_sum)
