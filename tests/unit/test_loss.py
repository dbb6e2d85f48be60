"""The objectives: chunked logprobs match the plain computation; AIPO and SFT losses."""

from __future__ import annotations

import pytest
import torch

from trainer.loss import aipo_loss, chunked_logprobs, sft_loss

T, H, V = 37, 16, 50


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    return hidden, weight, targets


def _reference(hidden, weight, targets, temperature):
    logits = (hidden @ weight.t()).float() / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_match_unchunked_values_and_gradients(chunk, temperature):
    hidden, weight, targets = _inputs()
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)

    logp, ent = chunked_logprobs(hidden, weight, targets, temperature, chunk)
    (logp * w_lp + ent * w_ent).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    ref_lp, ref_ent = _reference(hidden, weight, targets, temperature)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()

    torch.testing.assert_close(logp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-4, atol=1e-5)


def test_chunked_logprobs_gradcheck():
    hidden, weight, targets = _inputs()
    hidden, weight = hidden[:5].detach().requires_grad_(), weight.detach().requires_grad_()

    def f(h, w):
        lp, ent = chunked_logprobs(h, w, targets[:5], 1.3, 2)
        return lp.double(), ent.double()

    # float32 inside the kernel: loose tolerances, but a wrong formula fails by far
    assert torch.autograd.gradcheck(f, (hidden, weight), eps=1e-3, atol=1e-2, rtol=1e-2)


def test_aipo_on_policy_is_advantage_weighted_reinforce():
    hidden, weight, targets = _inputs()
    logp, ent = chunked_logprobs(hidden, weight, targets, 1.0, 8)
    mu = logp.detach().clone()
    adv = torch.linspace(-1, 1, T)
    mask = torch.rand(T, generator=torch.Generator().manual_seed(2)) > 0.3
    n = int(mask.sum())
    loss, sums = aipo_loss(logp, ent, mu, adv, mask, n, delta=8.0)
    (g_loss,) = torch.autograd.grad(loss, hidden, retain_graph=True)
    (g_ref,) = torch.autograd.grad(-(adv * logp * mask).sum() / n, hidden)
    torch.testing.assert_close(g_loss, g_ref)
    assert sums["ratio"].item() == pytest.approx(n)  # every ratio is 1
    assert sums["capped"].item() == 0
    assert sums["mismatch_kl"].item() == pytest.approx(0, abs=1e-6)
    assert sums["tokens"].item() == n


def test_aipo_caps_the_ratio_at_delta_and_counts_it():
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0], requires_grad=True)
    mu = torch.tensor([-1.0, -4.0, -1.5, -9.0])  # ratios 1, e^3 ~ 20, e^0.5, e^8
    adv = torch.ones(4)
    mask = torch.ones(4, dtype=torch.bool)
    loss, sums = aipo_loss(logp, torch.zeros(4), mu, adv, mask, 4, delta=8.0)
    loss.backward()
    expected_coef = torch.tensor([1.0, 8.0, float(torch.tensor(0.5).exp()), 8.0])
    torch.testing.assert_close(logp.grad, -expected_coef / 4)
    assert sums["capped"].item() == 2


def test_token_level_normalisation_weighs_every_token_equally():
    # A 10-token and a 2-token sequence with the same advantage: every token's gradient
    # is -A/12, whichever sequence it belongs to (a per-sequence mean would give -A/20 vs -A/4).
    logp = torch.full((12,), -2.0, requires_grad=True)
    mask = torch.ones(12, dtype=torch.bool)
    loss, _ = aipo_loss(logp, torch.zeros(12), logp.detach(), torch.ones(12), mask, 12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.full((12,), -1 / 12))


def test_kl_and_entropy_terms():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ent = torch.tensor([0.5, 1.5], requires_grad=True)
    mu = torch.tensor([-1.5, -1.0])
    mask = torch.ones(2, dtype=torch.bool)
    loss, sums = aipo_loss(logp, ent, mu, torch.zeros(2), mask, 2, kl_coef=0.1, entropy_coef=0.01)
    r = torch.exp(logp.detach() - mu)
    k3 = r - 1 - (logp.detach() - mu)
    assert loss.item() == pytest.approx((0.1 * k3.sum() - 0.01 * 2.0).item() / 2, rel=1e-6)
    assert sums["mismatch_kl"].item() == pytest.approx(k3.sum().item(), rel=1e-6)
    assert (k3 >= 0).all()


def test_sft_loss_equals_cross_entropy():
    hidden, weight, targets = _inputs()
    mask = torch.arange(T) % 3 != 0
    logp, ent = chunked_logprobs(hidden, weight, targets, 1.0, 5)
    loss, sums = sft_loss(logp, ent, mask, int(mask.sum()))
    ce = torch.nn.functional.cross_entropy(
        (hidden @ weight.t()).float()[mask], targets[mask], reduction="mean"
    )
    torch.testing.assert_close(loss, ce, rtol=1e-5, atol=1e-6)
    assert sums["nll"].item() == pytest.approx(ce.item() * int(mask.sum()), rel=1e-5)
