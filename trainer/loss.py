"""The training objectives: AIPO for RL, token-level NLL for SFT, on chunked logprobs.

`chunked_logprobs` turns last-layer hidden states [T, H] and the LM head weight [V, H]
into per-token logprobs of the targets and per-token entropies, `chunk` tokens at a
time, in the forward and again (recomputed) in the backward: the [T, V] logits tensor is
never held whole, only [chunk, V] at once. The three [chunk, H] x [H, V] products run in
the compute dtype (autocast's dtype when autocast is on, in the backward too; else the
weight's dtype), the weight gradient accumulates in float32 (at least); the softmax,
logsumexp, entropy and gradient elementwise work runs in float32, fused by torch.compile
on CUDA (eager elsewhere), and the backward reuses the forward's logsumexp.

Invariants: logprobs are those of softmax(logits / temperature) (the distribution the
workers sampled from, so they compare with the workers' mu); every loss here is a SUM
over this micro-batch's loss tokens divided by `num_tokens`, the number of loss tokens
of the whole step on all ranks, so summing micro-batches (and ranks) gives a token-level
mean in which a long and a short sequence weigh each token equally; importance weights
are detached (the gradient flows through log pi only, as in AIPO).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _fwd_math(z: Tensor, y: Tensor, temp: float) -> tuple[Tensor, Tensor, Tensor]:
    """(logp of y, entropy, logsumexp) of one chunk's logits z [c, V], in float32."""
    zf = z.float() / temp
    lse = torch.logsumexp(zf, dim=-1)
    logp_all = zf - lse[:, None]
    logp = logp_all.gather(-1, y[:, None]).squeeze(-1)
    ent = -(torch.exp(logp_all) * logp_all).sum(-1)  # no lse - sum(p z): that cancels
    return logp, ent, lse


def _bwd_math(z: Tensor, y: Tensor, lse: Tensor, g_logp: Tensor, temp: float, dtype: torch.dtype):
    """d loss / d logits of one chunk from d loss / d logp (d logp_y / dz = onehot(y) - p)."""
    zf = z.float() / temp
    p = torch.exp(zf - lse[:, None])
    g = g_logp[:, None].float()
    onehot = torch.arange(z.shape[-1], device=z.device)[None, :] == y[:, None]
    g_z = torch.where(onehot, g, 0.0) - g * p
    return (g_z / temp).to(dtype)


def _bwd_math_ent(
    z: Tensor, y: Tensor, lse: Tensor, g_logp: Tensor, g_ent: Tensor, temp: float, dtype
):
    """As `_bwd_math`, plus the entropy term: H = -sum p log p => dH/dz_j = -p_j (log p_j + H)."""
    zf = z.float() / temp
    logp_all = zf - lse[:, None]
    p = torch.exp(logp_all)
    g = g_logp[:, None].float()
    ent = -(p * logp_all).sum(-1, keepdim=True)
    onehot = torch.arange(z.shape[-1], device=z.device)[None, :] == y[:, None]
    g_z = torch.where(onehot, g, 0.0) - g * p - g_ent[:, None].float() * p * (logp_all + ent)
    return (g_z / temp).to(dtype)


# Compiled loss functions by name, built once per process (the trainer bench clears it).
COMPILED: dict[str, Callable] = {}


def _fused(fn: Callable, device: torch.device) -> Callable:
    """`fn` fused by torch.compile on CUDA; plain `fn` elsewhere (CPU compile starts slowly)."""
    if device.type != "cuda":
        return fn
    if fn.__name__ not in COMPILED:
        COMPILED[fn.__name__] = torch.compile(fn, dynamic=False)
    return COMPILED[fn.__name__]


_MM_OUT_DTYPE: list[bool] = []  # [] untried, [True] torch.mm(..., out_dtype) works here


def _mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b as float32 (or wider) from low-precision inputs, without an fp32 matmul."""
    if a.dtype in (torch.float32, torch.float64):
        return a @ b
    if a.is_cuda and _MM_OUT_DTYPE != [False]:
        try:
            out = torch.mm(a, b, out_dtype=torch.float32)  # fp32 output of the bf16 GEMM
            _MM_OUT_DTYPE[:] = [True]
            return out
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE[:] = [False]  # older torch: round the product, accumulate in fp32
    return (a @ b).float()


class _ChunkedLogprobs(torch.autograd.Function):
    """logp[t] = log softmax(h_t W^T / temp)[y_t] and entropy[t], chunked over t."""

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk: int
    ):
        dev = hidden.device.type
        # The backward runs outside autocast: remember its dtype for the recomputed logits.
        cd = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
        w = weight.to(cd)
        fwd = _fused(_fwd_math, hidden.device)
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        ent, lse = torch.empty_like(logp), torch.empty_like(logp)
        for s in range(0, n, chunk):
            z = hidden[s : s + chunk].to(cd) @ w.t()
            with torch.autocast(dev, enabled=False):
                logp[s : s + chunk], ent[s : s + chunk], lse[s : s + chunk] = fwd(
                    z, targets[s : s + chunk], temperature
                )
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk, ctx.cd = temperature, chunk, cd
        ctx.set_materialize_grads(False)  # entropy often has no gradient: skip its term
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_ent: Tensor | None):
        hidden, weight, targets, lse = ctx.saved_tensors
        temp, chunk, cd = ctx.temperature, ctx.chunk, ctx.cd
        if g_logp is None and g_ent is None:
            return None, None, None, None, None
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        w = weight.to(cd)
        g_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        acc = torch.promote_types(weight.dtype, torch.float32)
        g_weight = torch.zeros_like(weight, dtype=acc) if ctx.needs_input_grad[1] else None
        if g_ent is None:
            bwd = _fused(_bwd_math, hidden.device)
        else:
            bwd = _fused(_bwd_math_ent, hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk].to(cd)
            z = h @ w.t()
            args = (z, targets[s : s + chunk], lse[s : s + chunk], g_logp[s : s + chunk])
            if g_ent is not None:
                args += (g_ent[s : s + chunk],)
            g_logits = bwd(*args, temp, cd)
            if g_hidden is not None:
                g_hidden[s : s + chunk] = g_logits @ w
            if g_weight is not None:
                g_weight += _mm_f32(g_logits.t(), h)
        if g_weight is not None:
            g_weight = g_weight.to(weight.dtype)
        return g_hidden, g_weight, None, None, None


def chunked_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0, chunk: int = 1024
) -> tuple[Tensor, Tensor]:
    """Per-token (logprob of target, entropy), both float32 [T], never materialising [T, V]."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden [T, H] and targets [T], got {hidden.shape}, {targets.shape}"
        )
    return _ChunkedLogprobs.apply(hidden, weight, targets, float(temperature), int(chunk))


def aipo_loss(
    logp: Tensor,
    entropy: Tensor,
    mu: Tensor,
    advantages: Tensor,
    mask: Tensor,
    num_tokens: int | float,
    delta: float = 8.0,
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """AIPO token loss -min(pi/mu, delta).detach() * A * log pi, summed / num_tokens.

    Returns the loss and detached SUMS over this micro-batch's loss tokens (callers add
    them up over micro-batches and ranks, then divide by the step's token count):
    `entropy`, `mismatch_kl` (the k3 estimator of KL(mu || pi): r - 1 - log r with
    r = pi / mu, non-negative and unbiased under samples from mu), `capped` (tokens
    whose ratio exceeded delta), `ratio`, and `tokens`.
    """
    m = mask.float()
    log_ratio = logp - mu.float()
    ratio = torch.exp(log_ratio)
    coef = torch.clamp(ratio, max=delta).detach()
    per_token = -coef * advantages.float() * logp
    k3 = ratio - 1 - log_ratio  # gradient (r - 1) pulls pi towards mu when the penalty is on
    if kl_coef:
        per_token = per_token + kl_coef * k3
    if entropy_coef:
        per_token = per_token - entropy_coef * entropy
    loss = (per_token * m).sum() / num_tokens
    with torch.no_grad():
        sums = {
            "entropy": (entropy * m).sum(),
            "mismatch_kl": (k3 * m).sum(),
            "capped": ((ratio > delta).float() * m).sum(),
            "ratio": (ratio * m).sum(),
            "tokens": m.sum(),
        }
    return loss, sums


def sft_loss(
    logp: Tensor, entropy: Tensor, mask: Tensor, num_tokens: int | float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level NLL: -sum(log pi over loss tokens) / num_tokens, plus detached sums."""
    m = mask.float()
    loss = -(logp * m).sum() / num_tokens
    with torch.no_grad():
        sums = {"entropy": (entropy * m).sum(), "nll": -(logp * m).sum(), "tokens": m.sum()}
    return loss, sums
