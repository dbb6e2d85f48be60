"""Seeded Gumbel-max sampling and its replay by a verifier (DESIGN.md section 10)."""

from __future__ import annotations

import math

import pytest
import torch

from verifier.noise import gumbel_noise, row_key
from verifier.sampling import RowParams, replay, sample

EULER_GAMMA = 0.5772156649
GUMBEL_STD = math.pi / math.sqrt(6)  # 1.2825


# An independent reference of the noise, in plain Python integers, as any engine must compute it.
M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def reference_gumbel(seed: int, position: int, index: int) -> float:
    key = _mix(((_mix((seed + GOLDEN) & M64) ^ position) + GOLDEN) & M64)
    z = _mix((key + index * GOLDEN) & M64)
    u = ((z >> 11) + 0.5) * 2.0**-53
    return -math.log(-math.log(u))


def random_logits(rows: int, vocab: int, std: float = 2.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * std


# ---------------------------------------------------------------- noise


def test_noise_is_deterministic():
    a = gumbel_noise([1, 2, 3], [0, 5, 9], 1000)
    b = gumbel_noise([1, 2, 3], [0, 5, 9], 1000)
    assert a.dtype == torch.float32 and a.shape == (3, 1000)
    assert torch.equal(a, b)


def test_noise_row_depends_only_on_its_seed_and_position():
    batch = gumbel_noise([7, 8, 7], [3, 3, 4], 500)
    assert torch.equal(batch[0], gumbel_noise([7], [3], 500)[0])
    assert torch.equal(batch[1], gumbel_noise([8], [3], 500)[0])
    assert torch.equal(batch[2], gumbel_noise([7], [4], 500)[0])
    # A prefix of the vocabulary is the same noise.
    assert torch.equal(gumbel_noise([7], [3], 100)[0], batch[0, :100])


def test_noise_is_the_same_whatever_the_cpu_blocking(monkeypatch):
    """On a CPU the noise is made a few rows at a time (cache-sized passes); a row's values
    must not depend on the block it falls in, nor on where the blocks split the batch."""
    import verifier.noise as vn

    seeds, positions = list(range(11)), [3 * i for i in range(11)]
    whole = gumbel_noise(seeds, positions, 700)
    monkeypatch.setattr(vn, "CPU_NOISE_BLOCK_ELEMS", 3 * 700)  # 3 rows a block: 4 blocks
    blocked = gumbel_noise(seeds, positions, 700)
    assert torch.equal(blocked, whole)
    for r in (0, 2, 3, 10):  # first and last rows of blocks
        assert (
            blocked[r, 5].item()
            == torch.tensor(reference_gumbel(seeds[r], positions[r], 5), dtype=torch.float32).item()
        )


def test_noise_differs_across_seeds_and_positions():
    base = gumbel_noise([1], [0], 1000)[0]
    for seeds, positions in [([2], [0]), ([1], [1]), ([2**63 - 1], [0]), ([0], [0])]:
        other = gumbel_noise(seeds, positions, 1000)[0]
        # Independent draws: almost no coordinate coincides, and they are uncorrelated.
        assert (base == other).float().mean() < 0.01
        assert abs(torch.corrcoef(torch.stack([base, other]))[0, 1]) < 0.15
    assert row_key(1, 0) != row_key(0, 1)


def test_noise_matches_reference_bit_for_bit():
    seeds, positions = [0, 1, 12345, 2**63 - 1], [0, 7, 1000, 65535]
    noise = gumbel_noise(seeds, positions, 300)
    for r, (s, p) in enumerate(zip(seeds, positions, strict=True)):
        for i in (0, 1, 2, 99, 299):
            assert (
                noise[r, i].item()
                == torch.tensor(reference_gumbel(s, p, i), dtype=torch.float32).item()
            )


def test_noise_has_gumbel_moments():
    g = gumbel_noise([11], [0], 400_000)[0].double()
    assert torch.isfinite(g).all()
    assert abs(g.mean().item() - EULER_GAMMA) < 0.01
    assert abs(g.std().item() - GUMBEL_STD) < 0.01
    # Gumbel CDF exp(-exp(-x)): check a few quantiles.
    for x in (-1.0, 0.0, 1.0, 3.0):
        expected = math.exp(-math.exp(-x))
        assert abs((g <= x).double().mean().item() - expected) < 0.005


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_noise_identical_on_cuda():
    seeds, positions = [0, 3, 2**63 - 1], [0, 17, 4095]
    cpu = gumbel_noise(seeds, positions, 150_000, device="cpu")
    gpu = gumbel_noise(seeds, positions, 150_000, device="cuda")
    assert gpu.device.type == "cuda"
    assert torch.equal(cpu, gpu.cpu())


# ---------------------------------------------------------------- sample


def test_temperature_zero_is_argmax_whatever_the_seed():
    logits = random_logits(32, 100)
    params = [RowParams(0.0, 0, 1.0)] * 32
    for seed in (0, 1, 99):
        out = sample(logits, params, [seed] * 32, list(range(32)))
        assert torch.equal(out.tokens, logits.argmax(-1))
    # Greedy logprobs are under T = 1.
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1).max(-1).values)


def test_top_k_one_is_argmax():
    logits = random_logits(32, 100)
    out = sample(logits, [RowParams(1.5, 1, 1.0)] * 32, list(range(32)), [0] * 32)
    assert torch.equal(out.tokens, logits.argmax(-1))


def test_stochastic_sampling_is_seeded():
    logits = random_logits(16, 100)
    params = [RowParams(1.0, 0, 1.0)] * 16
    a = sample(logits, params, [5] * 16, list(range(16)))
    b = sample(logits, params, [5] * 16, list(range(16)))
    c = sample(logits, params, [6] * 16, list(range(16)))
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, c.tokens)


def test_rows_of_a_batch_use_their_own_params():
    logits = random_logits(1, 50).repeat(3, 1)
    params = [RowParams(0.0, 0, 1.0), RowParams(1.0, 3, 1.0), RowParams(1.0, 0, 1.0)]
    out = sample(logits, params, [1, 2, 3], [0, 0, 0])
    alone = [sample(logits[i : i + 1], [params[i]], [i + 1], [0]).tokens[0] for i in range(3)]
    assert out.tokens.tolist() == [t.item() for t in alone]
    assert out.tokens[0] == logits[0].argmax()


def _draws(row: torch.Tensor, param: RowParams, n: int, seed_offset: int = 0) -> torch.Tensor:
    """n samples from one logits row, one per seed."""
    logits = row[None, :].expand(n, -1)
    return sample(logits, [param] * n, [seed_offset + i for i in range(n)], [0] * n).tokens


def _nucleus(probs: torch.Tensor, p: float) -> set[int]:
    order = probs.argsort(descending=True).tolist()
    out, mass = set(), 0.0
    for t in order:
        out.add(t)
        mass += probs[t].item()
        if mass >= p:
            break
    return out


@pytest.mark.parametrize("top_k", [1, 3, 10])
def test_top_k_never_picks_outside_support(top_k):
    row = random_logits(1, 200, std=1.0, seed=3)[0]
    tokens = _draws(row, RowParams(1.5, top_k, 1.0), 4000)
    allowed = set(row.topk(top_k).indices.tolist())
    seen = set(tokens.tolist())
    assert seen <= allowed
    assert seen == allowed  # and every token of the support can be picked


@pytest.mark.parametrize("top_p", [0.3, 0.55, 0.75, 0.9])
def test_top_p_never_picks_outside_nucleus(top_p):
    row = random_logits(1, 100, std=2.0, seed=4)[0]
    temp = 0.8
    tokens = _draws(row, RowParams(temp, 0, top_p), 4000)
    probs = torch.softmax(row.double() / temp, -1)
    nucleus = _nucleus(probs, top_p)
    seen = set(tokens.tolist())
    assert seen <= nucleus
    # Every nucleus token with a fair share of the renormalised mass does get picked.
    mass = sum(probs[t].item() for t in nucleus)
    assert {t for t in nucleus if probs[t].item() / mass > 0.005} <= seen


def test_top_k_and_top_p_together_stay_in_both():
    row = random_logits(1, 100, std=2.0, seed=5)[0]
    temp, k, p = 1.2, 8, 0.7
    tokens = set(_draws(row, RowParams(temp, k, p), 4000).tolist())
    topk = set(row.topk(k).indices.tolist())
    # top-p applies to the renormalised top-k distribution.
    probs = torch.softmax(row.double() / temp, -1)
    in_k = torch.zeros_like(probs)
    idx = torch.tensor(sorted(topk))
    in_k[idx] = probs[idx] / probs[idx].sum()
    assert tokens <= topk & _nucleus(in_k, p)


def _chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    n = counts.sum().item()
    exp = expected_probs * n
    mask = exp > 0
    return (((counts[mask] - exp[mask]) ** 2) / exp[mask]).sum().item()


@pytest.mark.parametrize(
    "temp,top_k,vocab",
    [(1.0, 0, 8), (0.6, 0, 8), (2.0, 0, 12), (1.0, 4, 10)],
)
def test_empirical_frequencies_match_softmax(temp, top_k, vocab):
    """Gumbel-max is an exact sampler of softmax(logits / T) (renormalised over top-k)."""
    row = random_logits(1, vocab, std=1.0, seed=vocab)[0]
    n = 40_000
    tokens = _draws(row, RowParams(temp, top_k, 1.0), n, seed_offset=1000)
    counts = torch.bincount(tokens, minlength=vocab).double()
    scaled = row.double() / temp
    if top_k:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[row.topk(top_k).indices] = True
        scaled = scaled.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scaled, -1)
    dof = int((probs > 0).sum()) - 1
    # Chi-square with dof degrees of freedom: mean dof, sd sqrt(2 dof); 6 sd is a loose bound.
    assert _chi_square(counts, probs) < dof + 6 * math.sqrt(2 * dof)
    assert counts[probs == 0].sum() == 0
    assert (counts / n - probs).abs().max() < 0.01


def test_wrong_temperature_is_detectable_by_frequencies():
    """Sanity check of the statistic above: it tells T = 1 from T = 0.5."""
    row = random_logits(1, 8, std=1.0, seed=8)[0]
    counts = torch.bincount(_draws(row, RowParams(1.0, 0, 1.0), 40_000), minlength=8).double()
    wrong = torch.softmax(row.double() / 0.5, -1)
    assert _chi_square(counts, wrong) > 100


def test_logprobs_are_untruncated_log_softmax_at_temperature():
    logits = random_logits(64, 100)
    temp = 0.7
    out = sample(logits, [RowParams(temp, 5, 0.8)] * 64, [9] * 64, list(range(64)))
    expected = torch.log_softmax(logits / temp, -1).gather(-1, out.tokens[:, None])[:, 0]
    assert torch.allclose(out.logprobs, expected, atol=1e-6)
    assert (out.logprobs <= 0).all()


def test_sample_accepts_half_precision_logits():
    logits = random_logits(8, 100).to(torch.bfloat16)
    out = sample(logits, [RowParams(0.0, 0, 1.0)] * 8, [0] * 8, list(range(8)))
    assert torch.equal(out.tokens, logits.float().argmax(-1))
    assert out.logprobs.dtype == torch.float32


# ---------------------------------------------------------------- replay


@pytest.mark.parametrize(
    "param",
    [
        RowParams(1.0, 0, 1.0),
        RowParams(0.8, 40, 0.9),
        RowParams(1.3, 0, 0.5),
        RowParams(0.0, 0, 1.0),
        RowParams(0.0, 5, 0.5),
    ],
)
def test_replay_of_honest_sample_has_zero_gap(param):
    n, seed = 64, 123456789
    logits = random_logits(n, 100, std=2.0, seed=1)
    out = sample(logits, [param] * n, [seed] * n, list(range(n)))
    res = replay(logits, out.tokens.tolist(), param, seed, p_slack=0.0)
    assert torch.equal(res.score_gap, torch.zeros(n))
    assert res.in_support.all()
    assert torch.equal(res.logprobs, out.logprobs)


def test_replay_with_different_temperature_flags_tokens():
    n, seed = 64, 7
    logits = random_logits(n, 100, std=2.0, seed=2)
    used, claimed = RowParams(1.0, 0, 1.0), RowParams(0.5, 0, 1.0)
    out = sample(logits, [used] * n, [seed] * n, list(range(n)))
    res = replay(logits, out.tokens.tolist(), claimed, seed, p_slack=0.0)
    flagged = (res.score_gap > 0.05).sum().item()
    assert flagged >= 5
    assert (res.score_gap >= 0).all()


def test_replay_with_wrong_seed_flags_most_tokens():
    n = 64
    logits = random_logits(n, 100, std=2.0, seed=3)
    param = RowParams(1.0, 0, 1.0)
    out = sample(logits, [param] * n, [1] * n, list(range(n)))
    res = replay(logits, out.tokens.tolist(), param, 2, p_slack=0.0)
    assert (res.score_gap > 0.05).float().mean() > 0.5


def test_replay_flags_greedy_tokens_passed_off_as_sampled():
    n, seed = 64, 11
    logits = random_logits(n, 100, std=2.0, seed=4)
    param = RowParams(1.0, 0, 1.0)
    greedy = logits.argmax(-1).tolist()
    res = replay(logits, greedy, param, seed, p_slack=0.0)
    assert (res.score_gap > 0.05).sum() >= 10


def test_replay_flags_tokens_outside_top_k():
    n, seed = 64, 5
    logits = random_logits(n, 100, std=2.0, seed=5)
    param = RowParams(1.0, 5, 1.0)
    worst = logits.argmin(-1).tolist()
    res = replay(logits, worst, param, seed, p_slack=0.05)
    assert not res.in_support.any()
    assert torch.isinf(res.score_gap).all() or (res.score_gap > 0.05).all()


def test_replay_support_slack_widens_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    param = RowParams(1.0, 0, 0.8)
    # Token 2 starts at mass 0.8: outside a strict top-p 0.8 nucleus, inside with slack.
    assert not replay(logits, [2], param, 0, p_slack=0.0).in_support.item()
    assert replay(logits, [2], param, 0, p_slack=0.01).in_support.item()
    assert not replay(logits, [3], param, 0, p_slack=0.01).in_support.item()


def test_replay_of_long_completion_matches_across_block_boundaries(monkeypatch):
    """Replay works in row blocks (bounded memory); positions must continue across blocks."""
    import verifier.sampling as vs

    torch.manual_seed(0)
    logits = torch.randn(70, 50) * 2
    param = vs.RowParams(temperature=1.0, top_k=0, top_p=1.0)
    tokens = [int(vs.sample(logits[i : i + 1], [param], [9], [i]).tokens[0]) for i in range(70)]
    monkeypatch.setattr(vs, "REPLAY_BLOCK_ELEMS", 16 * 50)  # 16 rows of 50 logits per block
    res = vs.replay(logits, tokens, param, seed=9, p_slack=0.0)
    assert res.score_gap.shape == (70,) and float(res.score_gap.max()) == 0.0
    shifted = vs.replay(logits[1:], tokens[1:], param, seed=9, p_slack=0.0)
    assert float(shifted.score_gap.max()) > 0  # positions matter: an off-by-one is caught


def test_batch_sampler_matches_sample_step_by_step():
    """The engines' per-batch sampler (keys on the device) picks exactly what `sample` picks."""
    import verifier.sampling as vs

    torch.manual_seed(1)
    params = [
        vs.RowParams(1.0, 0, 1.0),
        vs.RowParams(0.7, 20, 1.0),
        vs.RowParams(1.3, 0, 0.9),
        vs.RowParams(0.0, 0, 1.0),
    ]
    seeds = [1, 2**62 + 5, 0, 77]
    batch = vs.BatchSampler(params, seeds, 100, torch.device("cpu"))
    for step in range(20):
        logits = torch.randn(4, 100) * 2
        a, b = batch(logits, step), vs.sample(logits, params, seeds, [step] * 4)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)


def test_batched_replay_of_several_completions_equals_one_by_one():
    """The verifier replays many rollouts in one pass; per-row seeds/params/positions must
    give exactly what replaying each completion alone gives."""
    import verifier.sampling as vs

    torch.manual_seed(2)
    jobs = [
        (vs.RowParams(1.0, 0, 1.0), 11, 7),
        (vs.RowParams(0.6, 10, 1.0), 12, 5),
        (vs.RowParams(0.0, 0, 0.9), 13, 4),
    ]
    logits, tokens, params, seeds, positions, alone = [], [], [], [], [], []
    for param, seed, n in jobs:
        lg = torch.randn(n, 60) * 2
        toks = [int(vs.sample(lg[i : i + 1], [param], [seed], [i]).tokens[0]) for i in range(n)]
        alone.append(vs.replay(lg, toks, param, seed, p_slack=0.01))
        logits.append(lg)
        tokens += toks
        params += [param] * n
        seeds += [seed] * n
        positions += range(n)
    batched = vs.replay_rows(torch.cat(logits), tokens, params, seeds, positions, p_slack=0.01)
    assert torch.equal(batched.score_gap, torch.cat([r.score_gap for r in alone]))
    assert torch.equal(batched.logprobs, torch.cat([r.logprobs for r in alone]))
    assert bool(batched.in_support.all()) and float(batched.score_gap.max()) == 0.0
