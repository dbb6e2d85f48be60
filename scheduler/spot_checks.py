"""Spot checks: which rollouts go unverified, and the hold that keeps each of them until
its generator passes a check of a rollout it made later.

`SpotChecks.skip` draws whether a rollout goes unverified: with the pool-wide
`VerificationPolicy.spot_check_rate`, or, under `VerificationPolicy.spot_checks`, with the
generator's own rate (`SpotCheckPolicy.rate` of its accepted history, `NodeRecord.earned`).
Every generated rollout gets a ticket (`arrived`: the node's rollouts in the order they
came back). Under a per-node policy a skipped rollout waits in `hold` until `checked`
reports a settled verification of a rollout of the same node with a later ticket:
accepted, and it is released; rejected (any ticket), and it is verified itself. Only a
later rollout vouches: a node that turns to cheating cannot have its first lies released
by a check of an honest rollout it made before. A hold never waits for a check that is
not coming: when no later rollout of the node is being verified (`started` .. `ended`)
and the node has no call under way, the held rollout is verified at once (so the tail of
a batch is not held `hold_s`). The dispatch loop is the one caller.

Invariants:
- Under a per-node policy with `hold_s` > 0, an unverified rollout is released only after a
  verified rollout of the same generator with a later ticket was accepted.
- A hold that ends without that answer (a rejected check, the generator banned, no later
  check of it under way, or `hold_s` passed) ends in `False`: the caller verifies the
  rollout instead, or drops it if its generator is banned.
- The draws come from the `rng` given, so a test can seed them.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

from protocol.messages import VerificationPolicy
from scheduler.node_record import NodeRecord

POLL_S = 0.05  # how often a hold looks whether a check of its generator is still coming


class SpotChecks:
    def __init__(self, policy: VerificationPolicy, rng: random.Random):
        self.policy = policy
        self.rng = rng
        self._tickets: Counter[str] = Counter()  # node id -> rollouts of it that came back
        self._held: dict[str, dict[int, asyncio.Future[bool]]] = {}  # node id -> ticket -> hold
        self._checking: dict[str, set[int]] = {}  # node id -> tickets being verified

    def rate(self, gen: NodeRecord) -> float:
        """The share of `gen`'s rollouts that are verified."""
        per_node = self.policy.spot_checks
        return self.policy.spot_check_rate if per_node is None else per_node.rate(gen.earned)

    def arrived(self, gen: NodeRecord) -> int:
        """A rollout of `gen` came back: its ticket (later rollouts get higher ones)."""
        self._tickets[gen.node_id] += 1
        return self._tickets[gen.node_id]

    def skip(self, gen: NodeRecord) -> bool:
        """Draw whether a rollout of `gen` goes unverified."""
        return self.rng.random() >= self.rate(gen)

    def held(self, gen: NodeRecord) -> int:
        """Rollouts of `gen` waiting for a later accepted check."""
        return sum(not f.done() for f in self._held.get(gen.node_id, {}).values())

    async def hold(self, gen: NodeRecord, ticket: int) -> bool:
        """Wait for an accepted check of a later rollout of `gen`: True to release the
        skipped rollout `ticket` (or nothing is held under this policy), False to verify it."""
        per_node = self.policy.spot_checks
        if per_node is None or per_node.hold_s <= 0:
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        held = self._held.setdefault(gen.node_id, {})
        held[ticket] = fut
        deadline = time.monotonic() + per_node.hold_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or gen.state == "banned":
                    return False
                later = any(t > ticket for t in self._checking.get(gen.node_id, ()))
                if not later and not gen.in_flight:
                    return False  # no later check of it is coming: this one is it
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), min(POLL_S, left))
                except TimeoutError:
                    continue
        finally:
            held.pop(ticket, None)
            if not held and self._held.get(gen.node_id) is held:
                del self._held[gen.node_id]

    def started(self, gen: NodeRecord, ticket: int) -> None:
        """Rollout `ticket` of `gen` is being verified (until `ended`)."""
        self._checking.setdefault(gen.node_id, set()).add(ticket)

    def ended(self, gen: NodeRecord, ticket: int) -> None:
        checking = self._checking.get(gen.node_id, set())
        checking.discard(ticket)
        if not checking:
            self._checking.pop(gen.node_id, None)

    def checked(self, gen: NodeRecord, ticket: int, accepted: bool) -> None:
        """Rollout `ticket` of `gen` was settled: the held rollouts before it are released
        (`accepted`); on a rejection every held rollout of `gen` goes to verification."""
        for held_ticket, fut in list(self._held.get(gen.node_id, {}).items()):
            if not fut.done() and (held_ticket < ticket or not accepted):
                fut.set_result(accepted)
