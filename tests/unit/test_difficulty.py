"""Online difficulty filtering (`trainer.difficulty`): which prompts a round draws, from the
pass rates of verified rollouts; and its configuration's checks."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from pydantic import ValidationError

from trainer.config import BufferConfig, OrchestratorConfig
from trainer.difficulty import DifficultyBuffer, round_rng, uniform_rows

ON = BufferConfig(enabled=True, window=8, min_seen=4, revisit=0.0, hard_threshold=0.0, flat=0.5)


def buffer(cfg: BufferConfig = ON, size: int = 20) -> DifficultyBuffer:
    return DifficultyBuffer(cfg, size)


def test_prompts_always_or_never_solved_are_set_aside_once_seen_enough():
    b = buffer()
    b.observe(0, [1.0] * 3)  # solved, but only 3 of the 4 needed
    b.observe(1, [1.0] * 8)
    b.observe(2, [0.2, 0.5, 0.0, 0.9])  # graded, never a pass
    b.observe(3, [1.0, 0.0, 1.0, 0.3])
    b.observe(4, [0.5] * 4)
    kinds = ["active", "easy", "hard", "active", "hard", "active"]
    assert [b.kind(r) for r in range(6)] == kinds
    counts = {"prompts_seen": 5, "prompts_easy": 1, "prompts_hard": 2, "prompts_flat": 0}
    assert b.counts() == counts
    # The window forgets: a solved prompt failing again comes back.
    b.observe(1, [0.0] * 4)
    assert b.kind(1) == "active"
    # For a graded reward, failing every time may still carry signal: never hard; the same
    # answer every time carries none (flat), unless flat prompts are kept.
    graded = buffer(ON.model_copy(update={"hard_threshold": None}))
    graded.observe(2, [0.2, 0.5, 0.0, 0.9])
    graded.observe(4, [0.5] * 4)
    assert (graded.kind(2), graded.kind(4)) == ("active", "flat")
    graded.observe(4, [0.75])  # a revisit that differs: active again
    assert graded.kind(4) == "active"
    kept = buffer(ON.model_copy(update={"hard_threshold": None, "flat": None}))
    kept.observe(4, [0.5] * 4)
    assert kept.kind(4) == "active"
    # Flat is a chance of an all-equal group of 8: 15 of 16 the same (0.94 ** 8 = 0.60) is,
    # 7 of 8 (0.88 ** 8 = 0.34) is not.
    wide = buffer(ON.model_copy(update={"hard_threshold": None, "window": 16}))
    wide.observe(5, [0.5] * 15 + [0.25])
    wide.observe(6, [0.5] * 7 + [0.25])
    assert (wide.kind(5), wide.kind(6)) == ("flat", "active")


def test_a_round_draws_active_prompts_and_revisits_set_aside_ones_at_the_rate():
    b = buffer(ON.model_copy(update={"revisit": 0.25}), size=400)
    for r in range(200):  # half the prompts always solved
        b.observe(r, [1.0] * 4)
    drawn = Counter()
    for step in range(200):
        d = b.sample(round_rng("p", 0, step, 0), 20)
        assert len(set(d.rows)) == 20 and d.active + d.revisited == 20
        drawn.update("aside" if r < 200 else "active" for r in d.rows)
    assert drawn["aside"] / drawn.total() == pytest.approx(0.25, abs=0.03)


def test_a_round_never_starves_and_off_means_the_uniform_draw():
    b = buffer(size=6)
    for r in range(6):
        b.observe(r, [1.0] * 4)
    d = b.sample(round_rng("p", 0, 1, 0), 10)  # everything set aside, more asked than rows
    assert sorted(d.rows) == list(range(6)) and d.revisited == 6
    off = buffer(BufferConfig(), size=1000)
    for r in range(1000):
        off.observe(r, [1.0] * 8)
    assert off.sample(round_rng("p", 0, 3, 1), 8).rows == uniform_rows(
        round_rng("p", 0, 3, 1), 8, 1000
    )


def test_the_draw_depends_on_the_round_and_the_state_only_and_the_state_survives_json():
    b = buffer()
    for r in range(0, 20, 3):
        b.observe(r, [1.0, 1.0, 1.0, 1.0, 0.0])
    b.observe(1, [0.0] * 4)
    again = buffer()
    again.restore(json.loads(json.dumps(b.state())))
    assert again.rewards == b.rewards
    for step in range(5):
        assert b.sample(round_rng("p", 1, step, 0), 7) == again.sample(
            round_rng("p", 1, step, 0), 7
        )


def test_bad_buffer_and_group_settings_fail_naming_the_key():
    with pytest.raises(ValidationError, match="hard_threshold"):
        BufferConfig(easy_threshold=0.5, hard_threshold=0.5)
    with pytest.raises(ValidationError, match="min_size"):
        OrchestratorConfig.model_validate({"group_size": 4, "groups": {"min_size": 5}})
    with pytest.raises(ValidationError, match="priority"):
        OrchestratorConfig.model_validate({"eval": {"priority": 0}})
