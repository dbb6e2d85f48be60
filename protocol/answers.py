"""Whether a rollout answers its request: the one field-by-field comparison that both the
scheduler (before any verifier spends a prefill) and every verifier (`verifier.checks`)
make, so the two can never disagree about what "answers the request" means.

Invariant: every field the request fixes is compared (id, pool, prompt, sampling
parameters, seed, proof layout, lowest admissible weights version); a rollout with no
mismatch answers exactly that request. Pure (no I/O, no torch).
"""

from __future__ import annotations

from protocol.messages import Rollout, RolloutRequest


def request_mismatches(rollout: Rollout, request: RolloutRequest) -> list[str]:
    """The names of the fields in which `rollout` does not answer `request` (none: it does)."""
    return [
        name
        for name, ok in (
            ("request_id", rollout.request_id == request.request_id),
            ("pool_id", rollout.pool_id == request.pool_id),
            ("prompt", rollout.prompt_ids == request.prompt_ids),
            ("sampling", rollout.sampling == request.sampling),
            ("seed", rollout.seed == request.seed),
            ("proof layout", rollout.proof_params == request.proof),
            ("min_version", rollout.weights_version >= request.min_version),
        )
        if not ok
    ]
