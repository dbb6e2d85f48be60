"""Sybil attacks on an open pool, run for real (issue 26; DESIGN.md section 10): a
scheduler and `prime-node join` workers on loopback, the tiny model, three honest workers
that are the owner's founders (`CheckerPolicy`: a newcomer checks once four of its
rollouts were accepted) and `k` free identities playing one strategy:

- `reject-all`: k identities that never answer a generation and reject everything they
  are asked to check (`tests.adversaries.SybilWorker`);
- `accept-all`: a cheating generator (`other-weights`) and k identities that generate
  honestly and accept everything they check, to vouch for it;
- `side-with-cheat`: a cheating generator and k identities that check honestly except that
  they accept every rollout of the cheat (`accomplice`: judges on its side);
- `turncoat`: k identities that generate and check honestly until they could earn the
  right to check, then reject everything (`turncoat`);
- `none`: the three honest workers alone (the baseline the throughput is compared with).

`run_attack` submits `requests` rollout requests through the trainer's route, collects the
results and returns what the fault audit needs: honest reputation losses and bans, cheat
rollouts released (what the trainer would train on), the attackers' verdicts and bans,
accepted rollouts per minute. Used by tests/swarm/test_sybils.py (what must hold) and
tests/bench/bench_sybils.py (the k x strategy table).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

from protocol.identity import Identity
from protocol.messages import CheckerPolicy, RolloutSpec, SamplingParams
from tests.pools import FAST_LIFECYCLE, collect, make_pool

HONEST = ("h0", "h1", "h2")
CHEAT = "cheat"
STRATEGIES = ("reject-all", "accept-all", "side-with-cheat", "turncoat")
KIND = {
    "reject-all": "sybil",
    "accept-all": "accept-all",
    "side-with-cheat": "accomplice",
    "turncoat": "turncoat",
}
WITH_CHEAT = {"accept-all", "side-with-cheat"}
EARN_AFTER = 4


def run_attack(
    workdir: Path, strategy: str, k: int, requests: int = 240, earned: bool = True
) -> dict:
    """One run (see the module docstring); `earned` False: every admitted node checks at
    once (the control)."""
    sybils = [] if strategy == "none" else [f"s{i}" for i in range(k)]
    attackers = [*sybils, *([CHEAT] if strategy in WITH_CHEAT else [])]
    founders = [Identity.load_or_create(workdir / f"{n}.key").node_id for n in HONEST]
    checkers = CheckerPolicy(earn_after=EARN_AFTER, founders=founders) if earned else None
    pool = make_pool(workdir, checkers=checkers)
    try:
        pool.start_scheduler(*FAST_LIFECYCLE, "--dispatch.generate-timeout-s", "5")
        kinds = dict.fromkeys(sybils, KIND.get(strategy, ""))
        if CHEAT in attackers:
            kinds[CHEAT] = "other-weights"
        env = {"PRIME_ACCOMPLICES": pool.node_id(CHEAT), "PRIME_TURN_AFTER": "6"}
        pool.join_many([*HONEST, *attackers], env=env, **kinds)
        sampling = SamplingParams(max_tokens=8)
        specs = [
            RolloutSpec(request_id=f"r{i}", prompt_ids=[5, 6 + i % 40], sampling=sampling)
            for i in range(requests)
        ]

        async def run() -> tuple[list, float]:
            async with pool.client() as client:
                t0 = time.monotonic()
                await client.submit(specs)
                # A pool the attack took down stalls: a minute shows it.
                results = await collect(client, requests, 240 if earned else 60)
                return results, time.monotonic() - t0

        results, seconds = asyncio.run(run())
        ids = {name: pool.node_id(name) for name in (*HONEST, *attackers)}
        with sqlite3.connect(pool.workdir / "scheduler.db") as db:
            checked_by = dict(
                db.execute("SELECT verifier_id, count(*) FROM verdicts GROUP BY verifier_id")
            )
            released_by = dict(
                db.execute(
                    "SELECT generator_id, count(*) FROM results WHERE status = 'accepted' "
                    "GROUP BY generator_id"
                )
            )
        log = (pool.workdir / "scheduler.log").read_text(errors="replace")
        states = {n: pool.node_state(ids[n]) for n in (*HONEST, *attackers)}
        accepted = [r for r in results if r.status == "accepted"]
        return {
            "strategy": strategy,
            "k": len(sybils),
            "rights": "earned" if earned else "at-once",
            "requests": requests,
            "accepted": len(accepted),
            "results": len(results),
            "seconds": round(seconds, 1),
            "accepted_per_min": round(60 * len(accepted) / seconds, 1),
            "honest_penalised": sum(log.count(f"{h} loses reputation") for h in HONEST),
            "honest_banned": sum(states[h] == "banned" for h in HONEST),
            "cheat_released": released_by.get(ids.get(CHEAT, ""), 0),
            "attackers_banned": sum(states[a] == "banned" for a in attackers),
            "attacker_verdicts": sum(checked_by.get(ids[a], 0) for a in attackers),
            "honest_verdicts": sum(checked_by.get(ids[h], 0) for h in HONEST),
            "released_from_attackers": sum(released_by.get(ids[a], 0) for a in attackers),
            "states": states,
            "details": sorted({r.detail for r in results if r.status != "accepted"})[:5],
        }
    finally:
        pool.close()
