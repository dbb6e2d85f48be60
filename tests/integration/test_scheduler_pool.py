"""A whole pool on loopback: a scheduler process and `prime-node join` workers on the tiny
model, driven through the orchestrator's client; then workers and the scheduler are
killed with SIGKILL, and dishonest nodes join.

What a user would notice, asserted from the results stream and the scheduler's state:
every request is delivered exactly once and verified by a node other than its generator;
crashes lose nothing and duplicate nothing; cheaters are banned and nothing of theirs is
released; honest nodes are never banned.
"""

from __future__ import annotations

import re
import signal
import time
from collections import Counter

import openai
import pytest

from protocol.envelope import open_envelope
from protocol.messages import (
    ReputationPolicy,
    Rollout,
    RolloutSpec,
    SamplingParams,
    Verdict,
    WeightUpdate,
)
from tests.pools import Pool, collect, make_pool, postgres_database

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
FAST_LIFECYCLE = (
    "--lifecycle.heartbeat-interval-s",
    "1",
    "--lifecycle.unhealthy-after-s",
    "3",
    "--lifecycle.dead-after-s",
    "6",
    "--lifecycle.check-interval-s",
    "0.5",
)


def specs(
    n: int, prefix: str = "r", max_tokens: int = 16, min_version: int = 0
) -> list[RolloutSpec]:
    return [
        RolloutSpec(
            request_id=f"{prefix}{i}",
            prompt_ids=[5 + i % 40, 9 + i % 13, 11, 7 + i % 5],
            sampling=SamplingParams(max_tokens=max_tokens),
            min_version=min_version,
        )
        for i in range(n)
    ]


def check_delivered_once_and_verified(
    results, expected_ids: set[str], banned: set[str] = frozenset()
):
    counts = Counter(r.request_id for r in results)
    dupes = {k: c for k, c in counts.items() if c > 1}
    assert not dupes, f"delivered more than once: {dupes}"
    assert set(counts) == expected_ids, f"missing: {sorted(expected_ids - set(counts))[:10]}"
    seqs = [r.seq for r in results]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    for r in results:
        assert r.status == "accepted", (r.request_id, r.status, r.detail)
        rollout = open_envelope(r.rollout_envelope, Rollout, check_expiry=False)
        assert rollout.message.request_id == r.request_id
        assert rollout.sender_id not in banned, f"released a rollout of banned {rollout.sender_id}"
        verdicts = [open_envelope(v, Verdict, check_expiry=False) for v in r.verdict_envelopes]
        assert verdicts, f"{r.request_id} released without a verdict"
        final = verdicts[-1]
        assert final.message.accepted and final.message.rollout_digest == rollout.message.digest()
        assert final.sender_id != rollout.sender_id, "verified by its own generator"


def check_audit_records(pool: Pool, expected: int) -> Counter:
    """Every verdict is on record with the generator's and the verifier's signatures;
    returns the disputes each generator lost."""
    import sqlite3

    db_path = pool.db_url.split("///", 1)[1]
    rows = sqlite3.connect(db_path).execute(
        "SELECT kind, generator_id, verifier_id, accepted, rollout_envelope, verdict_envelope"
        " FROM verdicts"
    )
    n = 0
    lost: Counter = Counter()
    for kind, generator_id, verifier_id, accepted, rollout_env, verdict_env in rows:
        if kind == "dispute" and not accepted:
            lost[generator_id] += 1
        rollout = open_envelope(rollout_env, Rollout, check_expiry=False)
        verdict = open_envelope(verdict_env, Verdict, check_expiry=False)
        assert rollout.sender_id == generator_id and verdict.sender_id == verifier_id
        assert verdict.message.rollout_digest == rollout.message.digest()
        assert bool(accepted) == verdict.message.accepted
        n += 1
    assert n == expected
    return lost


async def run_verifiers_env(url: str, api_key: str) -> set[str]:
    """Six single-turn episodes through the scheduler; returns the rollout id of each turn."""
    import os

    import verifiers as vf
    from datasets import Dataset

    os.environ["PRIME_TEST_API_KEY"] = api_key
    ds = Dataset.from_list([{"question": q, "answer": q[::-1]} for q in ("abc", "swarm", "node")])
    env = vf.SingleTurnEnv(dataset=ds, rubric=vf.Rubric(funcs=[lambda completion, **_: 1.0]))
    out = await env.evaluate(
        client=vf.ClientConfig(api_base_url=f"{url}/v1", api_key_var="PRIME_TEST_API_KEY"),
        model="tiny",
        # ignore_eos: a random tiny model sometimes ends at once, and verifiers calls an
        # empty answer an error (EmptyModelResponseError).
        sampling_args={
            "logprobs": True,
            "max_tokens": 8,
            "extra_body": {"return_token_ids": True, "ignore_eos": True},
        },
        num_examples=3,
        rollouts_per_example=2,
        state_columns=["trajectory"],
    )
    ids = set()
    for o in out["outputs"]:
        assert not o["error"], o["error"]
        for turn in o["trajectory"]:
            assert turn["tokens"] is not None, "token ids missing: verifiers dropped them"
            ids.add(turn["response"].id.removeprefix("chatcmpl-"))
    assert len(ids) == 6
    return ids


def a_order(answers, result) -> int:
    return [a.model_extra["rollout_id"] for a in answers].index(result.request_id)


@pytest.fixture
def pool(tmp_path):
    p = make_pool(tmp_path)
    yield p
    p.close()


async def test_three_workers_serve_200_requests_verified_exactly_once(pool: Pool):
    pool.start_scheduler(*FAST_LIFECYCLE)
    pool.join_many(["w0", "w1", "w2"])
    ids = {f"r{i}" for i in range(200)}
    async with pool.client() as client:
        t0 = time.time()
        ack = await client.submit(specs(200))
        assert (ack.accepted, ack.duplicates) == (200, 0)
        again = await client.submit(specs(10))  # resubmitting is a no-op
        assert (again.accepted, again.duplicates) == (0, 10)
        results = await collect(client, 200, 240)
        elapsed = time.time() - t0
        check_delivered_once_and_verified(results, ids)
        # Nothing more arrives: each request exactly once.
        late = await client.results(results[-1].seq, wait_s=1.0)
        assert late.results == []

        # The OpenAI-compatible endpoint: answered once verified, from the signed rollout.
        oai = openai.AsyncOpenAI(base_url=f"{pool.url}/v1", api_key=pool.api_key())
        answers = [
            await oai.completions.create(model="tiny", prompt="hello", max_tokens=8, seed=123)
            for _ in range(3)
        ]
        rollout_ids = {a.model_extra["rollout_id"] for a in answers}
        assert len(rollout_ids) == 3  # the scheduler chose the seeds, not the client
        assert {a.model_extra["seed_chosen_by"] for a in answers} == {"scheduler"}
        more = await collect(client, 3, 60, after=results[-1].seq)
        assert {r.request_id for r in more} == rollout_ids
        assert {(r.source, r.status) for r in more} == {("openai", "accepted")}
        for a, r in zip(answers, sorted(more, key=lambda r: a_order(answers, r)), strict=True):
            signed = open_envelope(r.rollout_envelope, Rollout, check_expiry=False).message
            assert a.choices[0].model_extra["token_ids"] == signed.completion_ids
        await oai.close()

        # A verifiers environment pointed at the scheduler: every turn's response id names
        # the rollout whose verdict then arrives in the stream.
        turn_ids = await run_verifiers_env(pool.url, pool.api_key())
        verdicts = await collect(client, len(turn_ids), 60, after=more[-1].seq)
        assert {r.request_id for r in verdicts} == turn_ids
        assert {r.status for r in verdicts} == {"accepted"}

        # New weights reach every node through its heartbeat; requests that need them
        # are generated (and verified) only with them.
        from verifier.models import resolve_model

        update = WeightUpdate(version=1, path=str(resolve_model("tiny")))
        assert await client.publish_weights(update) == 1
        deadline = time.time() + 60
        while {n["weights_version"] for n in pool.state()["nodes"]} != {1}:
            assert time.time() < deadline, pool.state()["nodes"]
            time.sleep(0.5)
        await client.submit(specs(10, prefix="v1-", max_tokens=8, min_version=1))
        v1 = await collect(client, 10, 60, after=verdicts[-1].seq)
        assert {r.weights_version for r in v1} == {1}
    state = pool.state()
    assert {n["state"] for n in state["nodes"]} == {"healthy"}
    assert sum(n["generated"] for n in state["nodes"]) >= 203
    assert state["totals"]["rejections"] == 0
    print(f"\n200 rollouts generated and verified by 3 tiny workers in {elapsed:.1f} s")

    # A clean leave: SIGTERM drains, deregisters and exits 0.
    w2 = pool.nodes["w2"]
    w2.proc.send_signal(signal.SIGTERM)
    assert w2.proc.wait(30) == 0
    assert pool.node_state(pool.node_id("w2")) == "left"


async def test_worker_killed_mid_run_loses_and_duplicates_nothing(pool: Pool):
    pool.start_scheduler(*FAST_LIFECYCLE)
    pool.join_many(["w0", "w1", "w2"])
    async with pool.client() as client:
        await client.submit(specs(150, max_tokens=24))
        first = await collect(client, 20, 120)
        victim = pool.nodes["w1"]
        victim.kill9()
        rest = await collect(client, 150 - len(first), 300, after=first[-1].seq)
    check_delivered_once_and_verified(first + rest, {f"r{i}" for i in range(150)})
    pool.wait_node_state(pool.node_id("w1"), "dead", 20)
    # The kill hit work in flight on w1 (a generation re-dispatched or a verification
    # moved to another verifier), and the scheduler said so.
    log = pool.scheduler.log_tail(2_000_000)
    assert re.search(r"w1 (unreachable|died|did not answer)", log), "no call to w1 was cut"


async def test_spot_check_rate_zero_releases_unverified_from_a_single_node(tmp_path):
    from tests.pools import tiny_verification

    verification = tiny_verification().model_copy(update={"spot_check_rate": 0.0})
    pool = make_pool(tmp_path, verification=verification)
    try:
        pool.start_scheduler()
        pool.join("solo")  # no second node: only a pool that skips verification can serve
        async with pool.client() as client:
            await client.submit(specs(20))
            results = await collect(client, 20, 120)
        assert len({r.request_id for r in results}) == 20
        assert {(r.status, r.detail) for r in results} == {("accepted", "unverified (spot check)")}
        assert all(r.verdict_envelopes == [] for r in results)
    finally:
        pool.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
async def test_scheduler_killed_and_restarted_loses_and_duplicates_nothing(tmp_path, backend):
    if backend == "postgresql":
        async with postgres_database() as url:
            await check_scheduler_restart(tmp_path, url)
    else:
        await check_scheduler_restart(tmp_path, None)


async def check_scheduler_restart(tmp_path, db_url: str | None) -> None:
    pool = make_pool(tmp_path, db_url=db_url)
    try:
        pool.start_scheduler()
        pool.join_many(["w0", "w1", "w2"])
        ids = {f"r{i}" for i in range(150)}
        async with pool.client() as client:
            await client.submit(specs(150, max_tokens=24))
            first = await collect(client, 30, 120)
            cursor = first[-1].seq
            pool.scheduler.kill9()
            pool.start_scheduler(log_name="scheduler-restarted")
            # Resubmitting after a crash (the orchestrator cannot know what survived) is safe.
            ack = await client.submit(specs(150, max_tokens=24))
            assert ack.accepted == 0 and ack.duplicates == 150
            rest = await collect(client, 150 - len(first), 300, after=cursor)
        check_delivered_once_and_verified(first + rest, ids)
        # The restarted scheduler knew the nodes from the database.
        for name in ("w0", "w1", "w2"):
            pool.wait_node_state(pool.node_id(name), "healthy", 30)
    finally:
        pool.close()


async def test_dishonest_generators_are_banned_and_dishonest_verifier_loses_disputes(tmp_path):
    pool = make_pool(tmp_path, reputation=ReputationPolicy())
    try:
        pool.start_scheduler()
        pool.join_many(
            ["h0", "h1", "tamper", "forge", "rejecter"],
            tamper="tampered-tokens",
            forge="forged-proof",
            rejecter="reject-all",
        )
        cheaters = {pool.node_id("tamper"), pool.node_id("forge")}
        honest = {pool.node_id("h0"), pool.node_id("h1")}
        rejecter = pool.node_id("rejecter")
        async with pool.client() as client:
            await client.submit(specs(120))
            results = await collect(client, 120, 400)
        check_delivered_once_and_verified(results, {f"r{i}" for i in range(120)}, banned=cheaters)
        state = {n["node_id"]: n for n in pool.state()["nodes"]}
        for node_id in cheaters | {rejecter}:
            assert state[node_id]["state"] == "banned", state[node_id]
        for node_id in honest:
            assert state[node_id]["state"] == "healthy", state[node_id]
            assert state[node_id]["reputation"] >= 0.99
        for node_id in cheaters | {rejecter}:
            # Three lost disputes take a node from 1.0 under the 0.3 threshold.
            assert state[node_id]["reputation"] < 0.3
        totals = pool.state()["totals"]
        print(f"\ndishonest pool: {totals}")
        lost = check_audit_records(pool, totals["verifications"])
        # Bounded: banned at the third lost dispute; on probation (4 in flight, nothing
        # accepted) a cheater cannot have more rollouts under way than that.
        for node_id in cheaters:
            assert 3 <= lost[node_id] <= 3 + 4, lost
        print(f"lost disputes as generator: {lost}")
        # A banned node's process is told so at its next heartbeat and exits with status 3.
        for name in ("tamper", "forge", "rejecter"):
            assert pool.nodes[name].proc.wait(30) == 3
    finally:
        pool.close()
