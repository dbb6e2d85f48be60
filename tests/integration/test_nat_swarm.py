"""RL through a pool whose workers sit behind NAT (network namespaces, `tests.netns`).

Scheduler and trainer run on the public network with two public workers; four workers
sit in two private networks behind masquerading routers that let no connection in. The
scheduler cannot dial any of them; they open their channels to it. Asserted as a user of
the run would see it: the run trains to the end; every worker generates and verifies;
every worker loads the policies over the swarm while the trainer uploads at most twice a
version's size; a kill -9 and restart of the scheduler mid-run reconnects every node and
loses nothing (every step trains on verified rollouts only). The relay is off: NAT'd
workers get their pieces from public peers (and their own LAN).
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
import time

import pytest

from tests.netns import available, nat_lab
from tests.pools import make_pool
from tests.rl_runs import ENV, FAST_HEARTBEATS, REPO, check_finished, rl_args
from trainer.monitor import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
STEPS = 6
# Every peer's uplink is capped alike (a home uplink): then what the trainer uploads shows
# the swarm at work, instead of whoever answers fastest on a loopback-speed link.
UPLINK = str(256 * 1024)


def _steps_done(run) -> int:
    try:
        return len(read_metrics(run, "trainer"))
    except ValueError:  # a line being written
        return 0


@pytest.mark.parametrize("relay", ["relay", "no-relay"])
def test_rl_through_workers_behind_nat(tmp_path, sft_model, relay):
    """`no-relay`: the trainer relays nothing and the workers reserve nothing: NAT'd
    workers still get every policy, from the public peers they dial (and their LAN)."""
    if reason := available():
        if "root" in reason:
            pytest.skip(reason)
        pytest.fail(reason)
    with nat_lab("psnat", host_link=True) as lab:
        pool = make_pool(tmp_path, model=str(sft_model))
        pool.host, pool.scheduler_wrap = lab.pub_ip, tuple(lab.exec_prefix(lab.pub))
        try:
            pool.start_scheduler(*FAST_HEARTBEATS)
            where = {"p0": lab.pub, "p1": lab.pub}
            for k, lan in enumerate(lab.lans):
                where |= {f"n{k}a": lan, f"n{k}b": lan}
            for name, ns in where.items():
                ip = lab.pub_ip if ns == lab.pub else lab.lan_ip(ns)
                pool.join(
                    name, "--weights.peer.listen", json.dumps([f"/ip4/{ip}/tcp/0"]),
                    "--weights.peer.upload-rate", UPLINK,
                    "--weights.peer.use-relay", str(relay == "relay").lower(),
                    wrap=tuple(lab.exec_prefix(ns)), wait=False,
                )  # fmt: skip
            for name in where:
                pool.wait_joined(name)
            run = tmp_path / "run"
            args = rl_args(
                pool, sft_model, run, "--max-steps", str(STEPS), "--weights.transport", "swarm",
                "--weights.swarm.listen", json.dumps([f"/ip4/{lab.pub_ip}/tcp/0"]),
                "--weights.swarm.piece-size", str(16 * 1024),
                "--weights.swarm.upload-rate", UPLINK,
                "--weights.swarm.relay-service", str(relay == "relay").lower(),
            )  # fmt: skip
            # The trainer runs in the public namespace; this (main) thread restarts the
            # scheduler mid-run (ManagedProcess children die with the thread that started them).
            with (tmp_path / "rl.out").open("w") as so, (tmp_path / "rl.err").open("w") as se:
                trainer = lab.popen(
                    lab.pub, [sys.executable, "-m", "trainer.cli", *args],
                    cwd=REPO, env=ENV, stdout=so, stderr=se,
                )  # fmt: skip
            deadline = time.monotonic() + 600
            while _steps_done(run) < 3:
                assert trainer.poll() is None, "the run ended before the scheduler was restarted"
                assert time.monotonic() < deadline, "no third step"
                time.sleep(0.2)
            pool.scheduler.kill9()
            pool.start_scheduler()
            trainer.wait(timeout=max(1, deadline - time.monotonic()))
            out = subprocess.CompletedProcess(
                trainer.args,
                trainer.returncode,
                (tmp_path / "rl.out").read_text(),
                (tmp_path / "rl.err").read_text(),
            )
            check_finished(out, run)
            trained = read_metrics(run, "trainer")
            assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
            made = read_metrics(run, "orchestrator")
            assert not any(r.get("dropped_rejected") for r in made)
            health = pool.health()
            assert health["nodes"].get("healthy") == len(where), health  # all back after it
            relayed = sum(v.get("relayed", 0) for v in health["swarms"].values())
            assert (relayed > 0) == (relay == "relay"), health["swarms"]

            # Every worker generated and verified (the verdict log survives the restart).
            db = pool.db_url.split(":///", 1)[1]
            with sqlite3.connect(db) as conn:
                rows = conn.execute("SELECT generator_id, verifier_id FROM verdicts").fetchall()
            for name in where:
                me = pool.node_id(name)
                assert any(g == me for g, _ in rows), f"{name} generated nothing verified"
                assert any(v == me for _, v in rows), f"{name} verified nothing"

            # Every worker loaded the policies over the swarm.
            loaded = {
                name: {
                    int(v)
                    for v in re.findall(
                        r"loaded weights version (\d+)", (tmp_path / f"{name}.log").read_text()
                    )
                }
                for name in where
            }
            need = made[-1]["min_version"]
            for name, versions in loaded.items():
                assert need in versions or max(versions, default=0) >= need, (name, versions)
            uploads = [
                json.loads(line)
                for line in (run / "weights" / "seed_uploads.jsonl").read_text().splitlines()
            ]
            assert uploads, "the trainer's seed recorded no uploads"
            worst = max(u["uploaded"] / u["size"] for u in uploads)
            print(
                "\nNAT swarm:",
                json.dumps(
                    {
                        "loaded_versions": {k: sorted(v) for k, v in loaded.items()},
                        "seed_upload_over_size": [
                            round(u["uploaded"] / u["size"], 2) for u in uploads
                        ],
                        "verdicts": len(rows),
                        "swarms": health["swarms"],
                    }
                ),
            )
            assert worst <= 2.0, uploads
        finally:
            pool.close()
