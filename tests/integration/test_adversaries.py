"""Dishonest nodes (tests/adversaries.py, each a whole `prime-node join` process with one
cheat) in a real pool on loopback, next to honest tiny-model workers; what must hold:

- every generator cheat and every lying verifier ends banned by the scheduler, and no
  rollout it generated is released as accepted;
- a node whose weight-swarm peer serves corrupted pieces is banned by its peers, who
  still load the published weights;
- a node that never answers is timed out and benched, its work done by others (the
  OpenAI endpoint retries another node); an honest straggler is never punished;
- no honest node is banned, and every request gets exactly one result;
- a node that lies in what a client reads (prompt ids, completion text, logprobs, finish
  reason: the fields the old OpenAI path took from a worker's JSON unchecked) and signs
  those lies is caught by the one check its lie is built to meet, banned, and never
  answers a client: every answer of the scheduler's OpenAI endpoint (official `openai`
  client) is the signed rollout that the results stream releases, from an honest node.

Pool runs (each node process costs seconds of CPU to start): one with every generator and
verifier cheat and audits on; one where the trainer publishes a new version over the
swarm, with the wrong-version, corrupt-pieces, silent and slow nodes; one per liar in what
clients read (`lying-json`, `other-prompt`, `truncating`) among honest nodes. An
in-process test first proves that every rollout those liars sign is a lie.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import sqlite3
import time
from collections import Counter
from typing import Any

import httpx
import pytest

from protocol.envelope import open_envelope
from protocol.messages import (
    ReputationPolicy,
    Rollout,
    RolloutRequest,
    RolloutResult,
    RolloutSpec,
    SamplingParams,
    Verdict,
    VerifyRequest,
)
from protocol.openai import completion_text
from protocol.tokenizer import ChatTokenizer
from tests.pools import Pool, collect, make_pool, tiny_verification
from verifier.models import resolve_model

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
    headers = {"Authorization": f"Bearer {pool.api_key()}"}
    async with httpx.AsyncClient(timeout=120, headers=headers) as http:

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


async def test_generator_and_verifier_cheats_are_banned_with_audits(tmp_path, monkeypatch):
    """All generator cheats (one operator, "mallory"), a verifier that accepts everything
    and one that rejects everything, three honest nodes; audit_rate 1.0."""
    # Weight noise of 2e-3 x std (the kind's default) passes on some of the tiny model's
    # short answers (seen: one accepted rollout here; 9 of 16 in the fault tests), which
    # this test's "nothing of a cheat accepted" cannot allow; 2e-2 is a cheat the checks
    # must catch on every rollout (the fault test of every kind uses it too).
    monkeypatch.setenv("PRIME_PERTURB_SCALE", "2e-2")
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
        # Every request, an OpenAI call's too, is generated again until an honest node's
        # rollout is accepted.
        assert all(r.status == "accepted" for r in results)
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
    from trainer.config import WeightsConfig
    from trainer.weights import SwarmTransport
    from verifier.models import load_tokenizer, resolve_model

    kib = 1024
    cap = ["--weights.peer.upload_rate", str(128 * kib)]
    pool = make_pool(tmp_path / "pool")
    transport = SwarmTransport(
        tmp_path / "run",
        WeightsConfig(
            transport="swarm",
            keep_last=2,
            swarm=SwarmConfig(upload_rate=128 * kib, piece_size=16 * kib),
            trainer_key=pool.workdir / "trainer.key",
        ),
    )
    started = time.time()
    try:
        pool.start_scheduler(
            *FAST_LIFECYCLE,
            "--lifecycle.swarm_announce_interval_s",
            "2",
            "--dispatch.generate_timeout_s",
            "8",
            # An OpenAI call outlasts one silent generator: it is generated again elsewhere.
            "--dispatch.openai_timeout_s",
            "60",
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
        assert all(r.status == "accepted" for r in results)
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
        assert re.search(r"re-dispatching oa-\w+: silent did not answer", log), "no call hit silent"
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


# -- liars in what a client reads ---------------------------------------------------------
# Kind -> (what the scheduler's request check must find in its signed rollouts, the
# verifier checks that must reject the rest, nothing else): each lie is built to meet
# exactly one check (tests/adversaries.py recomputes everything else cheaply).
LIARS: dict[str, tuple[set[str], set[str]]] = {
    "lying-json": ({"prompt"}, {"logprobs", "sampling"}),
    "other-prompt": ({"prompt"}, {"sampling"}),
    "truncating": ({"sampling"}, {"termination"}),
}
LIAR_VARIANTS = {"lying-json": 3, "other-prompt": 2, "truncating": 3}
CHEATED = "signed a rollout that contradicts its request: "
LOST = "lost a dispute: its rollout was rejected by two verifiers"


async def test_every_rollout_of_a_liar_is_a_lie_caught_by_its_one_check(tiny_engine):
    """In-process, on the tiny model: for the same requests, every rollout each liar signs
    differs from the honest node's, and an honest verifier given the request rejects it
    by exactly the check its variant is built to meet (a lie about the request is caught
    by the request check, the scheduler's own in a pool, whatever else fails with it)."""
    from node.worker import Worker
    from protocol.identity import Identity
    from tests.adversaries import DISHONEST_WORKERS

    policy = tiny_verification()

    def worker(cls) -> Worker:
        return cls(
            tiny_engine, Identity.generate(), policy, max_batch_size=8, batch_wait_s=0.01,
            max_model_len=4096,
        )  # fmt: skip

    tok = ChatTokenizer(resolve_model("tiny"))
    honest, verifier = worker(Worker), worker(Worker)
    liars = {kind: worker(DISHONEST_WORKERS[kind]) for kind in LIARS}
    expected = {
        "lying-json": [{"logprobs"}, {"request"}, {"sampling"}],
        "other-prompt": [{"request"}, {"sampling"}],
        "truncating": [{"request"}, {"termination"}, {"termination"}],
    }
    for w in (honest, verifier, *liars.values()):
        w.start()
    rng = random.Random(7)
    caught: Counter = Counter()
    try:
        for kind, liar in liars.items():
            for i in range(4 * LIAR_VARIANTS[kind]):
                text = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(4, 30)))
                req = RolloutRequest(
                    request_id=f"{kind}-{i}",
                    prompt_ids=tok.chat_ids([{"role": "user", "content": text}]),
                    sampling=SamplingParams(max_tokens=16),
                    seed=rng.randrange(2**62),
                    proof=policy.proof,
                )
                truth = (await honest.generate(req)).rollout
                lie = await liar.generate(req)
                assert lie.rollout != truth, (kind, i)
                verdict, _ = await verifier.verify(
                    VerifyRequest(rollout_envelope=lie.envelope, request=req)
                )
                failed = {c.name for c in verdict.checks if not c.passed}
                variant = i % LIAR_VARIANTS[kind]
                want = expected[kind][variant]
                if want == {"request"}:  # the scheduler's check runs first; the rest may fail too
                    assert "request" in failed, (kind, variant, verdict.reasons)
                    failed = want
                assert failed == want, (kind, variant, verdict.reasons)
                caught[f"{kind}/{'ABC'[variant]}: {','.join(sorted(failed))}"] += 1
    finally:
        for w in (honest, verifier, *liars.values()):
            await w.stop()
    print(f"\nliars in-process: {dict(sorted(caught.items()))}")


def _openai_call(client, i: int) -> tuple[dict[str, Any], Any]:
    """One call of the official client, in turn: token-id prompt, text prompt (with
    logprobs), chat (with logprobs), chat with n=2. Returns what was asked and the answer."""
    kind = i % 4
    if kind == 0:
        ask = {"kind": "completion", "prompt": [6 + i % 30, 12, 8 + i % 7], "logprobs": False}
        answer = client.completions.create(model="tiny", prompt=ask["prompt"], max_tokens=16)
    elif kind == 1:
        ask = {"kind": "completion", "prompt": f"hello {i}", "logprobs": True}
        answer = client.completions.create(
            model="tiny", prompt=ask["prompt"], max_tokens=16, logprobs=0
        )
    else:
        messages = [{"role": "user", "content": f"reverse this: abc{i}"}]
        ask = {"kind": "chat", "messages": messages, "logprobs": True}
        answer = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=16, logprobs=True, n=kind - 1
        )
    return ask, answer


def check_answer(
    ask: dict[str, Any], answer, released: dict[str, RolloutResult], tok: ChatTokenizer, liar: str
) -> int:
    """Every choice of `answer` is the accepted signed rollout the results stream released
    under its rollout id (prompt ids as the client asked, token ids, text decoded on the
    trusted side, finish reason, logprobs), generated by an honest node. Returns the
    number of choices."""
    extra = answer.model_extra
    if ask["kind"] == "chat":
        prompt = tok.chat_ids(ask["messages"])
    else:
        p = ask["prompt"]
        prompt = p if isinstance(p, list) else tok.encode(p)
    assert extra["prompt_token_ids"] == prompt
    for choice in answer.choices:
        rid = choice.model_extra["rollout_id"]
        result = released[rid]
        assert (result.source, result.status) == ("openai", "accepted"), (rid, result.detail)
        opened = open_envelope(result.rollout_envelope, Rollout, check_expiry=False)
        signed = opened.message
        assert opened.sender_id != liar, f"{rid} answered from the liar's rollout"
        assert signed.prompt_ids == prompt
        assert choice.model_extra["token_ids"] == signed.completion_ids
        assert choice.finish_reason == signed.finish_reason
        if ask["kind"] == "chat":
            assert choice.message.content == completion_text(signed, tok.decode)
            assert [t.logprob for t in choice.logprobs.content] == signed.logprobs
        else:
            assert choice.text == completion_text(signed, tok.decode)
            if ask["logprobs"]:
                assert choice.logprobs.token_logprobs == signed.logprobs
    return len(answer.choices)


def scheduler_messages(pool: Pool) -> list[str]:
    lines = (pool.workdir / "scheduler.log").read_text().splitlines()
    return [json.loads(line)["msg"] for line in lines if line.startswith("{")]


@pytest.mark.parametrize("kind", sorted(LIARS))
async def test_a_liar_in_what_clients_read_is_banned_and_never_answers_them(tmp_path, kind):
    """Three honest nodes and one liar (tests/adversaries.py: `lying-json`,
    `other-prompt` or `truncating`); OpenAI calls through the scheduler's endpoint with
    the official client (completions and chat, logprobs, n=2) while the orchestrator's
    client submits requests. Every answer is its released signed rollout, from an honest
    node; nothing of the liar's is accepted; each of its lies was caught by the check it
    meets (scheduler's request check or the verifiers' named checks, nothing else); it is
    banned for one of them. A penalty of 0.15 per lie (its honest verdicts earn 0.02
    each meanwhile) keeps it in the pool for six lies or more, so every variant is met."""
    cheated_fields, failed_checks = LIARS[kind]
    pool = make_pool(tmp_path, reputation=ReputationPolicy(penalty_lost_dispute=0.15))
    started = time.time()
    try:
        pool.start_scheduler(*FAST_LIFECYCLE)
        honest = ["h0", "h1", "h2"]
        for name in honest:
            pool.join(name, wait=False)
        pool.join("liar", wait=False, dishonest=kind)
        for name in (*honest, "liar"):
            pool.wait_joined(name)
        liar = pool.node_id("liar")
        # The liar's own OpenAI routes are closed in a pool: clients reach only the front.
        node_url = pool.nodes["liar"].health_url.removesuffix("/health")
        direct = httpx.post(f"{node_url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 4})
        assert direct.status_code == 403, direct.text

        tok = ChatTokenizer(resolve_model("tiny"))
        oai = pool.openai(max_retries=60, timeout=120)
        async with pool.client() as client:
            # OpenAI calls first, so that some are given to the liar before its ban.
            calls = [asyncio.to_thread(_openai_call, oai, i) for i in range(16)]
            answered = asyncio.gather(*calls)
            await asyncio.sleep(1.0)
            await client.submit(specs(100, "r"))
            answers = await answered
            n_choices = sum(len(a.choices) for _, a in answers)
            results = await collect(client, 100 + n_choices, 300)
            expected = {f"r{i}" for i in range(100)}
            # Between its lies the liar verifies honestly and earns reputation back, so how
            # many lies its ban takes depends on timing: more work until it is banned.
            for extra in range(10):
                if states(pool)[liar]["state"] == "banned":
                    break
                await client.submit(specs(40, f"more{extra}-"))
                expected |= {f"more{extra}-{i}" for i in range(40)}
                results += await collect(client, 40, 300, after=max(r.seq for r in results))
        oai.close()
        released = {r.request_id: r for r in results}
        oa_ids = {c.model_extra["rollout_id"] for _, a in answers for c in a.choices}
        check_results(pool, results, expected | oa_ids, {liar})
        assert all(r.status == "accepted" for r in results)
        assert sum(check_answer(ask, a, released, tok, liar) for ask, a in answers) == n_choices

        wait_banned(pool, {liar}, 30)
        final = states(pool)
        assert final[liar]["state"] == "banned", final[liar]
        for name in honest:
            assert final[pool.node_id(name)]["state"] == "healthy", (name, final)
        # What caught each lie: the scheduler's request check (no verifier ran) ...
        messages = scheduler_messages(pool)
        cheated = Counter(
            m.split(CHEATED, 1)[1] for m in messages if m.startswith("liar loses") and CHEATED in m
        )
        assert set(cheated) == cheated_fields, cheated
        # ... or the honest verifiers, each rejection naming only the checks it meets.
        # (rollouts rejected per check: a dispute makes two verdicts of one rollout)
        rejected = Counter(
            check
            for checks in {
                envelope: {reason.split(":", 1)[0] for reason in reasons.split("; ")}
                for envelope, reasons in sql(
                    pool,
                    "SELECT rollout_envelope, reasons FROM verdicts"
                    " WHERE generator_id = ? AND NOT accepted",
                    liar,
                )
            }.values()
            for check in checks
        )
        assert set(rejected) == failed_checks, rejected
        (accepted_verdicts,) = sql(
            pool, "SELECT count(*) FROM verdicts WHERE generator_id = ? AND accepted", liar
        )[0]
        assert accepted_verdicts == 0
        reason = ban_reason(pool, liar)
        assert reason in {CHEATED + f for f in cheated_fields} | {LOST}, reason
        # Some OpenAI calls were given to the liar first, and answered from another node.
        liar_calls = {
            m.split()[1].rstrip(":")
            for m in messages
            if m.startswith("re-dispatching oa-") and "liar" in m
        }
        assert liar_calls, "no OpenAI call was given to the liar"
        assert liar_calls <= oa_ids
        print(
            f"\n{kind}: done in {time.time() - started:.0f} s; caught by the scheduler "
            f"{dict(cheated)}, by verifiers {dict(rejected)}; {len(liar_calls)} OpenAI calls "
            f"given to it first; banned: {reason}"
        )
        assert pool.nodes["liar"].proc.wait(30) == 3
    finally:
        pool.close()


def test_every_kind_is_a_worker_for_the_real_join():
    """The kinds other tests and training runs name (`Pool.join(name, dishonest=KIND)`)."""
    from node.worker import Worker
    from tests.adversaries import CHEAPER_COMPUTE, DISHONEST_WORKERS, LAUNDER

    assert set(DISHONEST_WORKERS) == {
        *GENERATOR_CHEATS.values(),
        "wrong-version",
        *LIARS,
        *CHEAPER_COMPUTE,
        *LAUNDER,
        "turncoat-launder",
        "forged-tool-call",
        "reject-all",
        "accept-all",
        "corrupt-pieces",
        "silent",
        "slow",
        "sybil",
        "turncoat",
        "accomplice",
    }
    assert all(issubclass(cls, Worker) for cls in DISHONEST_WORKERS.values())
