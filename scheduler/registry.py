"""The nodes of a pool: lifecycle, reputation, and the choice of generators and verifiers.

A `NodeRecord` is the scheduler's in-memory view of one admitted node; the `nodes` table
is its durable copy (written on every state or reputation change and, in batches, on
heartbeats). States and their legal changes are `scheduler.lifecycle`'s table, and
`scheduler.lifecycle.transition` is the one writer of `NodeRecord.state` (an illegal change
raises `IllegalTransition` there). In short: registered -> healthy (a heartbeat while the
node's channel is open: `connected`) -> unhealthy (silent past `unhealthy_after_s`, its
channel dropped, its calls failing or benched) -> dead (silent past `dead_after_s`);
draining -> left on a clean leave; banned (reputation under the pool's threshold) is final.

Invariants:
- Only `healthy` nodes get new work; a node without an open channel is not healthy,
  however it heartbeats (a heartbeat proves the node is alive, not that calls reach it); a banned node never gets work again, whatever it sends later; a benched node (calls timed out, `benched_until`) not before its bench ends.
- Probation: a node gets at most `probation` rollouts under way (being generated, or
  generated and awaiting their verdict) plus one per rollout of its that was accepted
  (since this scheduler started), up to its own capacity; a cheater therefore has only a
  handful of rollouts under way when its first disputes ban it.
- A generator is a healthy node with spare capacity whose weights version is at least the
  request's `min_version`; among those, the one with the fewest outstanding tokens per unit
  of reputation wins. Up to `EXACT_UP_TO` healthy nodes every one is compared; in a larger
  pool the best of `SAMPLE` random eligible nodes wins (power-of-d choices: near-perfect
  balance at O(1) per request instead of a scan of the whole pool).
- A verifier (or a dispute's judge) is never the generator, never of the generator's
  operator (nor of the first verifier's, for a judge), holds exactly the weights the
  rollout claims, and is picked at random among the eligible (the generator cannot
  predict it).
"""

from __future__ import annotations

import random
import secrets
import time
from dataclasses import dataclass, field

from protocol.messages import NodeState, ReputationPolicy
from scheduler.lifecycle import BAN, HEARTBEAT, SILENT, SILENT_LONG, transition

# Verifier choice must be unpredictable to the generator: the OS's randomness.
_rng = secrets.SystemRandom()
# Load-balancing samples need no secrecy, only speed.
_fast_rng = random.Random(secrets.randbits(64))
EXACT_UP_TO = 64
SAMPLE = 16
HEALTHY_CACHE_S = 0.2


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
    # Volatile (not persisted): load and counters for balancing and the dashboard.
    in_flight: int = 0
    unsettled: int = 0  # generated rollouts still waiting for their verdict
    failures: int = 0
    timeouts: int = 0  # calls in a row that timed out (heartbeats do not clear it)
    benched_until: float = 0.0  # unix time: no work before it (see Dispatcher.note_timeout)
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
        }

    def slots(self, probation: int) -> int:
        """Generations this node may have in flight now (see the probation invariant)."""
        return self.capacity if probation <= 0 else min(self.capacity, probation + self.accepted)

    def tokens_per_s(self, now: float) -> float:
        return self.tokens / (now - self.first_work) if self.first_work and self.tokens else 0.0


class Registry:
    """All nodes of the pool, by id."""

    def __init__(self, policy: ReputationPolicy, probation: int = 0):
        self.policy = policy
        self.probation = probation
        self.nodes: dict[str, NodeRecord] = {}
        self._healthy: list[NodeRecord] = []
        self._healthy_at = -1.0

    def get(self, node_id: str) -> NodeRecord | None:
        return self.nodes.get(node_id)

    def add(self, node: NodeRecord) -> None:
        self.nodes[node.node_id] = node

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes.values():
            out[n.state] = out.get(n.state, 0) + 1
        return out

    # -- lifecycle -------------------------------------------------------------------
    def seen(self, node: NodeRecord, now: float | None = None) -> None:
        node.last_seen = now or time.time()
        # A benched node (its calls time out) stays out of work however well it heartbeats.
        if (
            node.state in ("registered", "unhealthy")
            and node.connected
            and node.last_seen >= node.benched_until
        ):
            transition(node, "healthy", HEARTBEAT)

    def sweep(self, now: float, unhealthy_after: float, dead_after: float) -> list[NodeRecord]:
        """Apply missed-heartbeat transitions; return the nodes whose state changed."""
        changed = []
        for n in self.nodes.values():
            silent = now - n.last_seen
            if n.state in ("registered", "healthy", "draining") and silent > unhealthy_after:
                transition(n, "unhealthy", SILENT)
                changed.append(n)
            if n.state == "unhealthy" and silent > dead_after:
                transition(n, "dead", SILENT_LONG)
                changed.append(n)
        return changed

    # -- reputation ------------------------------------------------------------------
    def reward(self, node: NodeRecord) -> None:
        if node.state != "banned":  # a ban is final: nothing earns reputation back
            node.reputation = min(1.0, node.reputation + self.policy.reward_accepted)

    def ban(self, node: NodeRecord, reason: str) -> bool:
        """Ban outright (proof of dishonesty beyond one dispute); True if it was just banned."""
        node.reputation = 0.0
        if node.state == "banned":
            return False
        transition(node, "banned", BAN, reason)
        return True

    def penalize(self, node: NodeRecord, reason: str) -> bool:
        """Lower a node's reputation; ban it under the threshold. True if it was just banned."""
        node.reputation = max(0.0, node.reputation - self.policy.penalty_lost_dispute)
        if node.state != "banned" and node.reputation < self.policy.ban_below:
            transition(node, "banned", BAN, reason)
            return True
        return False

    def refund(self, node: NodeRecord) -> bool:
        """Give back one lost dispute (it proved right after all); False if banned (final)."""
        if node.state == "banned":
            return False
        node.reputation = min(1.0, node.reputation + self.policy.penalty_lost_dispute)
        return True

    # -- choice ----------------------------------------------------------------------
    def healthy(self) -> list[NodeRecord]:
        """Healthy nodes, recomputed at most every HEALTHY_CACHE_S (callers re-check state)."""
        now = time.monotonic()
        if now - self._healthy_at > HEALTHY_CACHE_S:
            self._healthy = [n for n in self.nodes.values() if n.state == "healthy"]
            self._healthy_at = now
        return self._healthy

    def _candidates(self) -> list[NodeRecord]:
        nodes = self.healthy()
        return nodes if len(nodes) <= EXACT_UP_TO else _fast_rng.sample(nodes, SAMPLE)

    def pick_generator(
        self, min_version: int, exclude: set[str] | frozenset[str] = frozenset()
    ) -> NodeRecord | None:
        best = _least_loaded(self._candidates(), min_version, exclude, self.probation)
        if best is None and len(self.healthy()) > EXACT_UP_TO:
            # The sample was unlucky: look at every node.
            best = _least_loaded(self.healthy(), min_version, exclude, self.probation)
        return best

    def pick_verifier(
        self, weights_hash: str, exclude: list[NodeRecord], tried: set[str]
    ) -> NodeRecord | None:
        ids = {n.node_id for n in exclude} | tried
        operators = {n.operator for n in exclude if n.operator}

        def eligible(n: NodeRecord) -> bool:
            return (
                n.state == "healthy"
                and n.node_id not in ids
                and (not n.operator or n.operator not in operators)
                and n.weights_hash == weights_hash
                and n.in_flight < n.capacity
            )

        nodes = self.healthy()
        if len(nodes) > EXACT_UP_TO:
            for n in _rng.sample(nodes, SAMPLE):  # uniform among the eligible, in O(1)
                if eligible(n):
                    return n
        pool = [n for n in nodes if eligible(n)]
        return _rng.choice(pool) if pool else None


def _least_loaded(
    nodes: list[NodeRecord], min_version: int, exclude: set[str] | frozenset[str], probation: int
) -> NodeRecord | None:
    best, best_score = None, float("inf")
    for n in nodes:
        if (
            n.state != "healthy"
            or n.in_flight >= n.capacity
            or (probation > 0 and n.in_flight + n.unsettled >= n.slots(probation))
            or n.weights_version < min_version
            or n.node_id in exclude
        ):
            continue
        score = (n.outstanding_tokens + 1) / max(n.reputation, 1e-3)
        if score < best_score:
            best, best_score = n, score
    return best
