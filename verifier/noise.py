"""The seeded Gumbel noise of sampling: counter-based, from (request seed, completion
position, vocabulary index) alone, so every engine and every verifier make the same values.

Owns the SplitMix64 constants and mixing, the row keys and the noise made from them. The
sampler and its replay (`verifier.sampling`), the fused replay kernel
(`verifier.fused_sampling`, which re-implements `noise_from_keys` per tile in Triton from
these constants) and the slot decoder (`node.engines.slot_decode`) all import it from here.

The noise of vocabulary index i in the row of (seed, position) is::

    seed_key = splitmix64(seed)                                  # per request
    key      = splitmix64(seed_key ^ position)                   # per row: row_key
    z        = mix64(key + i * GOLDEN)                           # per element
    u        = ((z >> 11) + 0.5) * 2**-53                        # (0, 1), float64
    noise    = float32(-log(-log(u)))

Invariants:
- Bit-identical on every device and engine: integer arithmetic (SplitMix64 in wrapping
  int64 on tensors, unbounded ints masked to 64 bits on the host) then float64 transforms
  in a fixed order, rounded once to float32.
- A row's values depend only on its key: not on the batch, the device, nor the blocking
  (`CPU_NOISE_BLOCK_ELEMS`).
- Tensor keys are signed int64 (`to_int64` of the 64-bit value); `mix64_` works in place
  on a tensor the caller owns.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment: also the stride between vocabulary entries
C1 = 0xBF58476D1CE4E5B9
C2 = 0x94D049BB133111EB

# Noise elements made per pass on a CPU. The noise is ~20 elementwise passes over int64 and
# float64 temporaries; on a CPU they run from cache when one block's temporaries fit in it
# (SmolLM2's 49,152-token vocabulary on the 2-core box: 3.3 ms a row in blocks of 512 rows,
# 1.0 ms in blocks of 4). A GPU wants few, large kernels, so it takes every row at once.
CPU_NOISE_BLOCK_ELEMS = 2**18


def to_int64(x: int) -> int:
    """The 64-bit pattern of `x` as a signed int64 value (what a tensor holds)."""
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def splitmix64(x: int) -> int:
    """SplitMix64 of a host integer: add `GOLDEN`, then the finalizer (unsigned 64-bit)."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * C1) & MASK64
    z = ((z ^ (z >> 27)) * C2) & MASK64
    return z ^ (z >> 31)


def mix64_(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finalizer in place on wrapping int64 (masked shifts = logical shifts)."""
    z ^= (z >> 30) & ((1 << 34) - 1)
    z *= to_int64(C1)
    z ^= (z >> 27) & ((1 << 37) - 1)
    z *= to_int64(C2)
    z ^= (z >> 31) & ((1 << 33) - 1)
    return z


def seed_key(seed: int) -> int:
    """The per-request half of `row_key`, as a signed int64: `splitmix64(seed)`."""
    return to_int64(splitmix64(seed))


def row_key(seed: int, position: int) -> int:
    """64-bit key of one (seed, completion position) pair, as a signed int64."""
    return to_int64(splitmix64(splitmix64(seed) ^ (position & MASK64)))


def row_keys(seed_keys: torch.Tensor, positions: torch.Tensor | int) -> torch.Tensor:
    """`row_key` on the device: int64 `seed_keys` (of `seed_key`) and completion positions
    (a tensor or one int for every row) -> int64 row keys. No host sync."""
    return mix64_((seed_keys ^ positions) + to_int64(GOLDEN))


def _gumbel(z: torch.Tensor) -> torch.Tensor:
    """Gumbel noise of the counters `z` (int64, consumed)."""
    z = mix64_(z)
    # Top 53 bits -> u in (0, 1) exactly representable in float64; in-place ops halve memory traffic.
    u = ((z >> 11) & ((1 << 53) - 1)).to(torch.float64)
    u.add_(0.5).mul_(2.0**-53)
    return u.log_().neg_().log_().neg_().to(torch.float32)


def _noise_block(keys: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return _gumbel(keys[:, None] + idx[None, :])


def noise_from_keys(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Noise [len(keys), vocab] float32 of int64 row keys; the same values whatever the
    blocking (elementwise math)."""
    idx = torch.arange(vocab, dtype=torch.int64, device=keys.device) * to_int64(GOLDEN)
    rows = max(1, CPU_NOISE_BLOCK_ELEMS // vocab)
    if keys.device.type != "cpu" or keys.shape[0] <= rows:
        return _noise_block(keys, idx)
    out = torch.empty((keys.shape[0], vocab), dtype=torch.float32)
    for i in range(0, keys.shape[0], rows):
        out[i : i + rows] = _noise_block(keys[i : i + rows], idx)
    return out


def noise_at(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The noise of one vocabulary entry per row (`tokens` [R]) for row keys [R]: the same
    values as the full rows' noise at those entries, without making the rows."""
    return _gumbel(keys + tokens * to_int64(GOLDEN))


def gumbel_noise(
    seeds: list[int], positions: list[int], vocab: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Gumbel(0, 1) noise of shape [len(seeds), vocab], float32, identical on every device."""
    keys = torch.tensor(
        [row_key(s, p) for s, p in zip(seeds, positions, strict=True)],
        dtype=torch.int64,
        device=device,
    )
    return noise_from_keys(keys, vocab)
