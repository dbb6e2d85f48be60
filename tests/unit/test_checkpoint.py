"""Trainer checkpoints (single process): exact restore, markers, keep-last cleanup; LR schedule."""

from __future__ import annotations

import random

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from trainer.checkpoint import (
    CheckpointWriter,
    checkpoint_dir,
    cleanup_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from trainer.config import OptimConfig
from trainer.train import lr_factor


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = LambdaLR(opt, lr_factor(OptimConfig(lr=1e-2, schedule="cosine"), 10))
    return model, opt, sched


def _train(model, opt, sched, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(16, 4)  # draws from the torch RNG, which the checkpoint restores
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def test_restore_continues_exactly_like_an_uninterrupted_run(tmp_path):
    ref = _setup()
    _train(*ref, 6)

    first = _setup()
    _train(*first, 3)
    random.random()
    save_checkpoint(tmp_path, 3, *first)
    expected_py = random.random()
    _train(*first, 5)  # diverge, then come back

    resumed = _setup(seed=1)  # different initial weights: all must come from the checkpoint
    assert load_checkpoint(tmp_path, 3, *resumed) == 3
    assert random.random() == expected_py
    _train(*resumed, 3)
    for a, b in zip(ref[0].parameters(), resumed[0].parameters(), strict=True):
        assert torch.equal(a, b)
    assert resumed[2].get_last_lr() == ref[2].get_last_lr()


def test_a_checkpoint_written_in_the_background_holds_the_state_of_its_step(tmp_path):
    """`CheckpointWriter` (issue 28): the trainer trains on while the checkpoint of step 3
    is written; resuming from it still reproduces an uninterrupted run, and keep_last
    holds once each write completes."""
    ref = _setup()
    _train(*ref, 6)

    first = _setup()
    writer = CheckpointWriter(tmp_path, keep_last=1, background=True)
    _train(*first, 1)
    writer.save(1, *first)
    _train(*first, 2)  # while (or after) step 1's checkpoint is written
    writer.save(3, *first)
    _train(*first, 5)  # diverge while step 3's checkpoint is written
    writer.wait()
    assert latest_checkpoint(tmp_path) == 3
    assert not checkpoint_dir(tmp_path, 1).exists()  # keep_last 1, after 3 completed

    resumed = _setup(seed=1)
    assert load_checkpoint(tmp_path, 3, *resumed) == 3
    _train(*resumed, 3)
    for a, b in zip(ref[0].parameters(), resumed[0].parameters(), strict=True):
        assert torch.equal(a, b)


def test_incomplete_checkpoints_are_ignored_and_cleanup_keeps_the_newest(tmp_path):
    model, opt, sched = _setup()
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, model, opt, sched)
    checkpoint_dir(tmp_path, 8).mkdir(parents=True)  # a crash before the marker
    (checkpoint_dir(tmp_path, 4).parent / "orchestrator").mkdir()  # someone else's state
    assert latest_checkpoint(tmp_path) == 6
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path, 8, model, opt, sched)

    assert cleanup_checkpoints(tmp_path, keep_last=1) == [2, 4]
    assert not checkpoint_dir(tmp_path, 2).parent.exists()
    assert not checkpoint_dir(tmp_path, 4).exists()
    assert (checkpoint_dir(tmp_path, 4).parent / "orchestrator").exists()
    assert checkpoint_dir(tmp_path, 8).exists()  # never deleted: not known to be complete
    assert latest_checkpoint(tmp_path) == 6


@pytest.mark.parametrize(
    "schedule,expected",
    [
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.5, 1.0, 0.7, 0.4, 0.1]),
        ("cosine", [0.5, 1.0, 0.775, 0.325, 0.1]),
    ],
)
def test_lr_schedule_warms_up_then_decays_to_the_floor(schedule, expected):
    f = lr_factor(OptimConfig(warmup_steps=2, schedule=schedule, min_lr_ratio=0.1), 5)
    assert [f(s) for s in range(5)] == pytest.approx(expected)
