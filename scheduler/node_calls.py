"""Calls to nodes: one POST over a node's channel with a timeout, cancelled when the node
dies, and what each call's outcome says about the node (its call counters, its bench).

`NodeCalls` is the one writer of a node's call counters (`in_flight`,
`outstanding_tokens`, `failures`, `timeouts`, `benched_until`; see
`scheduler.node_record`). The dispatch loop (`scheduler.dispatch`) asks it for calls and
never touches those counters; a test drives the loop over a fake with this interface.

Outcomes of a call:
- answered (2xx): the body is returned; the node's runs of failures and timeouts end.
- refused (`REFUSAL_STATUSES`: 400, 413, 422): the node found the request itself invalid
  (too long for it, say): `NodeRefused`, not the node's fault, nothing counted against it
  (an honest node is never punished for what a client asked of it). Once another node
  serves that request, though, the refusal was not about the request: the dispatch loop
  reports it (`refused_what_others_serve`) and it counts as a failed call, so a node that
  refuses every call stops being chosen (an honest one answers calls in between, which
  ends the run; it is benched, never banned, for it).
- failed (any 5xx, or an unexpected error): `NodeFailed`, one more failure in a row.
- timed out (no answer within the call's timeout): `NodeFailed`, one more timeout in a row.
- lost (its channel closed, the node died, left, was banned or registered again):
  `NodeFailed`, nothing counted: the channel's own lifecycle already keeps the node out of
  work until it reconnects with a signed hello (`scheduler.channel`, `Registry.channel_closed`).
- any other 4xx: `NodeFailed`, nothing counted (the node answered, and it is not work the
  node did badly: an expired envelope, an id it saw before).

Benching (the lifecycle rule for failing nodes): `STRIKES_BEFORE_BENCH` failures, or as
many timeouts, in a row make a node unhealthy (`CALLS_FAILING` or `BENCHED`) and bench it
for `BENCH_S`, doubling with every further failure or timeout in that run, up to
`MAX_BENCH_S`. Heartbeats do not end a run (a node that heartbeats but answers 500, or
never answers, is exactly what this catches) and do not make a benched node healthy before
its bench ends (`Registry.seen`). Once it ends, the node's next heartbeat makes it healthy
and it gets one call at a time (`NodeRecord.call_slots`), the probe: answered, the run is
over; failed or timed out, the node is benched again, twice as long. Only an answered
call ends a run (and while one lasts, even before the bench, the node gets one call at
a time).

The server's weight pushes go over the channel directly: best effort, not counted (the
node's heartbeats relay the update anyway, and loading weights is not a call's answer).

Invariants:
- Every call counts in its node's `in_flight` from `reserve` (or the call's start) until
  it ends, however it ends; a generation's `outstanding_tokens` likewise.
- `gone` fails every call in flight to that node at once (nothing waits for a timeout).
- A node's state changes only through `scheduler.lifecycle.transition`, and every change
  made here is persisted (`on_change`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from protocol.client import RemoteError
from scheduler.channel import ChannelClosed
from scheduler.lifecycle import BENCHED, CALLS_FAILING, allowed, transition
from scheduler.node_record import NodeRecord

log = logging.getLogger("prime.scheduler.calls")
REFUSAL_STATUSES = frozenset({400, 413, 422})
STRIKES_BEFORE_BENCH = 3
BENCH_S = 60.0
MAX_BENCH_S = 3600.0


class NodeFailed(Exception):
    """A node did not do what was asked (down, timeout, error, malformed answer)."""


class NodeRefused(NodeFailed):
    """A node answered 4xx: it found the request itself invalid (not a node fault)."""


class Transport(Protocol):
    """How calls reach nodes (`scheduler.channel.NodeChannels`)."""

    async def post(self, node: NodeRecord, route: str, body: bytes) -> bytes: ...

    def close(self, node_id: str, why: str) -> None: ...


@dataclass(frozen=True)
class Reservation:
    """A call counted in `node`'s load before it starts (a generator is picked and its load
    must show at once, for the next pick), with the tokens it is expected to take."""

    node: NodeRecord
    tokens: int


class NodeCalls:
    def __init__(
        self,
        transport: Transport,
        on_change: Callable[[NodeRecord], object],
        clock: Callable[[], float] = time.time,
    ):
        self.transport = transport
        self.on_change = on_change  # persists a node whose state changed here
        self.clock = clock
        self.tasks: dict[str, set[asyncio.Task]] = {}

    def reserve(self, node: NodeRecord, tokens: int) -> Reservation:
        """Count a call to `node` in its load now; pass the reservation to `post`."""
        node.in_flight += 1
        node.outstanding_tokens += tokens
        return Reservation(node, tokens)

    async def post(
        self,
        node: NodeRecord,
        route: str,
        body: bytes,
        timeout_s: float,
        reservation: Reservation | None = None,
    ) -> bytes:
        """POST `body` to `route` on `node`: its answer's body, or `NodeRefused` /
        `NodeFailed` (see the module docstring for what each outcome counts)."""
        reservation = reservation or self.reserve(node, 0)
        task = asyncio.create_task(self.transport.post(node, route, body))
        tasks = self.tasks.setdefault(node.node_id, set())
        tasks.add(task)
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                task.cancel()
                self._strike(node, "timeouts")
                raise NodeFailed(f"{node.label} did not answer {route} within {timeout_s:.0f} s")
            if task.cancelled():
                raise NodeFailed(f"{node.label} died during {route}")
            exc = task.exception()
            if isinstance(exc, RemoteError) and exc.status in REFUSAL_STATUSES:
                raise NodeRefused(f"{node.label} refused {route}: {exc.message}")
            if isinstance(exc, ChannelClosed):
                raise NodeFailed(f"{node.label} unreachable for {route}: {exc}")
            if isinstance(exc, RemoteError) and exc.status < 500:
                raise NodeFailed(f"{node.label} answered {route} with {exc}")
            if exc is not None:
                self._strike(node, "failures")
                raise NodeFailed(f"{node.label} failed {route}: {exc!r}")
            node.failures = node.timeouts = 0  # an answered call ends both runs
            return task.result()
        finally:
            node.in_flight -= 1
            node.outstanding_tokens -= reservation.tokens
            tasks.discard(task)

    def refused_what_others_serve(self, node: NodeRecord) -> None:
        """A request `node` refused was then served by another node: one more failed call."""
        self._strike(node, "failures")

    def gone(self, node: NodeRecord, why: str = "") -> None:
        """Fail every call in flight to a node that died, left, was banned or registered
        again (it restarted), and close its channel; the callers send the work elsewhere."""
        for task in list(self.tasks.get(node.node_id, ())):
            task.cancel()
        self.transport.close(node.node_id, why or f"the node is {node.state}")

    def _strike(self, node: NodeRecord, run: str) -> None:
        """One more failure or timeout in a row; bench the node once the run is long enough."""
        count = getattr(node, run) + 1
        setattr(node, run, count)
        if count < STRIKES_BEFORE_BENCH or node.state == "banned":
            return
        bench = min(MAX_BENCH_S, BENCH_S * 2 ** (count - STRIKES_BEFORE_BENCH))
        node.benched_until = max(node.benched_until, self.clock() + bench)
        event = CALLS_FAILING if run == "failures" else BENCHED
        # A draining or departed node is not made unhealthy (the table has no such move).
        if allowed(node.state, "unhealthy", event) and transition(node, "unhealthy", event):
            self.on_change(node)
        log.warning(
            "%s: %d calls in a row %s: no work for %.0f s",
            node.label,
            count,
            "failed" if run == "failures" else "timed out",
            bench,
        )
