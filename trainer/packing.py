"""Packing a step's samples into micro-batches, and sharing them out over ranks.

A micro-batch is one row [1, L], L <= micro_batch_tokens, holding whole samples back to
back. Position ids restart at 0 at each sample start; transformers (sdpa, eager, flash)
turns that into a block-diagonal causal mask, so attention never crosses a sample
boundary (tests/unit/test_packing.py checks the logprobs against unpacked runs).

Invariants: targets are shifted inside each sample: position i carries token i+1 of the
same sample, with that token's loss mask, mu and the sample's advantage; the last
position of each sample has no target (mask False), so nothing predicts across a
boundary; a sample longer than the cap is an error, never truncated; every rank gets the
same number of micro-batches (padded with zero-weight ones), since FSDP collectives must
line up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.batch import TrainingSample


@dataclass
class MicroBatch:
    """One packed row; all tensors [1, L] (input ids, positions) or [L] (per-target)."""

    input_ids: Tensor
    position_ids: Tensor
    targets: Tensor
    loss_mask: Tensor
    mu: Tensor
    advantages: Tensor
    num_samples: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

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
    bins: list[list[TrainingSample]], rank: int, world_size: int, pad_id: int = 0
) -> list[MicroBatch]:
    """This rank's micro-batches: bins dealt round-robin, all ranks the same count."""
    per_rank = -(-len(bins) // world_size) if bins else 1
    mine = [pack_row(b) for b in bins[rank::world_size]]
    mine += [empty_micro_batch(pad_id) for _ in range(per_rank - len(mine))]
    return mine


def count_loss_tokens(samples: list[TrainingSample]) -> int:
    """Loss tokens of the step (positions 1.. of each sample; position 0 has no predictor)."""
    return sum(sum(bool(m) for m in s.loss_mask[1:]) for s in samples)
