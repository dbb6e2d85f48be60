"""Spot checks: which rollouts go unverified, and the hold that keeps each of them until
its generator passes a later check.

`SpotChecks.skip` draws whether a rollout goes unverified: with the pool-wide
`VerificationPolicy.spot_check_rate`, or, under `VerificationPolicy.spot_checks`, with the
generator's own rate (`SpotCheckPolicy.rate` of its accepted history, `NodeRecord.earned`).
Under a per-node policy a skipped rollout waits in `hold` until `checked` reports the
generator's next settled verification: accepted, and the held rollouts are released;
rejected, and each is verified itself. A hold never waits for a check that is not coming:
when no rollout of the generator is being verified (`started` .. `ended`) and it has no
call under way, the held rollout is verified at once and vouches for the others (so the
tail of a batch is not held `hold_s`). The dispatch loop is the one caller.

Invariants:
- Under a per-node policy with `hold_s` > 0, an unverified rollout is released only after a
  verified rollout of the same generator, settled after it was held, was accepted.
- A hold that ends without that answer (a rejected check, the generator banned, no check
  of it under way, or `hold_s` passed) ends in `False`: the caller verifies the rollout
  instead, or drops it if its generator is banned.
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
        self._held: dict[str, list[asyncio.Future[bool]]] = {}
        self._checking: Counter[str] = Counter()  # node id -> its rollouts being verified

    def rate(self, gen: NodeRecord) -> float:
        """The share of `gen`'s rollouts that are verified."""
        per_node = self.policy.spot_checks
        return self.policy.spot_check_rate if per_node is None else per_node.rate(gen.earned)

    def skip(self, gen: NodeRecord) -> bool:
        """Draw whether a rollout of `gen` goes unverified."""
        return self.rng.random() >= self.rate(gen)

    def held(self, gen: NodeRecord) -> int:
        """Rollouts of `gen` waiting for its next accepted check."""
        return sum(not f.done() for f in self._held.get(gen.node_id, ()))

    async def hold(self, gen: NodeRecord) -> bool:
        """Wait for `gen`'s next settled check: True to release the skipped rollout (that
        check was accepted, or nothing is held under this policy), False to verify it."""
        per_node = self.policy.spot_checks
        if per_node is None or per_node.hold_s <= 0:
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._held.setdefault(gen.node_id, []).append(fut)
        deadline = time.monotonic() + per_node.hold_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or gen.state == "banned":
                    return False
                if not self._checking[gen.node_id] and not gen.in_flight:
                    return False  # no check of it is coming: this one is it
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), min(POLL_S, left))
                except TimeoutError:
                    continue
        finally:
            waiting = self._held.get(gen.node_id, [])
            if fut in waiting:
                waiting.remove(fut)
            if not waiting:
                self._held.pop(gen.node_id, None)

    def started(self, gen: NodeRecord) -> None:
        """A rollout of `gen` is being verified (until `ended`)."""
        self._checking[gen.node_id] += 1

    def ended(self, gen: NodeRecord) -> None:
        self._checking[gen.node_id] -= 1
        if self._checking[gen.node_id] <= 0:
            del self._checking[gen.node_id]

    def checked(self, gen: NodeRecord, accepted: bool) -> None:
        """A verified rollout of `gen` was settled: its held rollouts are released
        (`accepted`) or go to verification themselves."""
        for fut in self._held.pop(gen.node_id, []):
            if not fut.done():
                fut.set_result(accepted)
