"""Seeded sampling that any engine reproduces and any verifier can replay.

Every token is chosen as ``argmax(filter(logits / T) + g)``, where ``g`` is Gumbel noise
from a counter-based hash of (request seed, completion position, vocabulary index) and
``filter`` applies top-k then top-p. This is an exact sample from the filtered softmax,
and because the noise depends only on the seed and the position, a verifier that has its
own logits recomputes the choice of every token (section 10 of DESIGN.md).

Owns the sampler (`sample`, `BatchSampler`, and the scores they take the argmax of:
`seeded_scores`), the support masks and the replay. The noise
itself is `verifier.noise`'s; the fused replay pass is `verifier.fused_sampling`'s.

Invariants:
- The noise is bit-identical on every device and engine (`verifier.noise`), and the fused
  pass chooses exactly what these torch ops choose.
- Logprobs are reported under ``log_softmax(logits / T)`` (``T = 1`` for greedy), without
  the top-k/top-p truncation: that is the behaviour policy the trainer divides by.
- Temperature 0 is greedy: no noise, argmax of the filtered logits.
- One rule decides the support, per row, in the sampler, the verifier's strict mask and
  its lenient mask (`support_mask`): top-k keeps the k most likely tokens (k = 0 or
  k >= vocabulary size: all); top-p then keeps the smallest set whose mass reaches p, so
  the most likely token is always kept (also when p rounds to 0 in float32, e.g. 1e-300)
  and p >= 1 (after float32 rounding) keeps every token top-k kept, whatever the batch's
  other rows ask for. The support is never empty, so the argmax is always a kept token.
- The verifier's two other masks bracket the strict one, for honest numerical differences
  between engines: the lenient mask (support check) only adds to it, the core mask (the
  best score the replay compares with) only removes from it: p + slack or p - slack for
  the nucleus, and near-ties at its boundary (tokens within a factor ``1 - slack`` in
  probability) admitted or dropped. With slack 0 both are the strict mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from verifier.fused_sampling import row_best_and_lse, triton_available
from verifier.noise import gumbel_noise, noise_at, noise_from_keys, row_key, row_keys, seed_key


@dataclass(frozen=True)
class RowParams:
    """Sampling parameters of one row of a batch."""

    temperature: float
    top_k: int
    top_p: float

    @property
    def scale(self) -> float:
        return self.temperature if self.temperature > 0 else 1.0


def param_tensors(
    params: list[RowParams], vocab: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Per-row (temperature scale, top-k, top-p) as tensors on `device`: the inputs of
    the support mask, shared by the sampler and the replay so both read them alike."""
    t = torch.tensor([p.scale for p in params], dtype=torch.float32, device=device)
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    return t, k, top_p


def _kept_sorted(
    sorted_vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, p_shift: float
) -> torch.Tensor:
    """Boolean [B, V] over the row sorted in descending order: top-k, then the nucleus cut
    at p + `p_shift`. Always a non-empty prefix of the sorted row."""
    ranks = torch.arange(sorted_vals.shape[-1], device=sorted_vals.device)[None, :]
    keep = ranks < top_k[:, None]
    probs = torch.softmax(sorted_vals.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = probs.cumsum(-1) - probs
    # The nucleus is the smallest prefix whose mass reaches p: a token is in it iff the mass
    # before it is < p. The first token always is (p may be 0 in float32: top_p = 1e-300),
    # and p >= 1 filters nothing (the float32 cumsum can reach 1 before the tail does).
    nucleus = (mass_before < (top_p[:, None] + p_shift)) | (top_p[:, None] >= 1.0)
    nucleus[:, 0] = True
    return keep & nucleus


def _tie(p_slack: float) -> float:
    """Near-tie width in scaled-logit units: tokens whose probabilities differ by a factor
    of at most 1 - `p_slack` (finite, so that -inf logits stay -inf)."""
    return -math.log1p(-p_slack) if p_slack < 1 else float(torch.finfo(torch.float32).max)


def support_mask(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, p_slack: float = 0.0
) -> torch.Tensor | None:
    """Boolean [B, V]: tokens kept by top-k then top-p; None when no row filters anything
    (the common case, and the fast path).

    The strict mask (`p_slack` = 0) is the sampler's. A verifier's lenient mask
    (`p_slack` > 0) is a superset for honest numerical differences: the nucleus is cut at
    p + `p_slack`, and a token at least (1 - `p_slack`) times as likely as a kept one is
    kept too, so a near-tie across the boundary (the k-th token; the most likely one when
    top_k = 1 or top_p is tiny) is not taken for a token outside the support."""
    vocab = scaled.shape[-1]
    if bool((top_k >= vocab).all()) and bool((top_p >= 1.0).all()):
        return None
    if p_slack <= 0:
        return strict_mask(scaled, top_k, top_p)
    sorted_vals, sorted_idx = scaled.sort(dim=-1, descending=True)
    keep = _kept_sorted(sorted_vals, top_k, top_p, p_slack)
    floor = sorted_vals.masked_fill(~keep, float("inf")).min(dim=-1, keepdim=True).values
    keep |= sorted_vals >= floor - _tie(p_slack)
    return torch.zeros_like(keep).scatter(-1, sorted_idx, keep)


def strict_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Boolean [B, V]: the sampler's support (`support_mask` with no slack), always
    materialised: no host-side shortcut, so a captured decode step can run it."""
    sorted_vals, sorted_idx = scaled.sort(dim=-1, descending=True)
    keep = _kept_sorted(sorted_vals, top_k, top_p, 0.0)
    return torch.zeros_like(keep).scatter(-1, sorted_idx, keep)


def core_mask(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, p_slack: float
) -> torch.Tensor | None:
    """Boolean [B, V]: tokens every honest engine keeps (a subset of the strict mask; the
    strict mask itself when `p_slack` = 0); None when no row filters anything.

    The nucleus is cut at p - `p_slack`, and kept tokens that are near-ties of the most
    likely token left out are dropped. A row can be empty: a near-tie at the most likely
    token under top_k = 1 or a tiny top_p, where either token is an honest choice. The
    replay takes its best score over this set, so a token that the verifier's own strict
    mask keeps but an honest generator's could not does not count against the claim."""
    if p_slack <= 0:
        return support_mask(scaled, top_k, top_p)
    vocab = scaled.shape[-1]
    if bool((top_k >= vocab).all()) and bool((top_p >= 1.0).all()):
        return None
    sorted_vals, sorted_idx = scaled.sort(dim=-1, descending=True)
    keep = _kept_sorted(sorted_vals, top_k, top_p, -p_slack)
    ceiling = sorted_vals.masked_fill(keep, float("-inf")).max(dim=-1, keepdim=True).values
    keep &= sorted_vals > ceiling + _tie(p_slack)
    return torch.zeros_like(keep).scatter(-1, sorted_idx, keep)


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32 under log_softmax(logits / T)


class BatchSampler:
    """`sample` for one batch across decode steps: parameters and per-row seed keys stay on
    the device, so a step copies nothing from the host. Same tokens as `sample`."""

    def __init__(self, params: list[RowParams], seeds: list[int], vocab: int, device: torch.device):
        self.vocab = vocab
        self.t, self.k, self.p = param_tensors(params, vocab, device)
        self.filtering = any(0 < x.top_k < vocab or x.top_p < 1.0 for x in params)
        self.stochastic = torch.tensor([x.temperature > 0 for x in params], device=device)
        self.any_stochastic = any(x.temperature > 0 for x in params)
        # row_key(seed, pos) = splitmix(splitmix(seed) ^ pos): the inner half is per row.
        self.seed_keys = torch.tensor(
            [seed_key(s) for s in seeds], dtype=torch.int64, device=device
        )

    def __call__(self, logits: torch.Tensor, position: int) -> SampleOutput:
        scaled = logits.float() / self.t[:, None]
        mask = support_mask(scaled, self.k, self.p) if self.filtering else None
        noise = None
        if self.any_stochastic:
            noise = noise_from_keys(row_keys(self.seed_keys, position), self.vocab)
        return _choose(scaled, mask, noise, self.stochastic)


def seeded_scores(
    logits: torch.Tensor, params: list[RowParams], seeds: list[int], positions: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scaled logits, scores) of rows of `logits` [B, V] (any dtype; float32 out): the
    scores are the filtered scaled logits plus the seeded noise on stochastic rows, and
    the sampler's choice is their argmax."""
    logits = logits.float()
    vocab = logits.shape[-1]
    t, k, p = param_tensors(params, vocab, logits.device)
    scaled = logits / t[:, None]
    stochastic = torch.tensor([x.temperature > 0 for x in params], device=logits.device)
    noise = gumbel_noise(seeds, positions, vocab, logits.device) if bool(stochastic.any()) else None
    return scaled, _scores(scaled, support_mask(scaled, k, p), noise, stochastic)


def sample(
    logits: torch.Tensor, params: list[RowParams], seeds: list[int], positions: list[int]
) -> SampleOutput:
    """Choose one token per row of `logits` [B, V] (any dtype; computed in float32)."""
    scaled, scores = seeded_scores(logits, params, seeds, positions)
    tokens = scores.argmax(dim=-1)
    return SampleOutput(tokens, token_logprobs(scaled, tokens[:, None]))


def _scores(
    scaled: torch.Tensor,
    mask: torch.Tensor | None,
    noise: torch.Tensor | None,
    stochastic: torch.Tensor,
) -> torch.Tensor:
    """The filtered scaled logits, plus the noise on stochastic (T > 0) rows."""
    scores = scaled if mask is None else scaled.masked_fill(~mask, float("-inf"))
    if noise is not None:
        scores = scores + noise * stochastic[:, None]
    return scores


def _choose(
    scaled: torch.Tensor,
    mask: torch.Tensor | None,
    noise: torch.Tensor | None,
    stochastic: torch.Tensor,
) -> SampleOutput:
    """argmax of `_scores`, with its logprob under the scaled logits."""
    tokens = _scores(scaled, mask, noise, stochastic).argmax(dim=-1)
    return SampleOutput(tokens, token_logprobs(scaled, tokens[:, None]))


def token_logprobs(scaled: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(scaled)[tokens] for tokens [N, 1], without materialising [N, V]."""
    return scaled.gather(-1, tokens)[:, 0] - torch.logsumexp(scaled, dim=-1)


@dataclass
class ReplayResult:
    """Per-token outcome of replaying a sampled completion on the verifier's logits."""

    logprobs: torch.Tensor  # [N] verifier's logprobs of the claimed tokens
    # [N] best perturbed score over the core support minus the claimed token's: 0 (up to
    # numerical error) when honest, <= 0 for an honest near-tie at the support's boundary.
    score_gap: torch.Tensor
    in_support: torch.Tensor  # [N] bool: claimed token inside the lenient top-k/top-p mask


# Rows replayed per block: bounds the float64 noise temporaries to ~2**24 elements. The
# fused kernel makes no [rows, V] temporary, so it takes blocks as large as the logits of
# one block may be (2**28 elements: 512 MiB of bf16).
REPLAY_BLOCK_ELEMS = 2**24
FUSED_BLOCK_ELEMS = 2**28


class RowLogits:
    """Logits of hidden-state rows made on demand, a block at a time: `head(rows[i:j])`.
    Stands where a [N, V] logits tensor would, so a verifier never holds all of them."""

    def __init__(self, rows: torch.Tensor, head, vocab: int):
        self.rows, self.head = rows, head
        self.shape = (rows.shape[0], vocab)
        self.device = rows.device

    def __getitem__(self, block: slice) -> torch.Tensor:
        with torch.inference_mode():
            return self.head(self.rows[block])


@dataclass
class RowSpec:
    """Per-row replay inputs, on the logits' device: the claimed token, the sampling
    parameters and the noise key of each row."""

    tokens: torch.Tensor  # [N] int64
    t: torch.Tensor  # [N] float32 temperature scale (1 for greedy)
    top_k: torch.Tensor  # [N] int64 (vocab = no filter)
    top_p: torch.Tensor  # [N] float32
    stochastic: torch.Tensor  # [N] bool
    keys: torch.Tensor  # [N] int64 row_key(seed, position)
    filtering: torch.Tensor  # [N] bool: top-k or top-p removes something

    def __getitem__(self, block: slice) -> RowSpec:
        return RowSpec(*(getattr(self, f)[block] for f in self.__dataclass_fields__))


def row_spec(
    tokens: list[int],
    params: list[RowParams],
    seeds: list[int],
    sizes: list[int],
    vocab: int,
    device: torch.device,
) -> RowSpec:
    """Rows of several completions: completion c has `sizes[c]` rows (positions 0..n-1),
    sampled with `params[c]` and `seeds[c]`. Per-completion work in Python, per-row on
    the device."""
    t, k, p = param_tensors(params, vocab, device)
    n = torch.tensor(sizes, device=device)
    owner = torch.arange(len(sizes), device=device).repeat_interleave(n)  # completion of each row
    rows = lambda x: x[owner]  # noqa: E731 - per completion -> per row
    starts = torch.cumsum(n, 0) - n
    positions = torch.arange(owner.shape[0], device=device) - rows(starts)
    seed_keys = torch.tensor([seed_key(s) for s in seeds], dtype=torch.int64, device=device)
    return RowSpec(
        tokens=torch.tensor(tokens, dtype=torch.int64, device=device),
        t=rows(t),
        top_k=rows(k),
        top_p=rows(p),
        stochastic=rows(torch.tensor([x.temperature > 0 for x in params], device=device)),
        keys=row_keys(rows(seed_keys), positions),
        filtering=rows((k < vocab) | (p < 1.0)),
    )


def replay(
    logits: torch.Tensor, tokens: list[int], param: RowParams, seed: int, p_slack: float
) -> ReplayResult:
    """Replay the choice of `tokens` (one per row of `logits` [N, V]) under one request's params."""
    n = logits.shape[0]
    spec = row_spec(tokens, [param], [seed], [n], logits.shape[-1], logits.device)
    return replay_spec(logits, spec, p_slack)


def replay_rows(
    logits: torch.Tensor,
    tokens: list[int],
    params: list[RowParams],
    seeds: list[int],
    positions: list[int],
    p_slack: float,
) -> ReplayResult:
    """Replay rows of several completions at once: row r is position `positions[r]` of a
    completion sampled with `params[r]` and `seeds[r]` (batched replay: few kernel launches)."""
    dev, vocab = logits.device, logits.shape[-1]
    spec = row_spec(tokens, params, seeds, [1] * len(tokens), vocab, dev)
    spec.keys = torch.tensor(
        [row_key(s, p) for s, p in zip(seeds, positions, strict=True)], dtype=torch.int64
    ).to(dev)
    return replay_spec(logits, spec, p_slack)


def replay_spec(logits, spec: RowSpec, p_slack: float) -> ReplayResult:
    """Replay every row of `logits` ([N, V] tensor or `RowLogits`) against `spec`: on CUDA
    with Triton, blocks whose rows do not filter go through the fused kernel (one pass over
    the logits, no [rows, V] temporary); the rest through torch ops."""
    n, vocab = logits.shape
    fused = triton_available(torch.device(logits.device))
    block = max(1, (FUSED_BLOCK_ELEMS if fused else REPLAY_BLOCK_ELEMS) // vocab)
    step = max(1, REPLAY_BLOCK_ELEMS // vocab)
    parts = []
    for i in range(0, n, block):
        lg, sp = logits[i : i + block], spec[i : i + block]
        if fused and not bool(sp.filtering.any()):
            parts.append(_replay_fused(lg, sp))
            continue
        for j in range(0, lg.shape[0], step):
            parts.append(_replay_block(lg[j : j + step], sp[j : j + step], p_slack))
    return ReplayResult(
        logprobs=torch.cat([r.logprobs for r in parts]),
        score_gap=torch.cat([r.score_gap for r in parts]),
        in_support=torch.cat([r.in_support for r in parts]),
    )


def _replay_fused(logits: torch.Tensor, spec: RowSpec) -> ReplayResult:
    """Rows without filtering: the best perturbed score over the whole vocabulary."""
    best, _, lse = row_best_and_lse(logits, spec.t, spec.keys, spec.stochastic)
    picked = logits.gather(-1, spec.tokens[:, None])[:, 0].float() / spec.t
    claimed = picked + noise_at(spec.keys, spec.tokens) * spec.stochastic
    return ReplayResult(
        logprobs=picked - lse,
        score_gap=best - claimed,
        in_support=torch.ones_like(spec.stochastic),
    )


def _replay_block(logits: torch.Tensor, spec: RowSpec, p_slack: float) -> ReplayResult:
    logits = logits.float()
    n, vocab = logits.shape
    scaled = logits / spec.t[:, None]
    tok = spec.tokens[:, None]
    k, p = spec.top_k, spec.top_p
    # Support: the lenient mask (a superset of any honest generator's). Best score: over the
    # core mask (a subset of any honest generator's), so the claimed token, the best of the
    # generator's support, can trail it only by numerical error.
    lenient = support_mask(scaled, k, p, p_slack)
    core = lenient if lenient is None or p_slack <= 0 else core_mask(scaled, k, p, p_slack)
    scores = scaled
    if bool(spec.stochastic.any()):
        noise = noise_from_keys(spec.keys, vocab)
        if not bool(spec.stochastic.all()):
            noise *= spec.stochastic[:, None]
        scores = scaled + noise
    best = (scores if core is None else scores.masked_fill(~core, float("-inf"))).max(dim=-1).values
    gap = best - scores.gather(-1, tok)[:, 0]
    # An empty core (a near-tie at the most likely token, top_k = 1): nothing to trail.
    gap = gap.masked_fill(best == float("-inf"), 0.0)
    in_support = (
        torch.ones(n, dtype=torch.bool, device=logits.device)
        if lenient is None
        else lenient.gather(-1, tok)[:, 0]
    )
    return ReplayResult(logprobs=token_logprobs(scaled, tok), score_gap=gap, in_support=in_support)
