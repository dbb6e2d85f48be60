"""Faults during a real training run (issue 6, DESIGN.md section 3).

Each test trains the SFT-warmed tiny model on reverse-text through a real pool on
loopback (a scheduler, `prime-node join` workers, `prime-trainer rl` with the swarm
weight transport at async_level 2), breaks something while it trains, and then audits
what the run left behind (tests/swarm/harness.py): training went on to the last step,
no rollout of a dishonest generator reached the trainer, every dishonest node was
banned and no honest one, every request got exactly one result, and no trained sample
was staler than async_level, and every trained sample is exactly its signed rollout
(prompt and completion ids, mu logprobs, the scored text decoded on the trusted side).
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
import time

import pytest

from protocol.identity import Identity
from protocol.messages import CheckerPolicy, ReputationPolicy
from tests.pools import tiny_verification
from tests.swarm.harness import FaultRun, pool_state
from trainer.monitor import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture
def fault_run(tmp_path, sft_model):
    runs: list[FaultRun] = []

    def make(steps: int, *extra: str, **pool_kw) -> FaultRun:
        run = FaultRun.create(tmp_path / f"run{len(runs)}", sft_model, steps, *extra, **pool_kw)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.close()


def test_churn_stragglers_and_a_cheat_in_the_middle_of_groups(fault_run, report, monkeypatch):
    """Seven workers, two of them stragglers (2 s more per generation). Two fast honest ones
    are killed with kill -9 at random moments of a step (in the middle of its groups) and
    two new ones join meanwhile, one of them the cheapest liar (tokens of an int4 copy,
    every claim from one real prefill), banned at its first lost dispute
    (`reputation.penalty_lost_dispute` 0.75: on this exact fp32 mix honest checks never
    fail, and most int4 rollouts of the warmed-up model are token for token the real
    model's, so under the default penalty its two or three caught lies, spread among
    accepted ones, did not always ban it before the run ended). Rounds end at a
    6 s deadline (`orchestrator.groups.deadline-s`): stragglers are cut off, lost
    rollouts generated again for their prompt, short groups trained at their size. Every
    step trains; the fault audit holds; the fast nodes do most of the work; no honest
    node is banned, the dead ones are declared dead."""
    monkeypatch.setenv("PRIME_SLOW_S", "2")
    rng = random.Random(6)
    deadline_s = 6.0
    one_loss_bans = ReputationPolicy(penalty_lost_dispute=0.75)
    run = fault_run(
        10, "--orchestrator.groups.deadline-s", str(deadline_s), reputation=one_loss_bans
    )
    fast = [f"w{i}" for i in range(5)]
    run.start_pool({**dict.fromkeys(fast), "s0": "slow", "s1": "slow"})
    run.start_training()
    victims = rng.sample(fast, 2)
    for victim, joiner, at_step in zip(victims, ("n0", "c0"), (2, 4), strict=True):
        run.wait_step(at_step)
        time.sleep(rng.uniform(0.0, 2.0))  # anywhere inside a step
        run.pool.nodes[victim].kill9()
        run.join({joiner: "launder-int4" if joiner == "c0" else None}, wait=False)
    run.wait_finished()
    counts = run.audit(cheat_generators={"c0"}, statistical={"c0"})
    for victim in victims:  # declared dead after missed heartbeats, not banned
        run.pool.wait_node_state(run.pool.node_id(victim), "dead", 40)
    nodes = {n["node_id"]: n for n in pool_state(run.pool.url)["nodes"]}
    assert nodes[run.pool.node_id("n0")]["state"] == "healthy"
    assert nodes[run.pool.node_id("n0")]["weights_version"] >= 1
    gen = {name: nodes[run.pool.node_id(name)]["generated"] for name in run.kinds}
    alive = [f for f in fast if f not in victims]
    assert min(gen[f] for f in alive) > max(gen["s0"], gen["s1"]), gen
    made = read_metrics(run.run, "orchestrator")
    assert all(r["samples"] for r in made), "a step had nothing to train on"
    # No round outlived its deadline (a round's verdicts are read as they come).
    assert all(r["generate_s"] <= r["rounds"] * (deadline_s + 2.0) for r in made), made
    groups = {
        k: sum(r.get(k, 0) for r in made)
        for k in ("rescheduled", "partial_groups", "dropped_straggler", "rounds")
    }
    report(
        "swarm churn, stragglers and a launderer mid-group (7 workers, 2 killed, 2 joined, "
        "10 steps)",
        {"generated": gen, **groups, **counts},
    )


def test_scheduler_killed_and_restarted_on_the_same_database(fault_run, report):
    """kill -9 of the scheduler mid-run and a restart on the same SQLite file: nodes
    heartbeat to it again, the orchestrator's calls and results stream resume, and
    nothing is lost or released twice."""
    run = fault_run(8)
    run.start_pool({f"w{i}": None for i in range(3)})
    run.start_training()
    run.wait_step(3)
    time.sleep(random.Random(3).uniform(0.0, 2.0))
    run.pool.scheduler.kill9()
    killed_at = run.trained_steps()
    time.sleep(2)
    run.pool.start_scheduler()
    run.wait_finished()
    assert killed_at < run.steps
    counts = run.audit()
    report(
        "swarm scheduler kill -9 + restart (8 steps)", {"killed_after_step": killed_at, **counts}
    )


GENERATOR_CHEATS = [
    "other-weights", "perturbed-weights", "lower-precision", "tampered-tokens",
    "forged-proof", "replayed-proof", "made-up-logprobs", "other-sampling", "wrong-version",
]  # fmt: skip
VERIFIER_CHEATS = ["reject-all", "accept-all"]
# reject-all is proven wrong by the first honest rollout it rejects; accept-all only by a
# cheat's rollout it vouches for, which may never come its way if honest verifiers ban
# the cheats first: it is judged by what it did (below), not by its kind.


def test_one_dishonest_node_of_each_kind_among_honest_ones(fault_run, report, monkeypatch):
    """Four honest workers and one node of every dishonest kind of tests/adversaries.py
    but the liars in what clients read (next test) (every generator cheat, both verifier
    cheats, a peer serving corrupted weight pieces, a node that goes silent mid-request) in one pool that audits every accept
    (audit_rate 1: one lying verifier cannot let a cheat through). Training goes on;
    every cheating generator and the reject-all verifier are banned; nothing of theirs
    is trained on; accept-all loses reputation for every cheat it vouched for; the silent
    node is benched; the corrupting peer is banned by its peers, not by the pool."""
    # Weight noise of 2e-3 x std (the kind's default) passes on about half of this model's
    # short, confident answers (measured: 9 of 16); 2e-2 is a cheat the checks must catch.
    monkeypatch.setenv("PRIME_PERTURB_SCALE", "2e-2")
    policy = tiny_verification().model_copy(update={"audit_rate": 1.0})
    run = fault_run(8, verification=policy)
    kinds: dict[str, str | None] = {f"h{i}": None for i in range(4)}
    kinds |= {k: k for k in [*GENERATOR_CHEATS, *VERIFIER_CHEATS, "corrupt-pieces", "silent"]}
    run.start_pool(
        kinds,
        "--lifecycle.swarm-announce-interval-s", "2",
        "--dispatch.generate-timeout-s", "10",
        "--dispatch.openai-timeout-s", "40",
    )  # fmt: skip
    run.start_training()
    run.wait_finished()
    # wrong-version holds v0 for real until the first update: it lies from v1 on.
    counts = run.audit(
        cheat_generators={k: 1 if k == "wrong-version" else 0 for k in GENERATOR_CHEATS},
        cheat_verifiers={"reject-all"},
        exempt={"corrupt-pieces", "silent", "accept-all"},
        # bf16 on an fp32 pool: on a few-token answer of the tiny model its error can be
        # under the fp32 thresholds (seen once: max 0.00997 against 0.01, vouched for by
        # accept-all and passed by the audit); the evidence bans it, a rollout may pass.
        statistical={"lower-precision"},
    )
    # accept-all: punished for every rollout it vouched for that the pool then rejected
    # (banned once those outpace the reputation its honest-looking accepts earn).
    with sqlite3.connect(run.pool.workdir / "scheduler.db") as db:
        vouched_bad = db.execute(
            "SELECT count(*) FROM verdicts v JOIN results r ON r.request_id = v.request_id"
            " WHERE v.verifier_id = ? AND v.accepted AND r.status = 'rejected'",
            (run.pool.node_id("accept-all"),),
        ).fetchone()[0]
    nodes = {n["node_id"]: n for n in pool_state(run.pool.url)["nodes"]}
    if vouched_bad:
        log = (run.pool.workdir / "scheduler.log").read_text()
        assert "accept-all loses reputation" in log, vouched_bad
    assert nodes[run.pool.node_id("silent")]["state"] == "unhealthy"
    assert nodes[run.pool.node_id("corrupt-pieces")]["state"] == "healthy"
    liar = run.pool.node_id("corrupt-pieces")
    banned_by = [
        name
        for name in kinds
        if name != "corrupt-pieces"
        and f"banning peer {liar}" in (run.pool.workdir / f"{name}.log").read_text()
    ]
    assert banned_by, "no peer took a piece from the corrupting peer"
    report(
        "swarm dishonest nodes during training (4 honest, 13 dishonest, 8 steps)",
        {
            "corrupting peer banned by": len(banned_by),
            "accept-all vouched for rejected rollouts": vouched_bad,
            "accept-all state": nodes[run.pool.node_id("accept-all")]["state"],
            **counts,
        },
    )


LIARS = {
    # kind: what it may be banned for (tests/adversaries.py: the check each lie meets)
    "lying-json": ("contradicts its request: prompt", "rejected by two verifiers"),
    "other-prompt": ("contradicts its request: prompt", "rejected by two verifiers"),
    "truncating": ("contradicts its request: sampling", "rejected by two verifiers"),
}


def test_liars_in_what_clients_read_among_honest_ones(fault_run, report):
    """Four honest workers and the three liars in what a client reads, each signing its
    lies (tests/adversaries.py: `lying-json`: made-up logprobs, another prompt's ids, ids
    of another text; `other-prompt`: generated after an injected system prompt;
    `truncating`: cut to half, with a rewritten max_tokens or a false finish reason),
    while the orchestrator trains through the scheduler's OpenAI front. Training goes on;
    each liar is banned for a lie its check caught; nothing of theirs is trained on; every
    trained sample is its signed rollout (the audit), and the orchestrator never had to
    drop a turn whose ids or text differed from it."""
    run = fault_run(6)
    kinds: dict[str, str | None] = {f"h{i}": None for i in range(4)} | {k: k for k in LIARS}
    run.start_pool(kinds)
    run.start_training()
    run.wait_finished()
    counts = run.audit(cheat_generators=set(LIARS))
    assert counts["dropped_mismatch"] == 0, counts
    assert counts["signed_samples"] == counts["trained_samples"]
    lies: dict[str, dict[str, int]] = {}
    with sqlite3.connect(run.pool.workdir / "scheduler.db") as db:
        for kind, why in LIARS.items():
            node = run.pool.node_id(kind)
            (reason,) = db.execute("SELECT reason FROM nodes WHERE node_id = ?", (node,)).fetchone()
            assert any(w in reason for w in why), (kind, reason)
            rejected = db.execute(
                "SELECT count(DISTINCT rollout_envelope) FROM verdicts"
                " WHERE generator_id = ? AND NOT accepted",
                (node,),
            ).fetchone()[0]
            vouched = db.execute(
                "SELECT count(*) FROM verdicts WHERE generator_id = ? AND accepted", (node,)
            ).fetchone()[0]
            assert vouched == 0, (kind, vouched)
            lies[kind] = {"rejected_by_verifiers": rejected}
    lines = (run.pool.workdir / "scheduler.log").read_text().splitlines()
    for kind in LIARS:
        lies[kind]["caught_by_scheduler"] = sum(
            f"{kind} loses reputation" in line and "contradicts its request" in line
            for line in lines
        )
    report(
        "swarm liars in what clients read during training (4 honest, 3 liars, 6 steps)",
        {"lies caught": lies, **counts},
    )


def test_rl_with_delta_weights_trains_as_before(fault_run, report):
    """bf16 publishing at an RL-sized learning rate (1e-5): most steps ship as deltas, the
    workers rebuild each version from the one before and check it against its signed
    full manifest; the trainer is killed with kill -9 mid-run, `rl` stops the
    orchestrator, `rl --ckpt.resume` continues from the last checkpoint on the same pool
    and the chain of deltas goes on from the versions on disk; the run passes the same
    audit as every fault test. (This is also the trainer-kill fault test: one run for both.)"""
    run = fault_run(
        8, "--weights.dtype", "bfloat16", "--trainer.optim.lr", "1e-5", "--ckpt.interval", "2",
        "--weights.keyframe-interval", "8",
    )  # fmt: skip
    run.start_pool({f"w{i}": None for i in range(4)})
    run.start_training()
    run.wait_step(4)
    time.sleep(random.Random(4).uniform(0.0, 1.0))  # anywhere inside a step
    killed_at = run.trained_steps()
    run.kill_trainer()
    assert killed_at < run.steps
    run.start_training("--ckpt.resume")
    run.wait_finished()
    assert "resumed from the checkpoint of step" in (run.run / "logs" / "trainer.log").read_text()
    counts = run.audit()
    published = {
        p["step"]: p  # a step redone after the resume is written again: the last one counts
        for p in map(json.loads, (run.run / "weights" / "published.jsonl").read_text().splitlines())
    }
    ratios = {
        n: p["delta_bytes"] / p["full_bytes"] for n, p in published.items() if p["delta_bytes"]
    }
    rebuilt = {
        name: len(
            re.findall(r"fetched through deltas", (run.pool.workdir / f"{name}.log").read_text())
        )
        for name in run.kinds
    }
    report(
        "swarm RL with delta weights (4 workers, 8 steps, bf16, lr 1e-5, trainer kill -9 + resume)",
        {
            **counts,
            "killed_after_step": killed_at,
            "delta_over_full": {n: round(r, 3) for n, r in sorted(ratios.items())},
            "rebuilt": rebuilt,
        },
    )
    # Step 0 has no base and step 8 is a keyframe (`--weights.keyframe-interval 8`): full only.
    assert set(range(1, 8)) <= set(ratios) and 8 not in ratios, published
    assert max(ratios.values()) < 0.5, ratios
    assert all(n >= 3 for n in rebuilt.values()), rebuilt


def test_a_run_on_an_open_pool_keeps_training_among_free_identities(
    tmp_path, fault_run, report, monkeypatch
):
    """An open pool whose right to check is earned (issue 26): three honest founders and
    nine free identities of every strategy (two that never answer and reject everything,
    a cheating generator with two accomplices that side with it and two that accept
    everything, two that turn once they may check). Training goes on to its last step,
    the cheat is banned and nothing of it is trained, no honest worker is banned or loses
    reputation."""
    honest = ["h0", "h1", "h2"]
    workdir = tmp_path / "run0"  # the fixture's first run: its keys are made here first
    workdir.mkdir(parents=True)
    founders = [Identity.load_or_create(workdir / f"{n}.key").node_id for n in honest]
    run = fault_run(6, checkers=CheckerPolicy(earn_after=4, founders=founders))
    assert run.pool.workdir == workdir
    monkeypatch.setenv("PRIME_ACCOMPLICES", run.pool.node_id("cheat"))
    monkeypatch.setenv("PRIME_TURN_AFTER", "4")
    kinds: dict[str, str | None] = dict.fromkeys(honest)
    kinds |= {"cheat": "other-weights", "sybil0": "sybil", "sybil1": "sybil"}
    kinds |= {f"{k}{i}": k for k in ("accomplice", "accept-all", "turncoat") for i in range(2)}
    run.start_pool(
        kinds, "--dispatch.generate-timeout-s", "10", "--dispatch.openai-timeout-s", "40"
    )
    t0 = time.monotonic()
    run.start_training()
    run.wait_finished()
    minutes = (time.monotonic() - t0) / 60
    counts = run.audit(cheat_generators={"cheat"}, exempt=set(kinds) - {*honest, "cheat"})
    log = (run.pool.workdir / "scheduler.log").read_text(errors="replace")
    assert not any(f"{h} loses reputation" in log for h in honest)
    report(
        "swarm: RL on an open pool among 9 free identities (3 honest founders, 6 steps)",
        {"steps_per_min": round(6 / minutes, 2), **counts},
    )
