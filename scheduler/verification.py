"""The verification protocol of one rollout as a pure state machine: which verdict to ask
for next, and what the verdicts so far decide (DESIGN.md section 2, steps 4-5).

`next_step(audited, verdicts)` takes whether the rollout is audited and the verdicts
collected so far (accepted or not, in the order asked) and returns either the next
verdict to ask for (`Ask`: its kind, the role the answering node takes, the roles it must
not be) or the decision (`Decision`: released or re-dispatched, who earns reputation,
who loses it and why, which verdicts go out with the rollout). The dispatcher
(`scheduler/dispatch.py`) does the I/O: it picks the nodes, calls them and applies the
decision.

The protocol: a first verifier checks the rollout. Accepted and not audited: released.
Accepted and audited: a second verifier checks it too; if it rejects, a third settles the
dispute by majority. Rejected: a second node judges; it accepting an unaudited rollout
releases it and the first verifier loses the dispute, it rejecting sends the job to
another generator and the generator loses; an audited rollout the judge accepts goes to a
third node. Invariants (tests/unit/test_verification_protocol.py checks each on every
path): at most three verdicts (two unaudited); a rollout is released only if the last
verdict asked accepted it, and, audited, only if two verdicts did; whoever sided with the minority of a settled rollout loses
reputation, and the generator loses exactly when its rollout is not released; no node is
rewarded and punished for one rollout; the verdicts released are all those asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

VerdictKind = Literal["verify", "dispute", "audit", "evidence"]
"""What a verdict was asked for ("evidence": a fresh re-check of a flagged node)."""
Role = Literal["generator", "first", "second", "third"]
ASK_ORDER: tuple[Role, ...] = ("first", "second", "third")

REJECTED_HONEST = "lost a dispute: rejected an honest rollout"
ACCEPTED_BAD = "lost a dispute: accepted a rollout that two verifiers rejected"
GENERATOR_LOST = "lost a dispute: its rollout was rejected by two verifiers"


@dataclass(frozen=True)
class Ask:
    """Ask a node that is none of `exclude` for a verdict of `kind`; it takes `role`."""

    kind: VerdictKind
    role: Role
    exclude: tuple[Role, ...]
    if_none: str
    """Why the job goes back to the queue (nobody punished) when no node answers."""
    opens_dispute: bool = False
    """This verdict settles a disagreement (counted as a dispute)."""
    unless_banned: bool = False
    """Not worth asking once the generator is banned (give up instead)."""


@dataclass(frozen=True)
class Decision:
    """What the verdicts decided."""

    released: bool
    rewards: tuple[Role, ...]
    punish: tuple[tuple[Role, str], ...] = ()
    lost_by: Literal["verifier", "generator"] | None = None
    """Who lost the dispute, when there was one (a metric)."""
    requeue_reason: str = ""
    """Not released: why the job goes to another generator (`{generator}`: its label)."""


def next_step(audited: bool, verdicts: tuple[bool, ...]) -> Ask | Decision:
    """The next verdict to ask for, or the decision (see the module docstring)."""
    match verdicts:
        case ():
            return Ask(
                "verify", "first", ("generator",), "no eligible verifier", unless_banned=True
            )
        case (True,) if not audited:
            return Decision(True, ("generator", "first"))
        case (True,):
            return Ask(
                "audit", "second", ("generator", "first"), "accepted, but no eligible auditor"
            )
        case (True, True) if audited:
            return Decision(True, ("generator", "first", "second"))
        case (True, False) if audited:
            return Ask(
                "dispute",
                "third",
                ("generator", "first", "second"),
                "verifiers disagree, and no third to settle it",
                opens_dispute=True,
            )
        case (False,):
            return Ask(
                "dispute",
                "second",
                ("generator", "first"),
                "rejected, and no judge for the dispute",
                opens_dispute=True,
                unless_banned=True,
            )
        case (False, True) if audited:
            # One verdict each way: the audit of the judge's acceptance decides.
            return Ask(
                "audit",
                "third",
                ("generator", "first", "second"),
                "verifiers disagree, and no third to settle it",
            )
        case (False, True):
            return Decision(True, ("generator",), (("first", REJECTED_HONEST),), "verifier")
        case (False, False):
            return Decision(
                False,
                ("first",),
                (("generator", GENERATOR_LOST),),
                "generator",
                "rollout from {generator} rejected in a dispute",
            )
        case (a, b, third) if a != b:
            # Settled by majority: the third verdict sides with one of the first two.
            yes, no = ("first", "second") if a else ("second", "first")
            if third:
                return Decision(
                    True, ("generator", yes, "third"), ((no, REJECTED_HONEST),), "verifier"
                )
            return Decision(
                False,
                (no, "third"),
                ((yes, ACCEPTED_BAD), ("generator", GENERATOR_LOST)),
                "generator",
                "rollout from {generator} rejected by two of three verifiers",
            )
    raise ValueError(f"no step after verdicts {verdicts} (audited={audited})")
