"""Packing a step's samples into micro-batches, and sharing them out over ranks.

A packed row holds whole samples back to back, at most micro_batch_tokens of them.
Position ids restart at 0 at each sample start; transformers (sdpa, eager, flash) turns
that into a block-diagonal causal mask, so attention never crosses a sample boundary
(tests/unit/test_packing.py checks the logprobs against unpacked runs). A micro-batch is
[B, W]: B <= micro_batch_rows rows of similar width run in one forward, each padded at
its end to the widest, W; padding tokens come after every sample of their row (causal
attention: no real token sees them), continue the last sample's position ids (a row of
one sample stays a plain causal row) and carry no loss.

Invariants: targets are shifted inside each sample: position i carries token i+1 of the
same sample, with that token's loss mask, mu and the sample's advantage; the last
position of each sample has no target (mask False), so nothing predicts across a
boundary; padding has mask False, advantage 0 and is not counted in `num_tokens`; a
sample longer than the cap is an error, never truncated; every rank gets the same
number of micro-batches (padded with zero-weight ones), since FSDP collectives must line
up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.batch import TrainingSample


@dataclass
class MicroBatch:
    """One forward's rows: [B, W] (input ids, positions) or [B * W] (per-target), flat."""

    input_ids: Tensor
    position_ids: Tensor
    targets: Tensor
    loss_mask: Tensor
    mu: Tensor
    advantages: Tensor
    num_samples: int
    num_pad: int = 0  # padding positions at row ends (not tokens of any sample)

    @property
    def num_tokens(self) -> int:
        """Tokens of the samples (padding excluded)."""
        return self.input_ids.numel() - self.num_pad

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: torch.device) -> MicroBatch:
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return MicroBatch(
            **{k: v.to(device) if isinstance(v, Tensor) else v for k, v in fields.items()}
        )


def pack_row(samples: list[TrainingSample]) -> MicroBatch:
    """Concatenate whole samples into one row with shifted targets."""
    ids, pos, tgt, mask, mu, adv = [], [], [], [], [], []
    for s in samples:
        n = len(s.input_ids)
        ids += s.input_ids
        pos += range(n)
        tgt += s.input_ids[1:] + [0]
        mask += [bool(m) for m in s.loss_mask[1:]] + [False]
        mu += list(s.logprobs[1:]) + [0.0]
        adv += [float(s.advantage)] * n
    return MicroBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([pos], dtype=torch.long),
        targets=torch.tensor(tgt, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        mu=torch.tensor(mu, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32),
        num_samples=len(samples),
    )


def empty_micro_batch(pad_id: int = 0) -> MicroBatch:
    """A one-token row with no loss tokens: keeps a rank's collectives in step."""
    return pack_row([TrainingSample([pad_id], [False], [0.0], 0.0)])


def pack_rows(rows: list[list[TrainingSample]], pad_id: int = 0) -> MicroBatch:
    """Several packed rows as one [B, W] micro-batch, each padded at its end to W."""
    packed = [pack_row(r) for r in rows]
    if len(packed) == 1:
        return packed[0]
    width = max(mb.input_ids.shape[1] for mb in packed)
    ids, pos, tgt, mask, mu, adv = [], [], [], [], [], []
    for mb in packed:
        pad = width - mb.input_ids.shape[1]
        last = int(mb.position_ids[0, -1])
        ids.append(torch.cat([mb.input_ids[0], torch.full((pad,), pad_id, dtype=torch.long)]))
        # positions go on from the last sample's: no restart, so no extra mask block
        pos.append(torch.cat([mb.position_ids[0], torch.arange(last + 1, last + 1 + pad)]))
        tgt.append(torch.cat([mb.targets, torch.zeros(pad, dtype=torch.long)]))
        mask.append(torch.cat([mb.loss_mask, torch.zeros(pad, dtype=torch.bool)]))
        mu.append(torch.cat([mb.mu, torch.zeros(pad)]))
        adv.append(torch.cat([mb.advantages, torch.zeros(pad)]))
    return MicroBatch(
        input_ids=torch.stack(ids),
        position_ids=torch.stack(pos),
        targets=torch.cat(tgt),
        loss_mask=torch.cat(mask),
        mu=torch.cat(mu),
        advantages=torch.cat(adv),
        num_samples=sum(mb.num_samples for mb in packed),
        num_pad=width * len(packed) - sum(mb.num_tokens for mb in packed),
    )


def pack_samples(samples: list[TrainingSample], max_tokens: int) -> list[list[TrainingSample]]:
    """First-fit decreasing bins of whole samples, each bin at most `max_tokens` tokens."""
    too_long = [len(s.input_ids) for s in samples if len(s.input_ids) > max_tokens]
    if too_long:
        raise ValueError(
            f"{len(too_long)} sample(s) longer than micro_batch_tokens={max_tokens} (longest "
            f"{max(too_long)} tokens): raise micro_batch_tokens or cap the sequence length"
        )
    bins: list[list[TrainingSample]] = []
    room: list[int] = []
    # Stable sort on length: the same batch always packs the same way (reproducible runs).
    for s in sorted(samples, key=lambda s: -len(s.input_ids)):
        n = len(s.input_ids)
        for i, r in enumerate(room):
            if n <= r:
                bins[i].append(s)
                room[i] -= n
                break
        else:
            bins.append([s])
            room.append(max_tokens - n)
    return bins


def split_for_rank(
    bins: list[list[TrainingSample]],
    rank: int,
    world_size: int,
    pad_id: int = 0,
    rows: int = 1,
) -> list[MicroBatch]:
    """This rank's micro-batches: bins dealt round-robin, then (rows > 1) grouped widest
    first, `rows` bins per [rows, W] micro-batch; all ranks get the same count."""
    per_rank = -(-len(bins) // world_size) if bins else 1
    mine = bins[rank::world_size]
    if rows > 1:  # similar widths together: less padding (stable: reproducible groups)
        mine = sorted(mine, key=lambda b: -sum(len(s.input_ids) for s in b))
    out = [pack_rows(mine[i : i + rows], pad_id) for i in range(0, len(mine), rows)]
    out += [empty_micro_batch(pad_id) for _ in range(-(-per_rank // rows) - len(out))]
    return out


def count_loss_tokens(samples: list[TrainingSample]) -> int:
    """Loss tokens of the step (positions 1.. of each sample; position 0 has no predictor)."""
    return sum(sum(bool(m) for m in s.loss_mask[1:]) for s in samples)
