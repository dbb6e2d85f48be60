"""What verdicts do to nodes: rewards, lost disputes, bans, and refunds to verifiers that
were overturned about a generator banned later.

`Sanctions` applies a decision's rewards and punishments (`scheduler.verification`) and
the per-node evidence's bans (`scheduler.evidence_watch`) through the registry (which
owns reputation; `scheduler.lifecycle` the state), persists every node it changes, and
ends a banned node's calls (`NodeCalls.gone`).

Invariants:
- A ban is final and ends every call in flight to the node at once.
- Where the right to check is earned, every settled verdict of a checker feeds its
  sequential test (`scheduler.checker_watch`); an alarm revokes the right
  (`Registry.revoke`), nothing more: the node still generates and can earn it back.
- A verifier that lost a dispute for rejecting a rollout of a generator that is banned
  later gets that reputation back (it was right: an honest verifier rejecting a
  borderline cheat); about a generator that is not banned it does not. At most
  `OVERTURNED_KEPT` such disputes are remembered per generator.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from scheduler.checker_watch import CheckerWatch
from scheduler.metrics import SchedulerMetrics
from scheduler.node_record import NodeRecord
from scheduler.registry import Registry
from scheduler.store import Store

log = logging.getLogger("prime.scheduler.sanctions")
OVERTURNED_KEPT = 64


class Sanctions:
    def __init__(
        self,
        registry: Registry,
        store: Store,
        metrics: SchedulerMetrics,
        gone: Callable[[NodeRecord, str], None],
        watch: CheckerWatch | None = None,
    ):
        self.registry = registry
        self.watch = watch  # None: every admitted node checks, nothing to revoke
        self.store = store
        self.metrics = metrics
        self.gone = gone  # ends a node's calls (`NodeCalls.gone`)
        # Generator id -> verifiers that lost a dispute for rejecting one of its rollouts.
        self.overturned: dict[str, deque[str]] = {}

    def reward(self, node: NodeRecord) -> None:
        self.registry.reward(node)

    def earned(self, gen: NodeRecord) -> None:
        """A rollout of `gen` was accepted by checkers: one step towards the right to check."""
        if self.registry.earn(gen):
            log.info("%s may check others now: %d rollouts accepted", gen.label, gen.earned)
            self.store.persist_node(gen)

    def checked(self, checker: NodeRecord, outvoted: bool) -> None:
        """A verdict of `checker` was settled (`outvoted`: the others decided against it)."""
        if self.watch is None or not self.watch.observe(checker.node_id, outvoted):
            return
        if self.registry.revoke(checker):
            log.warning(
                "%s may not check others until %d more rollouts of its own are accepted: "
                "other checkers outvote its verdicts far more often than honest noise",
                checker.label,
                -checker.earned,
            )
            self.store.persist_node(checker)

    def punish(self, node: NodeRecord, reason: str, overturned: bool = False) -> None:
        """`node` lost a dispute (or signed a contradiction; `overturned`: its rejection was
        overturned, which costs more): less reputation, maybe a ban."""
        banned = self.registry.penalize(node, reason, overturned)
        log.warning("%s loses reputation (now %.2f): %s", node.label, node.reputation, reason)
        if banned:
            self._banned(node, reason)
        self.store.persist_node(node)

    def ban(self, node: NodeRecord, reason: str) -> None:
        """Ban outright (the per-node evidence was confirmed)."""
        if self.registry.ban(node, reason):
            self._banned(node, reason)
        self.store.persist_node(node)

    def overturned_about(self, gen: NodeRecord, verifier: NodeRecord) -> None:
        """`verifier` lost a dispute for rejecting a rollout of `gen`: refund it if `gen` is
        banned, now or later."""
        if gen.state == "banned":
            self._refund(verifier, gen)
            return
        lost = self.overturned.setdefault(gen.node_id, deque(maxlen=OVERTURNED_KEPT))
        lost.append(verifier.node_id)

    def _banned(self, node: NodeRecord, reason: str) -> None:
        self.store.count("banned")
        self.metrics.bans_total.inc()
        log.warning("%s is BANNED: %s", node.label, reason)
        self.gone(node, "")  # its channel is closed with "the node is banned"
        for verifier_id in self.overturned.pop(node.node_id, ()):
            verifier = self.registry.get(verifier_id)
            if verifier is not None:
                self._refund(verifier, node)

    def _refund(self, verifier: NodeRecord, gen: NodeRecord) -> None:
        if self.registry.refund(verifier):
            log.warning(
                "%s regains reputation (now %.2f): it rejected a rollout of %s, banned since",
                verifier.label,
                verifier.reputation,
                gen.label,
            )
            self.store.persist_node(verifier)
