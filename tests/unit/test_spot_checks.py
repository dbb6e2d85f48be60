"""Per-node spot-check rates (`protocol.messages.SpotCheckPolicy`) and the bound a pool
states with them: the schedule a node's history earns, the bound's promise checked by
drawing, a pool file that sets two rates at once refused; and the holds
(`scheduler.spot_checks.SpotChecks`): which check may release a skipped rollout."""

from __future__ import annotations

import asyncio
import random

import pytest
from pydantic import ValidationError

from protocol.messages import SpotCheckPolicy, VerificationPolicy
from scheduler.spot_checks import SpotChecks
from tests.pools import node_record


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


async def test_only_a_check_of_a_later_rollout_vouches_for_a_held_one():
    """A node's rollout 2 is skipped and held while its rollout 1 is being verified: 1's
    acceptance does not release 2 (a node that turned between them would have its first
    lie vouched for by an honest rollout); an accepted check of its rollout 3 does, and a
    rejected check of any rollout sends every held one to verification."""
    spot = SpotChecks(
        VerificationPolicy(spot_checks=SpotCheckPolicy(full_until=0, floor=0.5, hold_s=5.0)),
        random.Random(1),
    )
    node = node_record(1)
    first, second = spot.arrived(node), spot.arrived(node)
    spot.started(node, first)
    node.in_flight = 1  # a later rollout is being generated: the hold waits for it
    hold = asyncio.create_task(spot.hold(node, second))
    await asyncio.sleep(0.1)
    spot.checked(node, first, accepted=True)
    spot.ended(node, first)
    await asyncio.sleep(0.2)
    assert not hold.done() and spot.held(node) == 1
    third = spot.arrived(node)
    spot.started(node, third)
    node.in_flight = 0
    spot.checked(node, third, accepted=True)
    assert await hold is True
    # A rejection, whichever rollout it is about, sends the held ones to verification.
    fourth, fifth = spot.arrived(node), spot.arrived(node)
    spot.started(node, fourth)
    hold = asyncio.create_task(spot.hold(node, fifth))
    await asyncio.sleep(0.1)
    spot.checked(node, fourth, accepted=False)
    assert await hold is False
    # No later check coming (nothing under way): verified at once, not held for 5 s.
    spot.ended(node, fourth)
    assert await asyncio.wait_for(spot.hold(node, spot.arrived(node)), 1.0) is False
