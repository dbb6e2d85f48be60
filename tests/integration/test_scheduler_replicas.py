"""Two scheduler replicas on one PostgreSQL database: one active, one on standby; the
active one is killed with SIGKILL and the standby takes over. Nodes and the orchestrator
list both replicas; nothing is lost or delivered twice."""

from __future__ import annotations

import time

import httpx
import pytest

from protocol.processes import free_port
from tests.integration.test_scheduler_pool import check_delivered_once_and_verified, specs
from tests.pools import collect, make_pool, postgres_database

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPLICA = ("--replica.lease-s", "3")


async def test_standby_replica_takes_over_when_the_active_one_is_killed(tmp_path):
    async with postgres_database() as url:
        await check_takeover(tmp_path, url)


async def check_takeover(tmp_path, url: str) -> None:
    pool = make_pool(tmp_path, db_url=url)
    try:
        pool.start_scheduler(*REPLICA)
        standby_port = free_port()
        pool.start_scheduler(*REPLICA, log_name="standby", port=standby_port)
        standby = f"http://127.0.0.1:{standby_port}"
        assert httpx.get(f"{standby}/health").json()["status"] == "standby"
        refused = httpx.post(f"{standby}/v1/rollouts/results", content=b"x")
        assert refused.status_code == 503 and "standby" in refused.json()["error"]["message"]
        assert pool.health()["status"] == "ok"

        pool.join_many(["w0", "w1", "w2"])
        ids = {f"r{i}" for i in range(150)}
        async with pool.client() as client:
            await client.submit(specs(150, max_tokens=24))
            first = await collect(client, 30, 120)
            pool.scheduler.kill9()
            t_kill = time.time()
            rest = await collect(client, 150 - len(first), 300, after=first[-1].seq)
            took_over_s = time.time() - t_kill
        check_delivered_once_and_verified(first + rest, ids)
        health = httpx.get(f"{standby}/health").json()
        assert health["status"] == "ok"
        # The nodes moved to the new active replica (their next heartbeat reaches it).
        deadline = time.time() + 30
        while httpx.get(f"{standby}/health").json()["nodes"] != {"healthy": 3}:
            assert time.time() < deadline, httpx.get(f"{standby}/health").json()
            time.sleep(0.5)
        print(f"\nstandby took over and finished the run {took_over_s:.1f} s after the kill")
    finally:
        pool.close()
