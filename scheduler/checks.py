"""The scheduler's own checks of what a node answered, before anything is trusted or any
verifier spends a prefill on it (cheap: signatures and field comparisons).

A rollout must be signed by the generator that was asked, answer exactly its request
(`protocol.answers.request_mismatches`: id, pool, prompt, sampling, seed, proof layout,
min_version; the same comparison every verifier makes), name that generator, and claim a
(weights_version, weights_hash) the published-weights ledger allows
(`scheduler.ledger.WeightsLedger.check`). A verdict must be signed by the verifier that
was asked and be about that very rollout.

Invariants: an answer that cannot be read, or is signed by another key, is the node's
failure (`NodeFailed`: the work goes elsewhere, nobody is punished for it); a rollout
signed by its generator that contradicts its request is proof of dishonesty (`Cheated`).
"""

from __future__ import annotations

from protocol.answers import request_mismatches
from protocol.codec import CodecError
from protocol.envelope import EnvelopeError, open_envelope
from protocol.messages import Rollout, RolloutRequest, Verdict
from scheduler.ledger import WeightsLedger
from scheduler.node_calls import NodeFailed
from scheduler.node_record import NodeRecord


class Cheated(Exception):
    """A node signed something that contradicts what it was asked: proof of dishonesty."""


def open_rollout(
    raw: bytes, gen: NodeRecord, request: RolloutRequest, ledger: WeightsLedger
) -> Rollout:
    """The rollout `gen` signed in `raw`, if it answers `request` (else `Cheated`)."""
    try:
        opened = open_envelope(raw, Rollout, check_expiry=False)
    except (EnvelopeError, CodecError, ValueError) as exc:
        raise NodeFailed(f"{gen.label} sent an unreadable rollout: {exc}") from exc
    if opened.sender != gen.public_key:
        raise NodeFailed(f"rollout from {gen.label} is signed by {opened.sender_id}")
    r = opened.message
    wrong = request_mismatches(r, request)
    if r.node_id != gen.node_id:
        wrong.append("node_id")
    if not ledger.check(r.weights_version, r.weights_hash):
        wrong.append("weights")
    if wrong:
        raise Cheated(", ".join(wrong))
    return r


def open_verdict(envelope: bytes, verifier: NodeRecord, rollout: Rollout) -> Verdict:
    """The verdict `verifier` signed in `envelope` about `rollout` (else `NodeFailed`)."""
    try:
        opened = open_envelope(envelope, Verdict, check_expiry=False)
    except (EnvelopeError, CodecError, ValueError) as exc:
        raise NodeFailed(f"{verifier.label} sent an unreadable verdict: {exc}") from exc
    v = opened.message
    if (
        opened.sender != verifier.public_key
        or v.request_id != rollout.request_id
        or v.rollout_digest != rollout.digest()
        or v.generator_id != rollout.node_id
    ):
        raise NodeFailed(f"{verifier.label} sent a verdict about something else")
    return v
