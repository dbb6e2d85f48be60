"""Per-node evidence with the real model: a pool of SmolLM2-135M-Instruct nodes in bf16 on
the CPU (DESIGN.md section 10) meets every cheaper-compute adversary of `tests.adversaries`
(int8, int4 and fp8 weights, a lower temperature, a narrower top-p, one steered token) and
weight noise of 1e-2 x each tensor's std, one after another, each claiming the pool's
weights and sampling.

The pool's thresholds and evidence model are the shipped CPU bf16 calibration
(configs/verification/smollm2-torch-cpu-bf16.toml, `prime-node calibrate` on 512 honest
rollouts). Each cheat joins the running pool of three honest nodes and gets requests in
rounds until it is banned. What must hold: it is banned (by per-rollout checks through
lost disputes, or by per-node evidence) within the bound the pool states (README
"Per-node evidence": a handful of its rollouts released; at most 10 here), every request
ends accepted, no honest node leaves "healthy", and an honest node loses a dispute only
over a cheat's rollout: a rejection of it that an honest judge overturned (given back when
the cheat is banned), or an acceptance of it that two rejections outvoted (not given back:
an accomplice's would be too). Smaller weight noise (1e-3 x std) needs about a hundred
rollouts on the H200 (tests/bench/bench_trust.py): beyond a CPU pool test.
"""

from __future__ import annotations

import re
import sqlite3
import time
import tomllib

import pytest

from protocol.messages import RolloutSpec, SamplingParams, VerificationPolicy
from scheduler.verification import REJECTED_HONEST
from tests.adversaries import CHEAPER_COMPUTE
from tests.conftest import random_chat_prompts
from tests.integration.test_evidence_pool import caught_by
from tests.pools import FAST_LIFECYCLE, REPO, collect, make_pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
THRESHOLDS = REPO / "configs" / "verification" / "smollm2-torch-cpu-bf16.toml"
SAMPLING = SamplingParams(max_tokens=24, ignore_eos=True)
BF16 = ("--engine.dtype", "bfloat16")
HONEST = ("h0", "h1", "h2")
CHEATS = (*CHEAPER_COMPUTE, "perturbed-weights")
ROUND = 12  # requests per round, until the cheat is banned
MOST_ROUNDS = 8
BOUND = 10  # most of a cheat's rollouts released before its ban


async def test_smollm2_bf16_pool_bans_every_cheaper_compute_adversary(
    tmp_path, monkeypatch, report
):
    from verifier.models import load_tokenizer, resolve_model

    resolve_model("smollm2")  # convert the bundled GGUF once, before the nodes race for it
    monkeypatch.setenv("PRIME_PERTURB_SCALE", "1e-2")
    policy = VerificationPolicy(**tomllib.loads(THRESHOLDS.read_text())["verification"])
    tokenizer = load_tokenizer(resolve_model("smollm2"))
    pool = make_pool(tmp_path, verification=policy, model="smollm2")
    figures: dict[str, dict] = {}
    t0 = time.monotonic()
    try:
        pool.start_scheduler(*FAST_LIFECYCLE)
        for name in HONEST:
            pool.join(name, *BF16, wait=False)
        for name in HONEST:
            pool.wait_joined(name, 300)
        db = pool.db_url.split(":///", 1)[1]
        async with pool.client() as client:
            last = 0
            for kind in CHEATS:
                started = time.monotonic()
                name = f"cheat-{kind}"
                pool.join(name, *BF16, dishonest=kind, wait=False)
                pool.wait_joined(name, 300)
                cheat_id = pool.node_id(name)
                sent = 0
                for n in range(MOST_ROUNDS):
                    if pool.node_state(cheat_id) == "banned":
                        break
                    prompts = random_chat_prompts(tokenizer, ROUND, seed=hash((kind, n)) % 999)
                    specs = [
                        RolloutSpec(
                            request_id=f"{kind}-{sent + i}", prompt_ids=p, sampling=SAMPLING
                        )
                        for i, p in enumerate(prompts)
                    ]
                    await client.submit(specs)
                    results = await collect(client, len(specs), 600, after=last)
                    last = max([last, *(r.seq for r in results)])
                    assert len(results) == len(specs), (kind, len(results))
                    assert {r.status for r in results} == {"accepted"}, (kind, results)
                    sent += len(specs)
                pool.wait_node_state(cheat_id, "banned", 120)
                with sqlite3.connect(db) as conn:
                    reason = conn.execute(
                        "SELECT reason FROM nodes WHERE node_id = ?", (cheat_id,)
                    ).fetchone()[0]
                    verdicts = conn.execute(
                        "SELECT kind, accepted FROM verdicts WHERE generator_id = ?", (cheat_id,)
                    ).fetchall()
                    released = conn.execute(
                        "SELECT COUNT(*) FROM results WHERE generator_id = ?", (cheat_id,)
                    ).fetchone()[0]
                checked = [a for k, a in verdicts if k != "evidence"]
                figures[kind] = {
                    "caught_by": caught_by(reason),
                    "requests_sent": sent,
                    "cheat_rollouts_released_before_ban": released,
                    "cheat_rollouts_verified": len(checked),
                    "cheat_rollouts_rejected": sum(not a for a in checked),
                    "evidence_rechecks": sum(k == "evidence" for k, _ in verdicts),
                    "s": round(time.monotonic() - started, 1),
                }
                pool.nodes.pop(name).kill9()  # banned: its memory is the next cheat's
        log = (pool.workdir / "scheduler.log").read_text(errors="replace")
        losses = {
            n: re.findall(rf"{n} loses reputation \(now [0-9.]+\): ([^\"]*)", log) for n in HONEST
        }
        refunds = {n: log.count(f"{n} regains reputation") for n in HONEST}
        states = {n: pool.node_state(pool.node_id(n)) for n in HONEST}
        report(
            "per-node evidence, SmolLM2 bf16 CPU pool",
            {
                "cheats": figures,
                "honest_lost_disputes": losses,
                "honest_refunds": refunds,
                "run_s": round(time.monotonic() - t0, 1),
            },
        )
        for kind, f in figures.items():
            assert f["caught_by"] in ("evidence", "per-rollout"), (kind, f)
            assert f["cheat_rollouts_released_before_ban"] <= BOUND, (kind, f)
        assert states == {n: "healthy" for n in HONEST}, states
        # An honest checker may lose a dispute only over a borderline cheat's rollout, never
        # over an honest one: rejected, and overturned by an honest judge, it is given back
        # when the cheat is banned; accepted, and outvoted by two rejections, it is the cost
        # of siding with a rollout nobody released (an accomplice's acceptances are never
        # given back).
        for n, reasons in losses.items():
            assert all("(a rollout of cheat-" in r for r in reasons), (n, reasons)
            overturned = sum(REJECTED_HONEST in r for r in reasons)
            assert overturned == refunds[n], (n, reasons, refunds)
            assert len(reasons) <= 2, (n, reasons)  # a handful would mean wrong thresholds
    finally:
        pool.close()
