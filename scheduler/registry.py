"""The nodes of a pool: lifecycle, reputation, and the choice of generators and verifiers.

A `NodeRecord` (`scheduler.node_record`, re-exported here) is the scheduler's in-memory
view of one admitted node; the `nodes` table is its durable copy (written on every state
or reputation change and, in batches, on heartbeats). States and their legal changes are
`scheduler.lifecycle`'s table, and `scheduler.lifecycle.transition` is the one writer of
`NodeRecord.state` (an illegal change raises `IllegalTransition` there). In short:
registered -> healthy (a heartbeat while the node's channel is open: `connected`) ->
unhealthy (silent past `unhealthy_after_s`, its channel dropped, its calls failing or
timing out: benched) -> dead (silent past `dead_after_s`); draining -> left on a clean
leave; banned (reputation under the pool's threshold) is final. The registry writes what
heartbeats and channels tell about a node (`heard`, `channel_opened`, `channel_closed`,
`holds`); the call counters are `scheduler.node_calls`'.

Invariants:
- Only `healthy` nodes get new work; a node without an open channel is not healthy,
  however it heartbeats (a heartbeat proves the node is alive, not that calls reach it);
  a banned node never gets work again, whatever it sends later; a benched node (its calls
  failed or timed out in a row, `benched_until`) not before its bench ends, however it
  heartbeats.
- A node in a run of failed or timed-out calls (not benched yet, or back from its bench)
  gets one call at a time, the probe, until a call of its is answered.
- Probation: a node gets at most `probation` rollouts under way (being generated, or
  generated and awaiting their verdict) plus one per rollout of its that was accepted
  (since this scheduler started), up to its own capacity; a cheater therefore has only a
  handful of rollouts under way when its first disputes ban it.
- A generator is a healthy node with spare capacity whose weights version is at least the
  request's `min_version`, never one that refused the request, and not one the request
  already tried while any other such node is healthy (once every one was tried, they are
  candidates again: a request is never stranded by the nodes it met; the dispatcher's
  `max_attempts` bounds its retries); among those, the one with the fewest outstanding tokens per unit
  of reputation wins. Up to `EXACT_UP_TO` healthy nodes every one is compared; in a larger
  pool the best of `SAMPLE` random eligible nodes wins (power-of-d choices: near-perfect
  balance at O(1) per request instead of a scan of the whole pool).
- A verifier (or a dispute's judge, an auditor, an evidence recheck) is never the
  generator, never of the generator's operator (nor of the first verifier's, for a
  judge), holds exactly the weights the rollout claims, holds the right to check
  (`can_check`), and is picked at random among the eligible (the generator cannot
  predict it).
- The right to check (`PoolConfig.checkers`): where the pool makes it earned, a node
  checks others only if it is of the founding set or `earned` (its rollouts accepted by
  checkers, counted by `earn`) reached `earn_after`; so a generator loses a dispute only
  on the word of checkers, and identities made a second ago check nothing. A checker the
  others outvote too often (`scheduler.checker_watch`) loses the right (`revoke`: its
  `earned` goes to -`reearn_after`, persisted like any count) and checks again only
  after that many more accepted rollouts of its own, founders included.
- Recent identities (admitted within `CheckerPolicy.recent_window_s`, founders never are)
  are drawn as checkers together at most `recent_draw_share` of the time while an
  established checker is eligible, and at most `max_recent_checkers` of one rollout's
  checkers are recent; with the operator rule above, no operator checks a rollout twice.
- A verifier whose rejection is overturned loses more than a generator whose rollout is
  rejected (`ReputationPolicy.overturned_rejection_factor`), and gets exactly that back
  when the generator is banned later (`refund`).
"""

from __future__ import annotations

import random
import secrets
import time

from protocol.messages import CheckerPolicy, Heartbeat, ReputationPolicy
from scheduler.lifecycle import BAN, CHANNEL_DROPPED, HEARTBEAT, SILENT, SILENT_LONG, transition
from scheduler.node_record import NodeRecord

__all__ = ["EXACT_UP_TO", "SAMPLE", "NodeRecord", "Registry"]  # NodeRecord: re-exported

# Verifier choice must be unpredictable to the generator: the OS's randomness.
_rng = secrets.SystemRandom()
# Load-balancing samples need no secrecy, only speed.
_fast_rng = random.Random(secrets.randbits(64))
EXACT_UP_TO = 64
SAMPLE = 16
HEALTHY_CACHE_S = 0.2


class Registry:
    """All nodes of the pool, by id."""

    def __init__(
        self,
        policy: ReputationPolicy,
        probation: int = 0,
        checkers: CheckerPolicy | None = None,
        founders: frozenset[str] | None = None,
    ):
        self.policy = policy
        self.probation = probation
        # The right to check: earned after `earn_after` accepted rollouts, unless a founder;
        # founders None: every node checks (`PoolConfig.founding_checkers`), and none is
        # recent.
        self.checkers = checkers or CheckerPolicy()
        self.earn_after = self.checkers.earn_after if founders is not None else 0
        self.reearn_after = self.checkers.reearn_after
        self.founders = founders or frozenset()
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
    def heard(self, node: NodeRecord, hb: Heartbeat) -> None:
        """A heartbeat from `node` (not banned, left or dead): what it holds, and that it is
        alive (a draining node only polls: it never turns healthy again)."""
        node.weights_version = hb.weights_version
        node.weights_hash = hb.weights_hash or node.weights_hash
        node.stats = hb.stats
        if node.state == "draining":
            node.last_seen = time.time()
        else:
            self.seen(node)

    def holds(self, node: NodeRecord, version: int, weights_hash: str) -> bool:
        """`node` confirmed it loaded `version` (a weights push answered); True if taken."""
        if node.state != "healthy" or version < node.weights_version:
            return False
        node.weights_version, node.weights_hash = version, weights_hash
        return True

    def touch(self, node: NodeRecord) -> None:
        """`node` called in (a draining node polls instead of heartbeating)."""
        node.last_seen = time.time()

    def channel_opened(self, node: NodeRecord) -> None:
        """`node` proved its key over a channel it opened: calls reach it now."""
        node.connected = True
        self.seen(node)

    def channel_closed(self, node: NodeRecord) -> bool:
        """No call reaches `node` until it reconnects; True if it just stopped being healthy."""
        node.connected = False
        return node.state == "healthy" and transition(node, "unhealthy", CHANNEL_DROPPED)

    def seen(self, node: NodeRecord, now: float | None = None) -> None:
        node.last_seen = now or time.time()
        # A benched node (its calls fail or time out) stays out of work however well it
        # heartbeats; once the bench is over, its next call is the probe (`node_calls`).
        if (
            node.state in ("registered", "unhealthy")
            and node.connected
            and node.last_seen >= node.benched_until
            and transition(node, "healthy", HEARTBEAT)
        ):
            self._healthy_at = -1.0  # a node that just turned healthy may take work at once

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

    def penalize(self, node: NodeRecord, reason: str, overturned: bool = False) -> bool:
        """Lower a node's reputation (more for a rejection the judge `overturned`); ban it
        under the threshold. True if it was just banned."""
        p = self.policy
        penalty = p.penalty_overturned_rejection if overturned else p.penalty_lost_dispute
        node.reputation = max(0.0, node.reputation - penalty)
        if node.state != "banned" and node.reputation < self.policy.ban_below:
            transition(node, "banned", BAN, reason)
            return True
        return False

    def can_check(self, node: NodeRecord) -> bool:
        """Whether `node` may verify, judge or audit (see the module's invariants)."""
        if not self.earn_after:
            return True
        if node.earned < 0:  # its right was revoked: earning it back
            return False
        return node.node_id in self.founders or node.earned >= self.earn_after

    def earn(self, node: NodeRecord) -> bool:
        """One more rollout of `node` accepted by checkers; True if that (re)earned it the
        right to check."""
        before = self.can_check(node)
        node.earned += 1
        return not before and self.can_check(node)

    def revoke(self, node: NodeRecord) -> bool:
        """Take the right to check away (its verdicts are outvoted too often): it checks
        again after `reearn_after` more accepted rollouts of its own (founders too). Only
        where rights are earned; True if it held the right."""
        if not self.can_check(node) or not self.earn_after:
            return False
        node.earned = -self.reearn_after
        return True

    def refund(self, node: NodeRecord) -> bool:
        """Give back one lost dispute (it proved right after all); False if banned (final)."""
        if node.state == "banned":
            return False
        node.reputation = min(1.0, node.reputation + self.policy.penalty_overturned_rejection)
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
        self,
        min_version: int,
        tried: set[str] | frozenset[str] = frozenset(),
        refused: set[str] | frozenset[str] = frozenset(),
    ) -> NodeRecord | None:
        if tried and not self.able(min_version, besides=tried | refused):
            tried = frozenset()  # every node able to serve it was tried: try them again
        tried = tried | refused
        best = _least_loaded(self._candidates(), min_version, tried, self.probation)
        if best is None and len(self.healthy()) > EXACT_UP_TO:
            # The sample was unlucky: look at every node.
            best = _least_loaded(self.healthy(), min_version, tried, self.probation)
        return best

    def able(self, min_version: int, besides: set[str] | frozenset[str] = frozenset()) -> bool:
        """Whether a healthy node other than `besides` holds `min_version` (busy or not)."""
        return any(
            n.state == "healthy" and n.node_id not in besides and n.weights_version >= min_version
            for n in self.healthy()
        )

    def pick_verifier(
        self,
        weights_hash: str,
        exclude: list[NodeRecord],
        tried: set[str],
        checkers: list[NodeRecord] | None = None,
    ) -> NodeRecord | None:
        """A checker for a rollout that none of `exclude` (its generator and `checkers`, the
        checkers it had so far) may check, and none of `tried` (see the module's invariants)."""
        ids = {n.node_id for n in exclude} | tried
        operators = {n.operator for n in exclude if n.operator}

        def eligible(n: NodeRecord) -> bool:
            return (
                n.state == "healthy"
                and n.node_id not in ids
                and (not n.operator or n.operator not in operators)
                and n.weights_hash == weights_hash
                and n.in_flight < n.call_slots
                and self.can_check(n)
            )

        nodes = self.healthy()
        if len(nodes) > EXACT_UP_TO:  # a uniform sample of the eligible, in O(1)
            nodes = _rng.sample(nodes, SAMPLE)
        return self._draw([n for n in nodes if eligible(n)], checkers or [])

    def is_recent(self, node: NodeRecord, now: float) -> bool:
        """Admitted within `recent_window_s` and not a founder (only where rights are earned)."""
        return (
            bool(self.earn_after)
            and node.node_id not in self.founders
            and now - node.registered_at < self.checkers.recent_window_s
        )

    def _draw(self, eligible: list[NodeRecord], checkers: list[NodeRecord]) -> NodeRecord | None:
        """One of `eligible`, recent ones together at most `recent_draw_share` of the time
        while an established one is there, and none past `max_recent_checkers`."""
        now = time.time()
        recent = [n for n in eligible if self.is_recent(n, now)]
        established = [n for n in eligible if not self.is_recent(n, now)]
        if sum(self.is_recent(n, now) for n in checkers) >= self.checkers.max_recent_checkers:
            recent = []
        if not recent or not established:
            return _rng.choice(recent or established) if recent or established else None
        share = min(len(recent) / (len(recent) + len(established)), self.checkers.recent_draw_share)
        return _rng.choice(recent if _rng.random() < share else established)


def _least_loaded(
    nodes: list[NodeRecord], min_version: int, exclude: set[str] | frozenset[str], probation: int
) -> NodeRecord | None:
    best, best_score = None, float("inf")
    for n in nodes:
        if (
            n.state != "healthy"
            or n.in_flight >= n.call_slots
            or (probation > 0 and n.in_flight + n.unsettled >= n.slots(probation))
            or n.weights_version < min_version
            or n.node_id in exclude
        ):
            continue
        score = (n.outstanding_tokens + 1) / max(n.reputation, 1e-3)
        if score < best_score:
            best, best_score = n, score
    return best
