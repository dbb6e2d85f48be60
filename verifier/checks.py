"""Turn a claimed rollout and the verifier's own prefill into check results.

What each check proves is in DESIGN.md section 10. The checks, in order:
- request: the rollout answers the request it claims (prompt, sampling params, seed);
- weights: it was generated with the weights the verifier holds;
- termination: EOS / stop strings / max_tokens end the completion where they must;
- support: every token lies inside the claimed top-k / top-p set (the lenient mask of
  `verifier.sampling`: the policy's slack on the nucleus, and near-ties at its boundary);
- sampling: replaying the seeded Gumbel-max choice on the verifier's logits picks every
  token (up to numerical near-ties: the best score is taken over the core mask, the
  tokens any honest engine keeps);
- logprobs: the claimed logprobs match the verifier's;
- proof: the TOPLOC proof matches the verifier's hidden states.

Invariants: every check runs (a verdict lists all failures, not just the first); a
rollout is accepted only when all pass; nothing here trusts a field of the rollout
without recomputing it; every value `SamplingParams` accepts is judged by the rule the
sampler and the torch engine apply (top-k/top-p in `verifier.sampling`; EOS and stop
strings here as in the engine's decode loop: the same decode, every prefix), so an honest
rollout passes whatever its request's parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from protocol.answers import request_mismatches
from protocol.messages import CheckResult, Rollout, RolloutRequest, VerificationPolicy
from verifier.proofs import ProofCheck, check_proof, check_proofs
from verifier.sampling import ReplayResult, RowLogits, RowParams, replay_spec, row_spec

Decode = Callable[[list[int]], str]
DEFAULT_EVIDENCE_CAP = 1.0  # `EvidencePolicy.cap` of a pool without per-node evidence
# A token whose replay score gap exceeds this is counted off the seeded choice (the
# sampling check's `off_replay_tokens`, the per-node replay test's input): above the float
# noise of an exact mix's replay, where an honest gap is 0 or about 1e-6.
OFF_REPLAY_GAP = 1e-4


def check_request(rollout: Rollout, request: RolloutRequest | None) -> CheckResult:
    if request is None:
        return CheckResult(name="request", passed=True, detail="no request given")
    wrong = request_mismatches(rollout, request)
    return CheckResult(
        name="request",
        passed=not wrong,
        detail=f"differs from the request in {', '.join(wrong)}" if wrong else "",
    )


def check_weights(rollout: Rollout, weights_hash: str) -> CheckResult:
    ok = rollout.weights_hash == weights_hash
    return CheckResult(
        name="weights",
        passed=ok,
        detail=""
        if ok
        else f"generated with weights {rollout.weights_hash[:12]}, verifier holds {weights_hash[:12]}",
    )


def check_termination(rollout: Rollout, eos_ids: frozenset[int], decode: Decode) -> CheckResult:
    s = rollout.sampling
    ids = rollout.completion_ids
    n = len(ids)

    def fail(detail: str) -> CheckResult:
        return CheckResult(name="termination", passed=False, detail=detail)

    if not s.ignore_eos:
        early = [i for i, t in enumerate(ids[:-1]) if t in eos_ids]
        if early:
            return fail(f"end-of-sequence token at position {early[0]} before the end")
    if s.stop and n > 1 and any(x in decode(ids[:-1]) for x in s.stop):
        return fail("a stop string appears before the last token")
    ends_eos = ids[-1] in eos_ids and not s.ignore_eos
    ends_stop = bool(s.stop) and any(x in decode(ids) for x in s.stop)
    if rollout.finish_reason == "stop" and not (ends_eos or ends_stop):
        return fail("finish_reason 'stop' without an end-of-sequence token or stop string")
    if rollout.finish_reason == "length":
        if n != s.max_tokens:
            return fail(f"finish_reason 'length' after {n} tokens, max_tokens is {s.max_tokens}")
        if ends_eos or ends_stop:
            return fail("finish_reason 'length' although the completion ends with a stop")
    return CheckResult(name="termination", passed=True)


def replay_rollouts(rollouts: list[Rollout], logits, p_slack: float) -> list[ReplayResult | None]:
    """Replay the sampling of several rollouts in one batched pass over their logits: a list
    of [N_i, V] tensors, or the rows of all of them in order ([sum N_i, V] tensor or
    `verifier.sampling.RowLogits`); results come back on the CPU. None for a rollout with a
    token id outside the vocabulary (it fails the support check without a replay)."""
    if isinstance(logits, list):
        sizes = [len(r.completion_ids) for r in rollouts]
        ok = [i for i, r in enumerate(rollouts) if max(r.completion_ids) < logits[i].shape[-1]]
        logits = torch.cat([logits[i] for i in ok]) if ok else None
    else:
        sizes = [len(r.completion_ids) for r in rollouts]
        ok = [i for i, r in enumerate(rollouts) if max(r.completion_ids) < logits.shape[-1]]
        if len(ok) < len(rollouts):  # keep only the rows of the rollouts replayed
            starts = [sum(sizes[:i]) for i in range(len(rollouts))]
            keep = (
                torch.cat([torch.arange(starts[i], starts[i] + sizes[i]) for i in ok])
                if ok
                else None
            )
            logits = None if keep is None else _select_rows(logits, keep)
    out: list[ReplayResult | None] = [None] * len(rollouts)
    if not ok:
        return out
    vocab = logits.shape[-1]
    spec = row_spec(
        [t for i in ok for t in rollouts[i].completion_ids],
        [RowParams(s.temperature, s.top_k, s.top_p) for s in (rollouts[i].sampling for i in ok)],
        [rollouts[i].seed for i in ok],
        [sizes[i] for i in ok],
        vocab,
        torch.device(logits.device),
    )
    rep = replay_spec(logits, spec, p_slack)
    kept = [sizes[i] for i in ok]
    cols = [t.cpu().split(kept) for t in (rep.logprobs, rep.score_gap, rep.in_support)]
    for j, i in enumerate(ok):
        out[i] = ReplayResult(logprobs=cols[0][j], score_gap=cols[1][j], in_support=cols[2][j])
    return out


def check_rollout_proofs(
    rollouts: list[Rollout], rows: torch.Tensor, sizes: list[int], policy: VerificationPolicy
) -> list[ProofCheck]:
    """Every rollout's proof against the verifier's rows [sum N_i, H] (in rollout order), in
    one batched pass on the rows' device (`verifier.proofs.check_proofs`)."""
    return check_proofs(
        rows, sizes, [r.proof for r in rollouts], [r.proof_params for r in rollouts], policy
    )


def _select_rows(logits, keep: torch.Tensor):
    if isinstance(logits, RowLogits):
        return RowLogits(logits.rows[keep.to(logits.device)], logits.head, logits.shape[-1])
    return logits[keep.to(logits.device)]


def verify_rollout(
    rollout: Rollout,
    logits,  # torch.Tensor [N, V]: verifier's logits of the rows that produced each token
    hidden_states,  # torch.Tensor [N, H]: the same rows' last-layer hidden states
    policy: VerificationPolicy,
    *,
    weights_hash: str,
    eos_ids: frozenset[int],
    decode: Decode,
    request: RolloutRequest | None = None,
) -> list[CheckResult]:
    """Run every check on one rollout; it is acceptable iff all results passed."""
    rep = replay_rollouts([rollout], [logits], policy.support_tolerance)[0]
    return check_rollout(
        rollout,
        rep,
        hidden_states,
        policy,
        weights_hash=weights_hash,
        eos_ids=eos_ids,
        decode=decode,
        request=request,
    )


def check_rollout(
    rollout: Rollout,
    rep: ReplayResult | None,  # from `replay_rollouts`
    hidden_states,  # torch.Tensor [N, H]: the verifier's rows that produced each token
    policy: VerificationPolicy,
    *,
    weights_hash: str,
    eos_ids: frozenset[int],
    decode: Decode,
    request: RolloutRequest | None = None,
    proof_check: ProofCheck | None = None,
) -> list[CheckResult]:
    """Every check, given the rollout's replay (and its proof's check, when it was made in
    a batch: `verifier.proofs.check_proofs`); acceptable iff all results passed."""
    results = [
        check_request(rollout, request),
        check_weights(rollout, weights_hash),
        check_termination(rollout, eos_ids, decode),
    ]
    if rep is None:
        bad = CheckResult(name="support", passed=False, detail="token id outside the vocabulary")
        return results + [bad]
    n = len(rollout.completion_ids)

    outside = int((~rep.in_support).sum())
    results.append(
        CheckResult(
            name="support",
            passed=outside == 0,
            detail=f"{outside}/{n} tokens outside top-k/top-p" if outside else "",
            metrics={"tokens_outside": float(outside)},
        )
    )

    mism = int((rep.score_gap > policy.sampling_tolerance).sum())
    frac = mism / n
    results.append(
        CheckResult(
            name="sampling",
            passed=frac <= policy.max_sampling_mismatch_fraction,
            detail=f"{mism}/{n} tokens are not the seeded sampler's choice"
            if frac > policy.max_sampling_mismatch_fraction
            else "",
            metrics={
                "mismatch_fraction": frac,
                "max_score_gap": float(rep.score_gap.max()),
                "off_replay_tokens": float(int((rep.score_gap > OFF_REPLAY_GAP).sum())),
            },
        )
    )

    diff = (torch.tensor(rollout.logprobs, dtype=torch.float32) - rep.logprobs).abs()
    cap = policy.evidence.cap if policy.evidence is not None else DEFAULT_EVIDENCE_CAP
    max_diff, mean_diff = float(diff.max()), float(diff.mean())
    mean_ok = mean_diff <= policy.logprob_mean_limit(n)
    ok = max_diff <= policy.max_logprob_abs_diff and mean_ok
    results.append(
        CheckResult(
            name="logprobs",
            passed=ok,
            detail=""
            if ok
            else f"claimed logprobs differ by up to {max_diff:.3f} (mean {mean_diff:.4f})",
            metrics={
                "max_abs_diff": max_diff,
                "mean_abs_diff": mean_diff,
                # The per-node evidence score (`protocol.evidence`), signed in the verdict.
                "clipped_mean_abs_diff": float(diff.clamp(max=cap).mean()),
                "tokens": float(n),
            },
        )
    )

    pc = proof_check or check_proof(hidden_states, rollout.proof, rollout.proof_params, policy)
    results.append(
        CheckResult(
            name="proof",
            passed=pc.passed,
            detail=pc.detail,
            metrics={
                "exp_mismatches": float(pc.worst_exp_mismatches),
                "mant_err_mean": float(pc.worst_mant_err_mean),
                "mant_err_median": float(pc.worst_mant_err_median),
            },
        )
    )
    return results
