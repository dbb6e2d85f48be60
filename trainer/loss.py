"""The training objectives: AIPO for RL, token-level NLL for SFT, on chunked logprobs.

`chunked_logprobs` turns last-layer hidden states [T, H] and the LM head weight [V, H]
into per-token logprobs of the targets and per-token entropies, `chunk` tokens at a
time, in the forward and again (recomputed) in the backward: the [T, V] logits tensor is
never held whole, only [chunk, V] at once.

Invariants: logprobs are those of softmax(logits / temperature) (the distribution the
workers sampled from, so they compare with the workers' mu); every loss here is a SUM
over this micro-batch's loss tokens divided by `num_tokens`, the number of loss tokens
of the whole step on all ranks, so summing micro-batches (and ranks) gives a token-level
mean in which a long and a short sequence weigh each token equally; importance weights
are detached (the gradient flows through log pi only, as in AIPO).
"""

from __future__ import annotations

import torch
from torch import Tensor


class _ChunkedLogprobs(torch.autograd.Function):
    """logp[t] = log softmax(h_t W^T / temp)[y_t] and entropy[t], chunked over t."""

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk: int
    ):
        logp = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        ent = torch.empty_like(logp)
        for s in range(0, hidden.shape[0], chunk):
            z = (hidden[s : s + chunk] @ weight.t()).float() / temperature
            lse = torch.logsumexp(z, dim=-1)
            logp[s : s + chunk] = z.gather(-1, targets[s : s + chunk, None]).squeeze(-1) - lse
            ent[s : s + chunk] = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)  # entropy often has no gradient: skip its term
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_ent: Tensor | None):
        hidden, weight, targets = ctx.saved_tensors
        temp, chunk = ctx.temperature, ctx.chunk
        g_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        g_weight = (
            torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        )
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            z = (h @ weight.t()).float() / temp
            logp_all = torch.log_softmax(z, dim=-1)
            p = logp_all.exp()
            g_z = torch.zeros_like(z)
            if g_logp is not None:
                # d logp_y / dz = onehot(y) - p
                g = g_logp[s : s + chunk, None].float()
                g_z -= g * p
                g_z.scatter_add_(-1, targets[s : s + chunk, None], g)
            if g_ent is not None:
                # H = -sum p log p  =>  dH/dz_j = -p_j (log p_j + H)
                ent = -(p * logp_all).sum(-1, keepdim=True)
                g_z -= g_ent[s : s + chunk, None].float() * p * (logp_all + ent)
            g_logits = (g_z / temp).to(weight.dtype)
            if g_hidden is not None:
                g_hidden[s : s + chunk] = g_logits @ weight
            if g_weight is not None:
                g_weight += g_logits.t().float() @ h.float()
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
