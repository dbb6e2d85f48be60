"""The verification protocol (scheduler/verification.py), as one table: for every path of
verdicts, audited or not, what is asked next and what is decided. Then the module's
invariants, checked on every path the machine can take."""

from __future__ import annotations

import itertools

import pytest

from scheduler.verification import (
    ACCEPTED_BAD,
    ASK_ORDER,
    GENERATOR_LOST,
    REJECTED_HONEST,
    Ask,
    Decision,
    next_step,
)

A, R = True, False
G, F, S, T = "generator", "first", "second", "third"

# (audited, verdicts so far) -> what comes next: ("ask", kind, role) or
# ("release" | "requeue", rewarded roles, {punished role: why}, lost_by)
TABLE = [
    (False, (), ("ask", "verify", F)),
    (True, (), ("ask", "verify", F)),
    (False, (A,), ("release", {G, F}, {}, None)),
    (True, (A,), ("ask", "audit", S)),
    (True, (A, A), ("release", {G, F, S}, {}, None)),
    (True, (A, R), ("ask", "dispute", T)),
    (True, (A, R, A), ("release", {G, F, T}, {S: REJECTED_HONEST}, "verifier")),
    (True, (A, R, R), ("requeue", {S, T}, {F: ACCEPTED_BAD, G: GENERATOR_LOST}, "generator")),
    (False, (R,), ("ask", "dispute", S)),
    (True, (R,), ("ask", "dispute", S)),
    (False, (R, A), ("release", {G}, {F: REJECTED_HONEST}, "verifier")),
    (False, (R, R), ("requeue", {F}, {G: GENERATOR_LOST}, "generator")),
    (True, (R, R), ("requeue", {F}, {G: GENERATOR_LOST}, "generator")),
    (True, (R, A), ("ask", "audit", T)),
    (True, (R, A, A), ("release", {G, S, T}, {F: REJECTED_HONEST}, "verifier")),
    (True, (R, A, R), ("requeue", {F, T}, {S: ACCEPTED_BAD, G: GENERATOR_LOST}, "generator")),
]


@pytest.mark.parametrize(("audited", "verdicts", "expected"), TABLE)
def test_each_step_of_the_protocol(audited, verdicts, expected):
    step = next_step(audited, verdicts)
    if expected[0] == "ask":
        assert isinstance(step, Ask)
        assert (step.kind, step.role) == expected[1:]
        # Never the generator nor a node that already gave a verdict on this rollout.
        assert set(step.exclude) == {G, *ASK_ORDER[: len(verdicts)]}
        assert step.role == ASK_ORDER[len(verdicts)]
        return
    outcome, rewards, punish, lost_by = expected
    assert isinstance(step, Decision)
    assert step.released == (outcome == "release")
    assert set(step.rewards) == rewards and dict(step.punish) == punish
    assert step.lost_by == lost_by
    assert bool(step.requeue_reason) == (outcome == "requeue")


def paths(audited: bool):
    """Every path the machine can take: the verdicts it asks for, up to its decision."""
    for answers in itertools.product((A, R), repeat=3):
        verdicts: tuple[bool, ...] = ()
        while isinstance(step := next_step(audited, verdicts), Ask):
            verdicts = answers[: len(verdicts) + 1]
        yield verdicts, step


@pytest.mark.parametrize("audited", [False, True])
def test_invariants_on_every_path(audited):
    seen = list(dict(paths(audited)).items())
    assert len(seen) == (6 if audited else 3)
    for verdicts, d in seen:
        roles = {G, *ASK_ORDER[: len(verdicts)]}
        accepted = [ASK_ORDER[i] for i, v in enumerate(verdicts) if v]
        rejected = [ASK_ORDER[i] for i, v in enumerate(verdicts) if not v]
        # Released only if the last verdict accepted; audited, only with two accepting.
        assert d.released == verdicts[-1]
        if audited:
            assert d.released == (len(accepted) >= 2)
        punished = dict(d.punish)
        assert set(d.rewards) | set(punished) <= roles
        assert not set(d.rewards) & set(punished), (verdicts, d)
        # The generator loses exactly when its rollout is not released.
        assert (G in punished) == (not d.released)
        # Whoever sided with the minority of a disputed rollout loses.
        if accepted and rejected:
            minority = rejected if d.released else accepted
            assert set(minority) <= set(punished), (verdicts, d)
        if not audited:
            assert len(verdicts) <= 2


def test_an_impossible_history_is_refused():
    for audited, verdicts in ((False, (A, A)), (False, (A, R)), (True, (A, A, R))):
        with pytest.raises(ValueError):
            next_step(audited, verdicts)
