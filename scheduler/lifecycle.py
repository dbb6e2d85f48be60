"""A node's lifecycle: the one table of legal state changes, and their one writer.

This module owns `NodeRecord.state` (`scheduler.node_record`; it imports nothing else of
the scheduler, so no module here and the registry import each other). `TRANSITIONS` maps each
legal `(from_state, to_state)` to the events that cause it; `transition` is the only code
that assigns a node's state, and refuses (with `IllegalTransition`) any change the table
does not list, leaving the state as it was. Callers still decide *when* an event applies
(their guards stay); this table is the backstop that makes an illegal change fail in one
place instead of silently corrupting the pool's view.

States (`protocol.messages.NodeState`):
- registered: admitted, not yet callable (no heartbeat over an open channel yet).
- healthy: heartbeats and its channel is open; the only state that gets new work.
- unhealthy: silent, its channel dropped, its calls failing or timing out (benched), or
  restored from the database by a restarted scheduler (until it reconnects).
- dead: silent far too long; its work went elsewhere.
- draining: leaving cleanly: no new work, finishing what it has.
- left: gone after a clean leave.
- banned: caught cheating (or reputation under the threshold).

Invariants:
- `banned` is final: nothing leaves it (a same-state change is a no-op, not an error).
- `left` and `dead` are final but for a ban (a node that left or died may still lose a
  dispute over rollouts it generated before, and a ban must bar it from registering
  again). A node that registers again gets a NEW `NodeRecord` in state `registered`:
  that is a fresh record, not a transition.
- Only `heartbeat-with-channel` makes a node healthy, and only from registered or
  unhealthy: a draining, dead, left or banned node never turns healthy by heartbeating.
- A same-state change returns False and changes nothing; every other change either is in
  `TRANSITIONS` for the event given, or raises.
"""

from __future__ import annotations

from typing import get_args

from protocol.messages import NodeState
from scheduler.node_record import NodeRecord

STATES: tuple[NodeState, ...] = get_args(NodeState)

# Events, named for what causes them (the call site that raises each is in brackets).
HEARTBEAT = "heartbeat-with-channel"  # a heartbeat, or a channel opened, while connected
SILENT = "silent"  # no heartbeat for unhealthy_after_s [Registry.sweep]
SILENT_LONG = "silent-long"  # no heartbeat for dead_after_s [Registry.sweep]
CHANNEL_DROPPED = "channel-dropped"  # its channel closed [Registry.channel_closed]
CALLS_FAILING = "calls-failing"  # calls in a row failed (5xx, error) [NodeCalls]
BENCHED = "benched"  # calls in a row timed out [NodeCalls]
RESTART_RESTORE = "restart-restore"  # loaded by a restarted scheduler [server._load_state]
DRAIN = "drain"  # Deregister(stage="drain") [server.deregister]
LEAVE = "leave"  # Deregister(stage="leave") [server.deregister]
BAN = "ban"  # proof of dishonesty, or reputation under the threshold [Registry.ban/penalize]

_LEAVABLE: tuple[NodeState, ...] = ("registered", "healthy", "unhealthy", "draining", "dead")
_BANNABLE: tuple[NodeState, ...] = tuple(s for s in STATES if s != "banned")

# (from_state, to_state) -> the events that may cause it. Anything absent is illegal.
TRANSITIONS: dict[tuple[NodeState, NodeState], frozenset[str]] = {
    ("registered", "healthy"): frozenset({HEARTBEAT}),
    ("unhealthy", "healthy"): frozenset({HEARTBEAT}),
    ("registered", "unhealthy"): frozenset({SILENT, BENCHED}),
    ("healthy", "unhealthy"): frozenset(
        {SILENT, CHANNEL_DROPPED, CALLS_FAILING, BENCHED, RESTART_RESTORE}
    ),
    ("draining", "unhealthy"): frozenset({SILENT}),
    ("unhealthy", "dead"): frozenset({SILENT_LONG}),
    ("registered", "draining"): frozenset({DRAIN}),
    ("healthy", "draining"): frozenset({DRAIN}),
    ("unhealthy", "draining"): frozenset({DRAIN}),
    **{(s, "left"): frozenset({LEAVE}) for s in _LEAVABLE},
    **{(s, "banned"): frozenset({BAN}) for s in _BANNABLE},
}

_FINAL = {
    "banned": "banned is final",
    "left": "left is final but for a ban",
    "dead": "dead is final but for a ban",
}

# Each event's target state (an event names one destination).
EVENTS: dict[str, NodeState] = {e: to for (_, to), events in TRANSITIONS.items() for e in events}


class IllegalTransition(ValueError):
    """A state change that `TRANSITIONS` does not allow (the node's state is unchanged)."""

    def __init__(self, node_id: str, from_state: str, to_state: str, event: str, why: str = ""):
        self.node_id, self.from_state, self.to_state, self.event = (
            node_id,
            from_state,
            to_state,
            event,
        )
        super().__init__(
            f"node {node_id}: illegal transition {from_state} -> {to_state} on {event!r}"
            + (f" ({why})" if why else "")
        )


def allowed(from_state: str, to_state: str, event: str) -> bool:
    """Whether `event` may move a node from `from_state` to `to_state` (a same-state move
    is allowed, as a no-op, for any event that leads to that state)."""
    if EVENTS.get(event) != to_state:
        return False
    return from_state == to_state or event in TRANSITIONS.get((from_state, to_state), ())


def transition(node: NodeRecord, to: NodeState, event: str, reason: str = "") -> bool:
    """Move `node` to state `to` because of `event`: True if its state changed, False for a
    same-state no-op; `IllegalTransition` (state unchanged) for a change the table does not
    allow. `reason`, when given, is recorded on a change (`NodeRecord.reason`)."""
    frm = node.state
    if event not in EVENTS:
        raise IllegalTransition(node.node_id, frm, to, event, "unknown event")
    if not allowed(frm, to, event):
        raise IllegalTransition(node.node_id, frm, to, event, _FINAL.get(frm, ""))
    if frm == to:
        return False
    node.state = to
    if reason:
        node.reason = reason
    return True
