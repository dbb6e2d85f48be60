"""Per-node evidence in the scheduler: each generator's sequential test, fed by verdicts,
and what a flag sets off (DESIGN.md section 10; the test itself is `protocol.evidence`).

Every verdict signs its rollout's error score and its count of tokens off the seeded
choice (`evidence_score`). A flagged node's latest
rollouts (up to `RECHECK`) go to fresh verifiers (not the generator, not the verifier that
scored them); if the same test over their scores reaches `confirm_threshold`, the node is
banned; otherwise its test starts again from zero.

Invariants: with no `EvidencePolicy` in the pool, nothing here does anything; an honest
node is banned here only if it is flagged (probability at most `false_flag_rate` within
`horizon` rollouts) and fresh verifiers confirm it (at most `false_flag_rate` again);
while a node is rechecked its releases wait (`settled`), so nothing of a node this bans
is released after its flag; what it released before the flag may have been trained on:
about `EvidencePolicy.expected_delay` rollouts for a cheat of a given excess.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Protocol

from protocol.evidence import NodeEvidence, RolloutScore, confirm_threshold
from protocol.messages import EvidencePolicy, Rollout, RolloutRequest, Verdict
from scheduler.jobs import Judged
from scheduler.node_record import NodeRecord
from scheduler.registry import Registry
from scheduler.verification import VerdictKind

log = logging.getLogger("prime.scheduler.evidence")
RECHECK = 32  # rollouts per generator kept for the fresh re-verification a flag triggers
RECHECK_WAIT_S = 5.0  # a rollout of weights no node holds any more is skipped, not waited for


def evidence_score(v: Verdict, temperature: float) -> RolloutScore | None:
    """(clipped mean |logprob error|, tokens, tokens off the seeded choice) a verdict
    signed, or None if it has no error score.

    Logprobs are taken under softmax(logits / T), so an honest engine's error grows as 1/T
    below T = 1: the score is brought back to T = 1 units (the honest model's), so that a
    client asking for low temperatures never gets an honest node flagged."""
    scale = temperature if 0 < temperature < 1 else 1.0
    checks = {c.name: c.metrics for c in v.checks}
    lp = checks.get("logprobs", {})
    if "clipped_mean_abs_diff" not in lp:
        return None
    off = checks.get("sampling", {}).get("off_replay_tokens")
    return RolloutScore(
        lp["clipped_mean_abs_diff"] * scale,
        int(lp.get("tokens", 1)),
        None if off is None else int(off),
    )


class Judge(Protocol):
    """Asks a node that is none of `exclude` for a verdict (`Dispatcher.judge`)."""

    async def __call__(
        self,
        kind: VerdictKind,
        rollout: Rollout,
        raw: bytes,
        request: RolloutRequest,
        exclude: list[NodeRecord],
        wait_s: float | None = None,
    ) -> Judged | None: ...


class EvidenceWatch:
    def __init__(
        self,
        policy: EvidencePolicy | None,
        registry: Registry,
        judge: Judge,
        ban: Callable[[NodeRecord, str], None],
    ):
        self.policy = policy
        self.registry = registry
        self.judge = judge
        self.ban = ban
        self.tests: dict[str, NodeEvidence] = {}
        self.recent: dict[str, deque[tuple[Rollout, bytes, RolloutRequest, str]]] = {}
        self.rechecking: dict[str, asyncio.Event] = {}  # set when the recheck is over
        self.tasks: set[asyncio.Task] = set()

    async def settled(self, gen: NodeRecord) -> None:
        """Return once `gen` is not being rechecked."""
        if gen.node_id in self.rechecking:
            await self.rechecking[gen.node_id].wait()

    def observe(
        self, rollout: Rollout, raw: bytes, request: RolloutRequest, node: NodeRecord, v: Verdict
    ) -> None:
        """Feed a verdict's error score into its generator's test; recheck on a flag."""
        policy = self.policy
        gen = self.registry.get(rollout.node_id)
        score = evidence_score(v, rollout.sampling.temperature)
        if policy is None or gen is None or gen.state == "banned" or score is None:
            return
        self.recent.setdefault(gen.node_id, deque(maxlen=RECHECK)).append(
            (rollout, raw, request, node.node_id)
        )
        test = self.tests.setdefault(gen.node_id, NodeEvidence())
        if test.add(policy, *score) and gen.node_id not in self.rechecking:
            log.warning(
                "%s flagged by per-node evidence after %d rollouts, %s (statistic %.1f >= "
                "%.1f): rechecking its recent rollouts",
                gen.label,
                test.rollouts,
                test.flagged_by,
                test.peak,
                policy.threshold,
            )
            self.rechecking[gen.node_id] = asyncio.Event()
            task = asyncio.create_task(self._recheck(gen, policy), name=f"recheck-{gen.node_id}")
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _recheck(self, gen: NodeRecord, policy: EvidencePolicy) -> None:
        fresh = NodeEvidence()
        try:
            for rollout, raw, request, scored_by in list(self.recent.get(gen.node_id, ())):
                first = self.registry.get(scored_by)
                exclude = [gen, *([first] if first else [])]
                judged = await self.judge(
                    "evidence", rollout, raw, request, exclude, RECHECK_WAIT_S
                )
                score = (
                    evidence_score(judged.verdict, rollout.sampling.temperature) if judged else None
                )
                if score is not None:
                    fresh.add(policy, *score)
            if fresh.peak >= confirm_threshold(policy):
                flag = self.tests[gen.node_id].flagged_by
                self.ban(
                    gen,
                    f"per-node evidence: {flag} "
                    f"(confirmed by fresh verifiers over {fresh.rollouts} rollouts, "
                    f"statistic {fresh.peak:.1f})",
                )
            else:
                log.info(
                    "%s: fresh verifiers did not confirm the flag (statistic %.1f < %.1f); "
                    "its test starts again",
                    gen.label,
                    fresh.peak,
                    confirm_threshold(policy),
                )
                self.tests[gen.node_id] = NodeEvidence()
        finally:
            self.rechecking.pop(gen.node_id).set()
