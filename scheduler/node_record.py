"""A `NodeRecord`: the scheduler's in-memory view of one admitted node (plain data; the
`nodes` table is its durable copy, `row`).

Invariants (who writes which field, so each has one writer):
- `state` and `reason`: only `scheduler.lifecycle.transition`.
- `reputation`, `earned`, `last_seen`, `connected`, what a heartbeat reports
  (`weights_version`, `weights_hash`, `stats`): `scheduler.registry.Registry`.
- The call counters `in_flight`, `outstanding_tokens`, `failures`, `timeouts` and
  `benched_until`: only `scheduler.node_calls.NodeCalls`.
- The work counters `generated`, `tokens`, `first_work`, `verified`, `accepted` and
  `rejected`: only `scheduler.store.Store` (it records generations and verdicts);
  `unsettled`: only the dispatch loop (`scheduler.dispatch`), while a rollout of the
  node waits for its verdict and release (not while a spot check holds it: held
  rollouts take none of the node's slots).
This module imports nothing of the scheduler, so every module may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.messages import NodeState


@dataclass
class NodeRecord:
    node_id: str
    public_key: bytes
    operator: str
    address: str
    engine: str
    model: str
    capacity: int
    state: NodeState
    reputation: float
    weights_version: int
    weights_hash: str
    registered_at: float
    last_seen: float
    reason: str = ""
    earned: int = 0  # its rollouts accepted by checkers (the right to check is earned);
    # negative: its right was revoked, and it earns it back from there
    # Volatile (not persisted): load and counters for balancing and the dashboard.
    in_flight: int = 0
    unsettled: int = 0  # generated rollouts still waiting for their verdict and release
    failures: int = 0  # calls in a row that failed (5xx, error); heartbeats do not clear it
    timeouts: int = 0  # calls in a row that timed out (heartbeats do not clear it)
    benched_until: float = 0.0  # unix time: no work before it (`scheduler.node_calls`)
    outstanding_tokens: int = 0
    stats: dict[str, int] = field(default_factory=dict)
    generated: int = 0
    tokens: int = 0
    verified: int = 0
    accepted: int = 0
    rejected: int = 0
    first_work: float = 0.0
    connected: bool = False  # its channel is open (`scheduler.channel`): calls reach it

    @property
    def label(self) -> str:
        return self.operator or self.node_id

    def row(self, pool_id: str) -> dict:
        return {
            "node_id": self.node_id,
            "pool_id": pool_id,
            "public_key": self.public_key,
            "operator": self.operator,
            "address": self.address,
            "engine": self.engine,
            "model": self.model,
            "capacity": self.capacity,
            "state": self.state,
            "reputation": self.reputation,
            "weights_version": self.weights_version,
            "weights_hash": self.weights_hash,
            "registered_at": self.registered_at,
            "last_seen": self.last_seen,
            "reason": self.reason,
            "earned": self.earned,
        }

    @property
    def call_slots(self) -> int:
        """Calls this node may have in flight now: its capacity, or one (the probe) while a
        run of failed or timed-out calls is not ended by an answered call."""
        return 1 if self.failures or self.timeouts else self.capacity

    def slots(self, probation: int) -> int:
        """Generations this node may have in flight now (see the probation invariant)."""
        return self.capacity if probation <= 0 else min(self.capacity, probation + self.accepted)

    def tokens_per_s(self, now: float) -> float:
        return self.tokens / (now - self.first_work) if self.first_work and self.tokens else 0.0
