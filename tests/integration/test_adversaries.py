"""Dishonest nodes (tests/adversaries.py, each a whole `prime-node join` process with one
cheat) in a real pool on loopback, next to honest tiny-model workers; what must hold:

- every generator cheat and every lying verifier ends banned by the scheduler, and no
  rollout it generated is released as accepted;
- a node whose weight-swarm peer serves corrupted pieces is banned by its peers, who
  still load the published weights;
- a node that never answers is timed out and benched, its work done by others (the
  OpenAI endpoint retries another node); an honest straggler is never punished;
- no honest node is banned, and every request gets exactly one result.

Two pool runs (each node process costs seconds of CPU to start): one with every
generator and verifier cheat and audits on; one where the trainer publishes a new
version over the swarm, with the wrong-version, corrupt-pieces, silent and slow nodes.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections import Counter

import httpx
import pytest

from protocol.envelope import open_envelope
from protocol.messages import Rollout, RolloutResult, RolloutSpec, SamplingParams, Verdict
from tests.pools import Pool, collect, make_pool, tiny_verification

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
FAST_LIFECYCLE = (
    "--lifecycle.heartbeat-interval-s",
    "1",
    "--lifecycle.unhealthy-after-s",
    "4",
    "--lifecycle.dead-after-s",
    "8",
    "--lifecycle.check-interval-s",
    "0.5",
)
GENERATOR_CHEATS = {
    "otherw": "other-weights",
    "perturb": "perturbed-weights",
    "lowprec": "lower-precision",
    "tamper": "tampered-tokens",
    "forge": "forged-proof",
    "replay": "replayed-proof",
    "madeup": "made-up-logprobs",
    "othersamp": "other-sampling",
}


def specs(n: int, prefix: str, min_version: int = 0) -> list[RolloutSpec]:
    return [
        RolloutSpec(
            request_id=f"{prefix}{i}",
            prompt_ids=[5 + i % 40, 9 + i % 13, 11, 7 + i % 5],
            sampling=SamplingParams(max_tokens=16),
            min_version=min_version,
        )
        for i in range(n)
    ]


async def openai_calls(pool: Pool, n: int, min_version: int = 0) -> set[str]:
    """`n` concurrent completions through the scheduler's OpenAI endpoint; returns the
    rollout id of each answer (every call must succeed)."""
    async with httpx.AsyncClient(timeout=120) as http:

        async def one(i: int) -> str:
            body = {
                "model": "tiny",
                "prompt": [6 + i % 30, 12, 8 + i % 7],
                "max_tokens": 16,
                "min_version": min_version,
            }
            for _ in range(240):  # 503: every node busy (probation slots); retry later
                resp = await http.post(f"{pool.url}/v1/completions", json=body)
                if resp.status_code != 503:
                    break
                await asyncio.sleep(0.5)
            assert resp.status_code == 200, resp.text
            return resp.json()["rollout_id"]

        ids = await asyncio.gather(*(one(i) for i in range(n)))
    assert len(set(ids)) == n
    return set(ids)


def generator_of(result: RolloutResult) -> str:
    return open_envelope(result.rollout_envelope, Rollout, check_expiry=False).sender_id


def check_results(
    pool: Pool, results: list[RolloutResult], expected: set[str], cheaters: set[str]
) -> Counter:
    """Exactly one result per request; nothing accepted from a cheater (by the rollout's
    signature and by the results table); every accepted result verified by others.
    Returns the accepted results per generator."""
    counts = Counter(r.request_id for r in results)
    assert not [k for k, c in counts.items() if c > 1], "a request got two results"
    assert set(counts) == expected, f"missing: {sorted(expected - set(counts))[:10]}"
    by_gen: Counter = Counter()
    for r in results:
        if r.status != "accepted":
            continue
        gen = generator_of(r)
        by_gen[gen] += 1
        assert gen not in cheaters, f"accepted a rollout of cheater {gen}: {r.request_id}"
        verdicts = [open_envelope(v, Verdict, check_expiry=False) for v in r.verdict_envelopes]
        assert verdicts and verdicts[-1].message.accepted
        assert all(v.sender_id != gen for v in verdicts)
    rows = sqlite3.connect(pool.db_url.split("///", 1)[1]).execute(
        "SELECT generator_id FROM results WHERE status = 'accepted'"
    )
    assert not {g for (g,) in rows} & cheaters
    return by_gen


def verdict_kinds(pool: Pool) -> Counter:
    return Counter(k for (k,) in sql(pool, "SELECT kind FROM verdicts"))


def sql(pool: Pool, query: str, *args) -> list[tuple]:
    return sqlite3.connect(pool.db_url.split("///", 1)[1]).execute(query, args).fetchall()


def ban_reason(pool: Pool, node_id: str) -> str:
    return sql(pool, "SELECT reason FROM nodes WHERE node_id = ?", node_id)[0][0]


def states(pool: Pool) -> dict[str, dict]:
    return {n["node_id"]: n for n in pool.state()["nodes"]}


def wait_banned(pool: Pool, node_ids: set[str], timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if all(states(pool)[n]["state"] == "banned" for n in node_ids):
            return
        time.sleep(0.5)


async def test_generator_and_verifier_cheats_are_banned_with_audits(tmp_path):
    """All generator cheats (one operator, "mallory"), a verifier that accepts everything
    and one that rejects everything, three honest nodes; audit_rate 1.0."""
    verification = tiny_verification().model_copy(update={"audit_rate": 1.0})
    pool = make_pool(tmp_path, verification=verification)
    started = time.time()
    try:
        # Probation 8: each cheater gets a few rollouts into verification before its
        # disputes land, so the accept-everything verifier meets enough bad ones.
        pool.start_scheduler(*FAST_LIFECYCLE, "--dispatch.probation", "8")
        honest = ["h0", "h1", "h2"]
        for name in honest:
            pool.join(name, wait=False)
        for name, kind in GENERATOR_CHEATS.items():
            pool.join(name, operator="mallory", wait=False, dishonest=kind)
        pool.join("acceptall", wait=False, dishonest="accept-all")
        pool.join("rejectall", wait=False, dishonest="reject-all")
        names = [*honest, *GENERATOR_CHEATS, "acceptall", "rejectall"]
        for name in names:
            pool.wait_joined(name)
        joined = time.time() - started
        gen_cheats = {pool.node_id(n) for n in GENERATOR_CHEATS}
        liars = {pool.node_id("acceptall"), pool.node_id("rejectall")}
        honest_ids = {pool.node_id(n) for n in honest}

        async with pool.client() as client:
            oa_ids = await openai_calls(pool, 12)
            await client.submit(specs(120, "r"))
            results = await collect(client, 132, 300)
        by_gen = check_results(pool, results, {f"r{i}" for i in range(120)} | oa_ids, gen_cheats)
        # Requests through the scheduler are generated again until an honest node's
        # rollout is accepted; OpenAI calls answered by a cheater are released rejected
        # (or failed, when it was banned before its rollout was verified).
        assert all(r.status == "accepted" for r in results if r.source == "dispatch")
        wait_banned(pool, gen_cheats | liars, 30)
        final = states(pool)
        for node_id in gen_cheats | liars:
            assert final[node_id]["state"] == "banned", final[node_id]
        for node_id in honest_ids:
            assert final[node_id]["state"] == "healthy", final[node_id]
        kinds = verdict_kinds(pool)
        assert kinds["audit"] > 0
        # Each was caught for what it did: cheaters' rollouts rejected by two verifiers,
        # the accept-all verifier outvoted on cheats it accepted, the reject-all one on
        # honest rollouts it rejected.
        for node_id in gen_cheats:
            assert "rejected by two verifiers" in ban_reason(pool, node_id)
        accept_all, reject_all = pool.node_id("acceptall"), pool.node_id("rejectall")
        assert "accepted a rollout that two verifiers rejected" in ban_reason(pool, accept_all)
        assert "rejected an honest rollout" in ban_reason(pool, reject_all)
        (vouched,) = sql(
            pool,
            "SELECT count(*) FROM verdicts WHERE verifier_id = ? AND accepted AND generator_id"
            f" IN ({','.join('?' * len(gen_cheats))})",
            accept_all,
            *gen_cheats,
        )[0]
        print(
            f"\ncheats pool: {len(names)} nodes joined in {joined:.0f} s, all done in "
            f"{time.time() - started:.0f} s; verdicts {dict(kinds)}; accepted per honest "
            f"generator {[by_gen[n] for n in honest_ids]}; accept-all vouched for {vouched} "
            "cheats before its ban"
        )
        for name in (*GENERATOR_CHEATS, "acceptall", "rejectall"):
            assert pool.nodes[name].proc.wait(30) == 3  # told it is banned: exit status 3
    finally:
        pool.close()


async def test_wrong_version_corrupt_pieces_silent_and_slow_nodes(tmp_path):
    """The trainer publishes version 1 over the swarm; a node that claims it but keeps
    the old weights is banned, a node serving corrupted pieces is banned by its peers, a
    silent node is benched, a slow one keeps its reputation."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from protocol.swarm.config import SwarmConfig
    from trainer.weights import SwarmTransport
    from verifier.models import load_tokenizer, resolve_model

    kib = 1024
    cap = ["--weights.peer.upload_rate", str(128 * kib)]
    pool = make_pool(tmp_path / "pool")
    transport = SwarmTransport(
        tmp_path / "run",
        keep_last=2,
        cfg=SwarmConfig(upload_rate=128 * kib, piece_size=16 * kib),
        trainer_key=pool.workdir / "trainer.key",
    )
    started = time.time()
    try:
        pool.start_scheduler(
            *FAST_LIFECYCLE,
            "--lifecycle.swarm_announce_interval_s",
            "2",
            "--dispatch.generate_timeout_s",
            "8",
            "--dispatch.openai_timeout_s",
            "8",
        )
        honest = ["h0", "h1", "h2"]
        kinds = {
            "wrong": "wrong-version",
            "corrupt": "corrupt-pieces",
            "silent": "silent",
            "slow": "slow",
        }
        for name in honest:
            pool.join(name, *cap, wait=False)
        for name, kind in kinds.items():
            # The corrupting peer uploads without a cap: the others are keen to use it.
            pool.join(name, *([] if kind == "corrupt-pieces" else cap), wait=False, dishonest=kind)
        names = [*honest, *kinds]
        for name in names:
            pool.wait_joined(name)
        ids = {name: pool.node_id(name) for name in names}
        joined = time.time() - started

        # Version 1: the tiny model with noise far above what the verifier tolerates.
        tiny = resolve_model("tiny")
        gen = torch.Generator().manual_seed(1)
        state = {
            k: v + 0.05 * v.float().std() * torch.randn(v.shape, generator=gen)
            for k, v in load_file(tiny / "model.safetensors").items()
        }
        transport.save(1, state, AutoConfig.from_pretrained(tiny), load_tokenizer(tiny))
        update = transport.update(1)
        async with pool.client() as client:
            await client.publish_weights(update)
        deadline = time.time() + 120
        while pool.health()["healthy_versions"] != {"1": len(names)}:
            assert time.time() < deadline, pool.health()
            await asyncio.sleep(0.5)
        loaded = time.time() - started

        # Every node but the liar holds version 1 for real (its health says so too: it
        # claims it); peers banned the corrupting one at its first bad piece.
        for name in names:
            held = httpx.get(pool.nodes[name].health_url).json()
            assert (held["weights_version"], held["weights_hash"]) == (1, update.weights_hash)
        banned_by = [
            name
            for name in names
            if name != "corrupt"
            and f"banning peer {ids['corrupt']}" in (pool.workdir / f"{name}.log").read_text()
        ]
        assert banned_by, "no peer downloaded a piece from the corrupting peer"

        async with pool.client() as client:
            # OpenAI calls first: some land on the silent node, time out and go elsewhere.
            oa_ids = await openai_calls(pool, 14, min_version=1)
            await client.submit(specs(60, "v", min_version=1))
            results = await collect(client, 74, 300)
        check_results(
            pool, results, {f"v{i}" for i in range(60)} | oa_ids, {ids["wrong"], ids["silent"]}
        )
        assert all(r.status == "accepted" for r in results if r.source == "dispatch")
        assert all(r.weights_version == 1 for r in results if r.status == "accepted")
        wait_banned(pool, {ids["wrong"]}, 30)
        final = states(pool)
        assert final[ids["wrong"]]["state"] == "banned", final[ids["wrong"]]
        # Its rollouts were rejected by the verifiers holding the version it claimed.
        lost = sql(
            pool,
            "SELECT count(*) FROM verdicts WHERE generator_id = ? AND kind = 'dispute'"
            " AND NOT accepted",
            ids["wrong"],
        )[0][0]
        assert lost >= 1
        # Silent: timed out, benched (no work however well it heartbeats), never banned.
        assert final[ids["silent"]]["state"] == "unhealthy", final[ids["silent"]]
        log = (pool.workdir / "scheduler.log").read_text()
        assert "silent did not answer /v1/rollouts" in log
        assert "OpenAI call on silent failed" in log
        for name in (*honest, "corrupt", "slow"):
            assert final[ids[name]]["state"] == "healthy", (name, final[ids[name]])
            assert final[ids[name]]["reputation"] >= 0.99, (name, final[ids[name]])
        assert final[ids["slow"]]["generated"] > 0
        print(
            f"\nswarm pool: {len(names)} nodes joined in {joined:.0f} s, version 1 loaded by "
            f"all at {loaded:.0f} s, done at {time.time() - started:.0f} s; corrupting peer "
            f"banned by {banned_by}; slow node generated {final[ids['slow']]['generated']}"
        )
    finally:
        transport.close()
        pool.close()


def test_every_kind_is_a_worker_for_the_real_join():
    """The kinds other tests and training runs name (`Pool.join(name, dishonest=KIND)`)."""
    from node.worker import Worker
    from tests.adversaries import DISHONEST_WORKERS

    assert set(DISHONEST_WORKERS) == {
        *GENERATOR_CHEATS.values(),
        "wrong-version",
        "reject-all",
        "accept-all",
        "corrupt-pieces",
        "silent",
        "slow",
    }
    assert all(issubclass(cls, Worker) for cls in DISHONEST_WORKERS.values())
