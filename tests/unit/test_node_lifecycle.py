"""The node lifecycle (`scheduler.lifecycle`): one table, one writer of `NodeRecord.state`."""

from __future__ import annotations

import itertools

import pytest

from protocol.messages import ReputationPolicy
from scheduler.lifecycle import EVENTS, STATES, TRANSITIONS, IllegalTransition, transition
from scheduler.registry import NodeRecord, Registry
from tests.pools import node_record


def node(state: str = "healthy", **kw) -> NodeRecord:
    return node_record(1, state=state, **kw)


# What the lifecycle must allow, written out independently of the module's table.
EXPECTED = {
    ("registered", "healthy"): {"heartbeat-with-channel"},
    ("unhealthy", "healthy"): {"heartbeat-with-channel"},
    ("registered", "unhealthy"): {"silent", "benched"},
    ("healthy", "unhealthy"): {
        "silent",
        "channel-dropped",
        "calls-failing",
        "benched",
        "restart-restore",
    },
    ("draining", "unhealthy"): {"silent"},
    ("unhealthy", "dead"): {"silent-long"},
    ("registered", "draining"): {"drain"},
    ("healthy", "draining"): {"drain"},
    ("unhealthy", "draining"): {"drain"},
    **{(s, "left"): {"leave"} for s in ("registered", "healthy", "unhealthy", "draining", "dead")},
    **{(s, "banned"): {"ban"} for s in STATES if s != "banned"},
}


def test_the_table_is_the_expected_one():
    assert set(STATES) == {
        "registered",
        "healthy",
        "unhealthy",
        "dead",
        "draining",
        "left",
        "banned",
    }
    assert {k: set(v) for k, v in TRANSITIONS.items()} == EXPECTED
    assert not any(frm == "banned" for frm, _ in TRANSITIONS)  # banned is final
    assert {to for (frm, to) in TRANSITIONS if frm in ("left", "dead")} == {"banned", "left"}
    assert ("draining", "healthy") not in TRANSITIONS


@pytest.mark.parametrize(("frm", "to"), list(itertools.product(STATES, STATES)))
def test_every_pair_of_states_under_every_event(frm, to):
    for event in sorted(EVENTS):
        n = node(frm, reason="before")
        if frm == to and EVENTS[event] == to:
            assert transition(n, to, event, reason="why") is False  # a no-op
            assert n.state == frm and n.reason == "before"
        elif event in EXPECTED.get((frm, to), ()):
            assert transition(n, to, event, reason="why") is True
            assert n.state == to and n.reason == "why"
        else:
            with pytest.raises(IllegalTransition) as err:
                transition(n, to, event, reason="why")
            assert n.state == frm and n.reason == "before"  # unchanged
            msg = str(err.value)
            assert "n1" in msg and f"{frm} -> {to}" in msg and repr(event) in msg
            assert isinstance(err.value, ValueError)
    with pytest.raises(IllegalTransition, match="unknown event"):
        transition(node(frm), to, "no-such-event")


def test_registry_changes_states_only_through_the_lifecycle():
    reg = Registry(ReputationPolicy(initial=1.0, penalty_lost_dispute=0.5, ban_below=0.3))
    # A banned node that heartbeats, even over an open channel, stays banned.
    banned = node("banned", connected=True)
    reg.add(banned)
    reg.seen(banned)
    assert banned.state == "banned"
    # A draining node never becomes healthy through `seen`.
    draining = node("draining", node_id="n2", connected=True)
    reg.add(draining)
    reg.seen(draining, now=5.0)
    assert draining.state == "draining" and draining.last_seen == 5.0
    # `seen` turns a connected registered node healthy; `sweep` unhealthy, then dead.
    fresh = node("registered", node_id="n3", connected=True)
    reg.add(fresh)
    reg.seen(fresh, now=100.0)
    assert fresh.state == "healthy"
    changed = reg.sweep(200.0, 25, 45)  # everyone silent: both steps in one sweep
    assert fresh in changed and draining in changed and banned not in changed
    assert (fresh.state, draining.state, banned.state) == ("dead", "dead", "banned")
    # A dead node does not heartbeat back to life (it registers again: a new record).
    reg.seen(fresh, now=201.0)
    assert fresh.state == "dead"
    with pytest.raises(IllegalTransition, match="dead is final"):
        transition(fresh, "healthy", "heartbeat-with-channel")
    # `ban` and `penalize` ban through it, even a node that died; a ban is final.
    assert reg.ban(fresh, "forged") is True and fresh.state == "banned"
    assert fresh.reason == "forged"
    assert reg.ban(fresh, "again") is False and fresh.reason == "forged"
    loser = node("healthy", node_id="n4")
    reg.add(loser)
    assert [reg.penalize(loser, "lost") for _ in range(3)] == [False, True, False]
    assert loser.state == "banned" and loser.reason == "lost"
    with pytest.raises(IllegalTransition, match="banned is final"):
        transition(loser, "left", "leave")
    assert loser.state == "banned"
