"""The fused best-score / log-sum-exp pass (verifier/fused_sampling.py) against
`verifier.sampling`: the torch fallback always, the Triton kernel under Triton's interpreter
on CPU tensors where Triton imports (a CUDA comparison needs a GPU: see the module)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verifier.fused_sampling import row_best_and_lse, row_best_and_lse_torch
from verifier.noise import gumbel_noise, row_key
from verifier.sampling import RowParams, sample

try:
    import triton
    import triton.language as tl

    from verifier.fused_sampling import tile_noise
except ImportError:
    triton = None

REPO = Path(__file__).resolve().parents[2]

if triton is not None:

    @triton.jit
    def _noise_kernel(keys_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
        """The kernel's noise written out [R, V], to compare every element."""
        row = tl.program_id(0).to(tl.int64)
        idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        noise = tile_noise(tl.load(keys_ptr + row), idx)
        tl.store(out_ptr + row * vocab + idx, noise, mask=idx < vocab)


def _kernel_noise(keys: torch.Tensor, vocab: int, block: int = 1024) -> torch.Tensor:
    out = torch.empty((keys.shape[0], vocab), dtype=torch.float32, device=keys.device)
    _noise_kernel[(keys.shape[0], triton.cdiv(vocab, block))](keys, out, vocab, BLOCK=block)
    return out


def _case(
    rows: int, vocab: int, seed: int = 0
) -> tuple[torch.Tensor, list[RowParams], list[int], list[int]]:
    """Random logits with -inf entries, an all -inf row, exact ties (in one tile, in two tiles,
    at both ends), and rows at T = 1, T = 0.7 and greedy."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3.0
    logits[torch.rand(rows, vocab, generator=g) < 0.05] = float("-inf")
    logits[1] = float("-inf")
    logits[2, 5] = float("-inf")
    for r, (i, j) in {3: (7, 9), 4: (0, vocab - 1), 5: (vocab // 3, 2 * vocab // 3)}.items():
        logits[r, i] = logits[r, j] = 60.0
    temps = [1.0, 0.7, 0.0]
    params = [RowParams(temps[r % 3], 0, 1.0) for r in range(rows)]
    for r in (3, 4, 5):  # ties decide only where nothing is added: greedy rows
        params[r] = RowParams(0.0, 0, 1.0)
    seeds = [1000 + r // 7 for r in range(rows)]
    positions = [r % 7 for r in range(rows)]
    return logits, params, seeds, positions


def _inputs(
    params: list[RowParams], seeds: list[int], positions: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = torch.tensor([p.scale for p in params], dtype=torch.float32)
    keys = torch.tensor([row_key(s, p) for s, p in zip(seeds, positions, strict=True)])
    stochastic = torch.tensor([p.temperature > 0 for p in params])
    return t, keys, stochastic


def _reference(
    logits: torch.Tensor, params: list[RowParams], seeds: list[int], positions: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """best, first argmax and logsumexp the way `verifier.sampling.sample` scores a row."""
    t, _, stochastic = (x.to(logits.device) for x in _inputs(params, seeds, positions))
    scaled = logits.float() / t[:, None]
    noise = gumbel_noise(seeds, positions, logits.shape[-1], logits.device)
    scores = scaled + noise * stochastic[:, None]
    idx = scores.argmax(dim=-1)
    return scores.gather(-1, idx[:, None])[:, 0], idx, torch.logsumexp(scaled, dim=-1)


def _assert_matches(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], tol: float):
    best, idx, lse = got
    assert best.dtype == torch.float32 and idx.dtype == torch.int64 and lse.dtype == torch.float32
    assert torch.equal(idx, want[1])
    assert torch.equal(best, want[0])
    torch.testing.assert_close(lse, want[2], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_fallback_matches_sampling(dtype: torch.dtype):
    logits, params, seeds, positions = _case(60, 1500)
    logits = logits.to(dtype)
    got = row_best_and_lse_torch(logits, *_inputs(params, seeds, positions))
    _assert_matches(got, _reference(logits, params, seeds, positions), 1e-6)
    # The chosen tokens are `sample`'s (no top-k/top-p here).
    assert torch.equal(got[1], sample(logits, params, seeds, positions).tokens)
    assert got[1][1] == 0 and got[2][1] == float("-inf")  # all -inf: argmax 0, lse -inf
    assert got[1][3] == 7 and got[1][4] == 0 and got[1][5] == 500  # first of the ties


def test_dispatch_on_cpu_is_the_fallback():
    logits, params, seeds, positions = _case(10, 300)
    inputs = _inputs(params, seeds, positions)
    got, want = row_best_and_lse(logits, *inputs), row_best_and_lse_torch(logits, *inputs)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def _check_kernel_under_interpreter() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1 (read when the kernel is decorated)."""
    from verifier.fused_sampling import row_best_and_lse_triton

    logits, params, seeds, positions = _case(160, 3000, seed=1)
    inputs = _inputs(params, seeds, positions)
    assert torch.equal(_kernel_noise(inputs[1], 3000), gumbel_noise(seeds, positions, 3000))
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        want = _reference(x, params, seeds, positions)
        # 160 rows at 80 "SMs" -> 2 segments of 2 tiles: a tile and a segment boundary each,
        # and a partial last tile.
        got = row_best_and_lse_triton(x, *inputs, sm_count=80, block=1024)
        _assert_matches(got, want, 1e-5)
    # Many small segments (one tile each) on a few rows.
    x, few = logits[:12], [p[:12] for p in (params, seeds, positions)]
    got = row_best_and_lse_triton(x, *_inputs(*few), sm_count=1000, block=256)
    _assert_matches(got, _reference(x, *few), 1e-5)


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def test_triton_kernel_under_interpreter_matches_sampling():
    triton = pytest.importorskip("triton")
    numpy = pytest.importorskip("numpy")
    if _minor(triton.__version__) < (3, 8) and _minor(numpy.__version__) >= (2, 4):
        # Its interpreter takes int() of 1-element arrays (a loop's runtime bounds).
        pytest.skip("Triton < 3.8's interpreter needs numpy < 2.4")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    code = f"from {__name__} import _check_kernel_under_interpreter as f; f()"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.gpu
def test_triton_kernel_on_cuda_matches_sampling():
    """On a GPU: the dispatch takes the kernel, whose noise and choices are bit-identical to
    `verifier.sampling` on the same device (float64 log from CUDA's math library in both)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    cuda = torch.device("cuda")
    from verifier.fused_sampling import triton_available

    assert triton_available(cuda)
    vocab = 49152
    logits, params, seeds, positions = _case(1024, vocab, seed=2)
    t, keys, stochastic = (x.to(cuda) for x in _inputs(params, seeds, positions))
    noise = gumbel_noise(seeds, positions, vocab, cuda)
    assert torch.equal(_kernel_noise(keys, vocab), noise)
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(cuda, dtype)
        for rows in (1024, 256, 3):  # 1, 2 and many segments a row on a 132-SM H200
            got = row_best_and_lse(x[:rows], t[:rows], keys[:rows], stochastic[:rows])
            few = [p[:rows] for p in (params, seeds, positions)]
            _assert_matches(got, _reference(x[:rows], *few), 1e-5)
