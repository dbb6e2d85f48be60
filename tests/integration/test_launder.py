"""The launder family (issue 27, `tests.adversaries.launder`) against the tiny fp32 mix's
shipped thresholds, in-process: tokens from a cheaper model, every claim (logprobs, proof
rows) from one batched prefill of the real model.

What holds today on this mix (an honest node's tokens are always the replayed seeded
choice): laundering hides the logprobs and the proof completely; only the sampling replay
rejects a laundered rollout, and only one whose tokens the cheaper model changed. Not
every changed rollout is rejected: where the real model's best scores are close, the
changed token's replay gap sits under the shipped tolerance (the figures report how many
pass that way per kind). Closing that gap is issue 27's exact tier.
"""

from __future__ import annotations

import sqlite3

import pytest

from node.config import EngineConfig
from node.engines.base import GenerationRequest
from node.engines.torch_engine import TorchEngine
from node.worker import make_rollout
from protocol.envelope import open_envelope
from protocol.messages import (
    ReputationPolicy,
    Rollout,
    RolloutRequest,
    RolloutSpec,
    SamplingParams,
    SpotCheckPolicy,
)
from tests.adversaries import (
    NEAR_TIE_MARGIN,
    NearTie,
    _quantized_engine,
    launder,
    perturbed_engine,
    quantize_fp8,
    quantize_per_channel,
)
from tests.conftest import random_chat_prompts
from tests.pools import FAST_LIFECYCLE, collect, make_pool, tiny_verification
from verifier.checks import verify_rollout

SAMPLING = SamplingParams(max_tokens=48, ignore_eos=True)
N = 48
CHEAP = {
    "launder-noise": lambda e: perturbed_engine(e, 1e-3, seed=1234),
    "launder-int8": lambda e: _quantized_engine(e, lambda w: quantize_per_channel(w, 8)),
    "launder-int4": lambda e: _quantized_engine(e, lambda w: quantize_per_channel(w, 4)),
    "launder-fp8": lambda e: _quantized_engine(e, quantize_fp8),
    "near-tie": lambda e: NearTie(e, NEAR_TIE_MARGIN),
}


@pytest.mark.parametrize("kind", sorted(CHEAP))
def test_a_laundered_rollout_is_rejected_exactly_when_a_token_is_not_the_seeded_choice(
    tiny_engine, kind, report
):
    real = tiny_engine
    prompts = random_chat_prompts(real.tokenizer, N, seed=27)
    reqs = [
        RolloutRequest(request_id=f"r{i}", prompt_ids=p, sampling=SAMPLING, seed=500 + i)
        for i, p in enumerate(prompts)
    ]
    asked = [GenerationRequest(r.prompt_ids, r.sampling, r.seed) for r in reqs]
    honest = real.generate(asked)
    laundered = launder(real, CHEAP[kind](real), asked)
    policy = tiny_verification()
    changed, rejected, passed_changed, failed_checks, counted = 0, 0, 0, set(), 0
    for req, h, g in zip(reqs, honest, laundered, strict=True):
        rollout = make_rollout(req, g, "launderer", 0, real.weights_hash)
        (pre,) = real.prefill([(rollout.prompt_ids, rollout.completion_ids)])
        checks = verify_rollout(
            rollout,
            pre.logits,
            pre.hidden_states,
            policy,
            weights_hash=real.weights_hash,
            eos_ids=real.eos_token_ids,
            decode=real.tokenizer.decode,
        )
        failed = {c.name for c in checks if not c.passed}
        failed_checks |= failed
        is_changed = g.completion_ids != h.completion_ids
        changed += is_changed
        rejected += bool(failed)
        passed_changed += is_changed and not failed
        if (
            is_changed and not failed
        ):  # its lie is under the tolerance: does the replay test see it?
            (sampling,) = [c for c in checks if c.name == "sampling"]
            counted += sampling.metrics["off_replay_tokens"] > 0
        assert is_changed or not failed, (req.request_id, failed)  # unchanged: honest
    report(
        f"launder, tiny fp32 mix, {kind}: rollouts of 48 tokens",
        {
            "of": N,
            "changed": changed,
            "rejected": rejected,
            "changed_but_accepted": passed_changed,
            "of_those_counted_off_the_replay": counted,
            "checks_failed": sorted(failed_checks),
        },
    )
    assert failed_checks <= {"sampling"}, failed_checks  # the claims themselves pass
    assert changed > 0 and rejected > 0, "the case shows nothing"
    # What passes per rollout still counts for the per-node replay test (protocol.evidence).
    assert counted == passed_changed
    if kind in ("launder-int4", "near-tie"):  # every changed rollout is caught
        assert passed_changed == 0


STATISTICAL = ("launder-noise", "launder-int8", "launder-fp8")


@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_every_launderer_in_a_pool_is_banned_at_its_first_checked_lies(tmp_path, report):
    """Three honest `prime-node join` workers and the whole launder family, each a worker
    of its own with its claims from the real model's prefill: tokens from weights noised
    by 1e-2 x std, int8, int4 or fp8 weights, and the near-tie liar (the runner-up
    wherever the best two seeded scores are within 0.5). Every rollout is verified. Each
    launderer is banned with at most 3 of its lies rejected, plus one per rollout of its
    that was accepted: a node has at most 3 rollouts under way plus one per accepted
    rollout (`dispatch.probation` 3), and on this exact mix, where honest checks never
    fail, one lost dispute bans (`reputation.penalty_lost_dispute` 0.75). (Any launderer
    sometimes makes a rollout token for token the real model's, even fp8 on this short
    mix; its acceptance earns the launderer one more rollout under way.) Nothing int4
    or near-tie made that differs from the real model's rollout is released; a noise,
    int8 or fp8 rollout a token off by less than honest noise can pass its one check,
    and at most one such is released before the ban (CI saw one of int8's); a rollout
    token for token the real model's (the same seeded choices, exact claims) may be
    released. No honest worker loses reputation."""
    one_loss_bans = ReputationPolicy(penalty_lost_dispute=0.75)
    pool = make_pool(tmp_path, verification=tiny_verification(), reputation=one_loss_bans)
    try:
        pool.start_scheduler(*FAST_LIFECYCLE, "--dispatch.probation", "3")
        honest = ["h0", "h1", "h2"]
        cheats = {kind.replace("-", "_"): kind for kind in CHEAP}
        pool.join_many([*honest, *cheats], env={"PRIME_LAUNDER_SCALE": "1e-2"}, **cheats)
        prompts = random_chat_prompts(pool_tokenizer(), 64, seed=28)
        specs = [
            RolloutSpec(request_id=f"r{i}", prompt_ids=p, sampling=SAMPLING)
            for i, p in enumerate(prompts)
        ]
        async with pool.client() as client:
            await client.submit(specs)
            results = await collect(client, len(specs), 300)
        assert {r.status for r in results} == {"accepted"} and len(results) == len(specs)
        released = {
            r.request_id: open_envelope(r.rollout_envelope, Rollout, check_expiry=False).message
            for r in results
        }
        real = TorchEngine(EngineConfig(model="tiny"))
        log = (pool.workdir / "scheduler.log").read_text(errors="replace")
        figures = {}
        for name, kind in cheats.items():
            cheat = pool.node_id(name)
            pool.wait_node_state(cheat, "banned", 60)
            with sqlite3.connect(pool.db_url.split(":///", 1)[1]) as conn:
                rejected = conn.execute(
                    "SELECT COUNT(DISTINCT request_id) FROM verdicts "
                    "WHERE generator_id = ? AND kind = 'verify' AND accepted = 0",
                    (cheat,),
                ).fetchone()[0]
                # Each accepting verdict about its rollouts earned it one more under way.
                earned = conn.execute(
                    "SELECT COUNT(*) FROM verdicts WHERE generator_id = ? AND accepted = 1",
                    (cheat,),
                ).fetchone()[0]
            mine = [r for r in released.values() if r.node_id == cheat]
            honest_made = real.generate(
                [GenerationRequest(r.prompt_ids, r.sampling, r.seed) for r in mine]
            )
            changed = sum(
                r.completion_ids != h.completion_ids for r, h in zip(mine, honest_made, strict=True)
            )
            figures[kind] = {
                "rejected": rejected, "accepted": earned, "released": len(mine),
                "released_changed": changed,
            }  # fmt: skip
            assert pool.node_state(cheat) == "banned", (kind, figures)
            # The probation bound: 3 under way, plus one per accepted rollout.
            assert 1 <= rejected <= 3 + earned, (kind, figures)
            # int4 and near-tie: every changed rollout fails its check (the in-process
            # case above). Noise, int8 and fp8 now and then change a token by less than
            # honest noise, and such a rollout can pass a single check (the per-node
            # replay of protocol.evidence catches those): at most one before the ban.
            assert changed <= (1 if kind in STATISTICAL else 0), (kind, figures)
        report("the launder family in a tiny fp32 pool of 3 honest workers", figures)
        assert not any(f"{h} loses reputation" in log for h in honest), figures
        for h in honest:
            assert pool.node_state(pool.node_id(h)) == "healthy"
    finally:
        pool.close()


def pool_tokenizer():
    from verifier.models import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("tiny"))


@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_a_launderer_that_turns_under_per_node_spot_checks_gets_nothing_trained(
    tmp_path, report
):
    """Per-node spot checks (`VerificationPolicy.spot_checks`: every rollout of a node
    checked until 8 were accepted, then halving every 4, down to a quarter) in a pool of
    real processes: three honest workers and `turncoat-launder`, honest for its first 40
    rollouts (its rate falls with the others'), then laundering int4 tokens on every
    rollout. Its skipped rollouts are held until its next check, which it fails: it is
    banned, nothing it laundered is released (what is released of it is token for token
    an honest engine's), every request is served, and no honest worker loses anything."""
    spot = SpotCheckPolicy(full_until=8, halving=4, floor=0.25, hold_s=30.0)
    verification = tiny_verification().model_copy(update={"spot_checks": spot})
    one_loss_bans = ReputationPolicy(penalty_lost_dispute=0.75)
    pool = make_pool(tmp_path, verification=verification, reputation=one_loss_bans)
    try:
        pool.start_scheduler(*FAST_LIFECYCLE)
        honest = ["h0", "h1", "h2"]
        pool.join_many(
            [*honest, "turncoat"], env={"PRIME_TURN_AFTER": "40"}, turncoat="turncoat-launder"
        )
        prompts = random_chat_prompts(pool_tokenizer(), 320, seed=29)
        specs = [
            RolloutSpec(request_id=f"r{i}", prompt_ids=p, sampling=SAMPLING)
            for i, p in enumerate(prompts)
        ]
        cheat = pool.node_id("turncoat")
        results = []
        async with pool.client() as client:
            for start in range(0, len(specs), 32):  # rounds, as an orchestrator's steps
                await client.submit(specs[start : start + 32])
                after = results[-1].seq if results else 0
                results += await collect(client, 32, 240, after=after)
                if pool.node_state(cheat) == "banned":
                    break
        assert {r.status for r in results} == {"accepted"}
        pool.wait_node_state(cheat, "banned", 60)
        rollouts = [
            open_envelope(r.rollout_envelope, Rollout, check_expiry=False).message for r in results
        ]
        mine = [r for r in rollouts if r.node_id == cheat]
        honest_made = TorchEngine(EngineConfig(model="tiny")).generate(
            [GenerationRequest(r.prompt_ids, r.sampling, r.seed) for r in mine]
        )
        laundered = sum(
            r.completion_ids != h.completion_ids for r, h in zip(mine, honest_made, strict=True)
        )
        unverified = sum(r.detail == "unverified (spot check)" for r in results)
        figures = {
            "requests": len(results),
            "released_unverified": unverified,
            "turncoat_released": len(mine),
            "turncoat_laundered_released": laundered,
        }
        report("turncoat-launder under per-node spot checks (tiny fp32 pool)", figures)
        assert unverified > 0, figures  # the rates did fall
        assert len(mine) >= 8 and laundered == 0, figures
        log = (pool.workdir / "scheduler.log").read_text(errors="replace")
        assert not any(f"{h} loses reputation" in log for h in honest), figures
        for h in honest:
            assert pool.node_state(pool.node_id(h)) == "healthy"
    finally:
        pool.close()
