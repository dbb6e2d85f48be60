"""Per-node spot-check rates (`protocol.messages.SpotCheckPolicy`) and the bound a pool
states with them: the schedule a node's history earns, the bound's promise checked by
drawing, and a pool file that sets two rates at once refused."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from protocol.messages import SpotCheckPolicy, VerificationPolicy


def test_a_node_is_checked_fully_until_its_history_earns_fewer_checks():
    p = SpotCheckPolicy(full_until=64, halving=32, floor=0.1)
    assert [p.rate(e) for e in (-5, 0, 63, 64)] == [1.0, 1.0, 1.0, 1.0]
    assert p.rate(96) == pytest.approx(0.5)
    assert p.rate(128) == pytest.approx(0.25)
    assert p.rate(10_000) == 0.1  # never below the floor
    rates = [p.rate(e) for e in range(400)]
    assert rates == sorted(rates, reverse=True)


@pytest.mark.parametrize("floor", [0.05, 0.1, 0.25])
def test_the_stated_bound_holds_for_a_cheat_at_the_floor(floor):
    """A node cheating on every rollout at the floor rate: the unchecked cheat rollouts
    before its first checked one exceed `bound(1e-2)` in about 1% of 20,000 tries."""
    p = SpotCheckPolicy(floor=floor)
    bound, rng, over = p.bound(1e-2), random.Random(5), 0
    for _ in range(20_000):
        unchecked = 0
        while rng.random() >= floor:
            unchecked += 1
        over += unchecked > bound
    assert over / 20_000 <= 0.0125
    assert (1 - floor) ** (bound - 1) > 1e-2  # and it is the least such bound


def test_a_pool_sets_one_spot_check_rule():
    VerificationPolicy(spot_checks=SpotCheckPolicy())
    VerificationPolicy(spot_check_rate=0.5)
    with pytest.raises(ValidationError, match="not both"):
        VerificationPolicy(spot_check_rate=0.5, spot_checks=SpotCheckPolicy())
