"""Packing: packed rows and [B, W] micro-batches give the per-sample logprobs and the same
step; caps, errors and the rank split."""

from __future__ import annotations

import random

import pytest
import torch

from trainer.batch import TrainingSample
from trainer.config import LossConfig, ModelConfig, MonitorConfig, TrainerConfig
from trainer.model import PolicyModel, load_model
from trainer.packing import (
    count_loss_tokens,
    pack_row,
    pack_rows,
    pack_samples,
    split_for_rank,
)


def _samples(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[TrainingSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        L = rng.randint(lo, hi)
        prompt = rng.randint(1, L - 1)
        out.append(
            TrainingSample(
                input_ids=[rng.randrange(3, 90) for _ in range(L)],
                loss_mask=[False] * prompt + [True] * (L - prompt),
                logprobs=[0.0] * prompt + [-1.0] * (L - prompt),
                advantage=rng.uniform(-1, 1),
            )
        )
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_per_sample_logprobs(attn):
    hf, _ = load_model(ModelConfig(name="tiny", attn_implementation=attn), "cpu")
    policy = PolicyModel(hf, chunk=16).eval()
    samples = _samples(6, seed=1)
    mb = pack_row(samples)
    with torch.no_grad():
        packed, _ = policy(mb.input_ids, mb.position_ids, mb.targets)
        start = 0
        for s in samples:
            n = len(s.input_ids)
            ids = torch.tensor([s.input_ids])
            # reference: the plain HF forward on the sample alone, logits i predict token i+1
            logits = hf(input_ids=ids, use_cache=False).logits[0]
            ref = torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            torch.testing.assert_close(packed[start : start + n - 1], ref, rtol=1e-4, atol=1e-4)
            start += n


def test_pack_row_shifts_targets_mask_and_mu_within_each_sample():
    a = TrainingSample([5, 6, 7], [False, True, True], [0.0, -0.5, -0.7], 2.0)
    b = TrainingSample([8, 9], [False, True], [0.0, -0.9], -1.0)
    mb = pack_row([a, b])
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert mb.targets.tolist()[:2] == [6, 7] and mb.targets[3].item() == 9
    assert mb.loss_mask.tolist() == [True, True, False, True, False]
    assert mb.mu.tolist() == pytest.approx([-0.5, -0.7, 0.0, -0.9, 0.0])
    assert mb.advantages.tolist() == [2.0, 2.0, 2.0, -1.0, -1.0]
    assert mb.num_loss_tokens == count_loss_tokens([a, b]) == 3


def test_packing_respects_the_token_cap_and_keeps_every_sample():
    samples = _samples(50, seed=2, hi=60)
    bins = pack_samples(samples, 128)
    assert all(sum(len(s.input_ids) for s in b) <= 128 for b in bins)
    assert sorted(id(s) for b in bins for s in b) == sorted(id(s) for s in samples)
    lower_bound = -(-sum(len(s.input_ids) for s in samples) // 128)
    assert len(bins) <= lower_bound + 2  # first-fit decreasing packs tightly


def test_a_sample_longer_than_the_cap_is_a_clear_error():
    with pytest.raises(ValueError, match="longer than micro_batch_tokens=16"):
        pack_samples(_samples(3, hi=40, lo=30), 16)


@pytest.mark.parametrize("n_bins,world", [(0, 2), (1, 2), (5, 2), (7, 4), (8, 4)])
def test_rank_split_gives_every_rank_the_same_number_of_micro_batches(n_bins, world):
    bins = [[s] for s in _samples(n_bins, seed=3)]
    parts = [split_for_rank(bins, r, world) for r in range(world)]
    assert len({len(p) for p in parts}) == 1
    assert sum(p.num_samples for part in parts for p in part if p.num_loss_tokens) == n_bins
    padding = [p for part in parts for p in part if p.num_loss_tokens == 0]
    assert all(p.num_tokens == 1 for p in padding)


def test_rows_micro_batch_gives_the_logprobs_of_its_rows_one_by_one():
    hf, _ = load_model(ModelConfig(name="tiny"), "cpu")
    policy = PolicyModel(hf, chunk=16).eval()
    bins = pack_samples(_samples(9, seed=4, hi=50), 64)
    assert len(bins) >= 3 and len({sum(len(s.input_ids) for s in b) for b in bins}) > 1
    mb = pack_rows(bins, pad_id=0)
    B, W = mb.input_ids.shape
    assert len(bins) == B and mb.targets.shape == (B * W,)
    assert mb.num_tokens == sum(len(s.input_ids) for b in bins for s in b)
    assert mb.num_pad == B * W - mb.num_tokens and mb.num_samples == 9
    with torch.no_grad():
        batched, ent_b = policy(mb.input_ids, mb.position_ids, mb.targets)
        for i, b in enumerate(bins):
            row = pack_row(b)
            n = row.num_tokens
            ref, ent = policy(row.input_ids, row.position_ids, row.targets)
            got = slice(i * W, i * W + n)
            torch.testing.assert_close(batched[got], ref, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(ent_b[got], ent, rtol=1e-4, atol=1e-4)
            for f in ("targets", "loss_mask", "mu", "advantages"):
                assert torch.equal(getattr(mb, f)[got], getattr(row, f)), f
            pad = slice(i * W + n, (i + 1) * W)  # padding: no loss, no advantage
            assert not mb.loss_mask[pad].any() and not mb.advantages[pad].any()
            last = int(row.position_ids[0, -1])  # padding positions go on: no new mask block
            assert mb.position_ids[i, n:].tolist() == list(range(last + 1, last + 1 + W - n))


@pytest.mark.parametrize("rows", [2, 3, 8])
def test_a_step_on_rows_micro_batches_equals_the_step_row_by_row(tmp_path, rows):
    from trainer.train import Trainer

    samples = _samples(10, seed=5, hi=60)

    def run(r: int):
        cfg = TrainerConfig(
            run_dir=tmp_path / f"rows{r}", device="cpu", micro_batch_tokens=64,
            micro_batch_rows=r, model=ModelConfig(name="tiny"),
            loss=LossConfig(logprob_chunk=32), monitor=MonitorConfig(progress=False),
        )  # fmt: skip
        t = Trainer(cfg)
        m = t.step(samples, "rl")
        return m, {k: v.detach().clone() for k, v in t.policy.lm.state_dict().items()}

    m1, w1 = run(1)
    mr, wr = run(rows)
    n_bins = len(pack_samples(samples, 64))
    assert m1["micro_batches"] == n_bins and mr["micro_batches"] == -(-n_bins // rows)
    assert mr["tokens"] == m1["tokens"] == sum(len(s.input_ids) for s in samples)
    assert mr["loss_tokens"] == m1["loss_tokens"] == count_loss_tokens(samples)
    for k in ("loss", "grad_norm", "entropy", "mismatch_kl"):
        assert mr[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    for k in w1:
        torch.testing.assert_close(wr[k], w1[k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("n_bins,world,rows", [(0, 2, 3), (5, 2, 2), (7, 4, 2), (9, 2, 4)])
def test_rank_split_with_rows_keeps_ranks_in_step(n_bins, world, rows):
    bins = [[s] for s in _samples(n_bins, seed=6)]
    parts = [split_for_rank(bins, r, world, rows=rows) for r in range(world)]
    assert len({len(p) for p in parts}) == 1
    assert sum(p.num_samples for part in parts for p in part if p.num_loss_tokens) == n_bins
    assert all(p.input_ids.shape[0] <= rows for part in parts for p in part)
