"""Delta versions over a real pool: the trainer publishes step n as the elements it changed
against step n-1; workers holding n-1 fetch only that, rebuild n, check it against n's
signed full manifest, load it and seed it in full; a late joiner gets the newest full
version from those peers without a byte from the trainer; a forged delta manifest sends a
worker to the full version; a worker that corrupts the pieces it serves is banned by its
peers and changes nothing.

Real processes on loopback: `prime-scheduler serve` and `prime-node join` workers on the
tiny model; the trainer side is the real `SwarmTransport` (bf16, deltas on).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from protocol.messages import Manifest
from protocol.swarm.config import SwarmConfig
from protocol.swarm.manifest import sign_manifest
from tests.pools import make_pool
from trainer.config import WeightsConfig
from trainer.weights import DELTA_DIR, MARKER, SwarmTransport
from verifier.models import load_tokenizer, resolve_model

KiB = 1024
RATE = 256 * KiB
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def files_digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MARKER and not p.name.startswith(".")
    }


def wait_versions(pool, expected: dict[str, int], timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if pool.health()["healthy_versions"] == expected:
            return
        time.sleep(0.3)
    raise TimeoutError(f"healthy versions {pool.health()['healthy_versions']} != {expected}")


async def _publish(pool, update) -> None:
    async with pool.client() as client:
        await client.publish_weights(update)


def test_workers_rebuild_each_step_from_its_delta(tmp_path: Path) -> None:
    pool = make_pool(tmp_path / "pool")
    cap = ["--weights.peer.upload_rate", str(RATE)]
    transport = SwarmTransport(
        tmp_path / "run",
        WeightsConfig(
            transport="swarm",
            keep_last=5,
            dtype="bfloat16",
            swarm=SwarmConfig(upload_rate=RATE, piece_size=16 * KiB),
            trainer_key=pool.workdir / "trainer.key",
        ),
    )
    tiny = resolve_model("tiny")
    hf_config, tokenizer = AutoConfig.from_pretrained(tiny), load_tokenizer(tiny)
    master = load_file(tiny / "model.safetensors")  # fp32 "master weights"
    gen = torch.Generator().manual_seed(1)

    def train_step(n: int, lr: float) -> None:
        for k, v in master.items():  # an RL-sized move of every fp32 value
            master[k] = v + lr * torch.randn(v.shape, generator=gen)
        transport.save(n, master, hf_config, tokenizer)

    try:
        pool.start_scheduler("--lifecycle.swarm_announce_interval_s", "2")
        names = ["w0", "w1", "w2"]
        for name in names:
            pool.join(name, *cap, wait=False)
        pool.join("bad", *cap, wait=False, dishonest="corrupt-pieces")
        for name in [*names, "bad"]:
            pool.wait_joined(name)
        everyone = len(names) + 1

        train_step(1, 0.0)  # step 1: the tiny model in bf16 (no base: full only)
        asyncio.run(_publish(pool, transport.update(1)))
        wait_versions(pool, {"1": everyone}, 120)
        sizes = {}
        for n in (2, 3):
            train_step(n, 1e-5)
            update = transport.update(n)
            assert len(update.deltas) == n - 1, "an unbroken chain of deltas since step 1"
            asyncio.run(_publish(pool, update))
            wait_versions(pool, {str(n): everyone}, 120)
            full = transport.host.status(update.weights_hash)
            delta = next(
                s for s in transport.host.statuses() if s.folder.endswith(f"step_{n}/{DELTA_DIR}")
            )
            sizes[n] = (delta.total, full.total, full.uploaded, delta.uploaded)
            # Nobody asked the trainer for the full version: every worker took the delta.
            assert full.uploaded == 0, sizes
        reference = files_digest(transport.folder(3))
        for name in names:
            (folder,) = (pool.workdir / "weights" / pool.node_id(name)).glob("step_3_*")
            assert files_digest(folder) == reference, name  # byte for byte
            log = (pool.workdir / f"{name}.log").read_text()
            assert len(re.findall(r"step [23] fetched through deltas", log)) == 2, name

        # A late joiner has no base: it fetches the newest full version from the peers
        # that rebuilt it, without a byte from the trainer.
        pool.join("late", *cap)
        wait_versions(pool, {"3": everyone + 1}, 120)
        (folder,) = (pool.workdir / "weights" / pool.node_id("late")).glob("step_3_*")
        assert files_digest(folder) == reference
        full3 = transport.host.status(transport.update(3).weights_hash)
        late = full3.per_peer.get(pool.node_id("late"))
        assert late is None or late.uploaded == 0, "the trainer served the late joiner"

        # A forged delta manifest (a stranger's signature) inside a trainer-signed update:
        # the worker refuses the delta and takes step 4 in full, still byte for byte.
        train_step(4, 1e-5)
        update = transport.update(4)
        honest = open_envelope(update.deltas[-1], Manifest, check_expiry=False).message
        forged = update.model_copy(update={"deltas": [sign_manifest(Identity.generate(), honest)]})
        node_url = pool.nodes["w0"].health_url.removesuffix("/health")
        resp = httpx.post(
            f"{node_url}/v1/weights/update",
            content=seal(pool.trainer, forged),
            headers={"Content-Type": "application/msgpack"},
            timeout=120,
        )
        assert resp.status_code == 200, resp.text
        deadline = time.time() + 120
        while httpx.get(f"{node_url}/health").json()["weights_version"] != 4:
            assert time.time() < deadline, "w0 never loaded step 4"
            time.sleep(0.3)
        log = (pool.workdir / "w0.log").read_text()
        assert "deltas of step 4 refused" in log and "step 4 fetched in full" in log
        (folder,) = (pool.workdir / "weights" / pool.node_id("w0")).glob("step_4_*")
        assert files_digest(folder) == files_digest(transport.folder(4))
        published = [
            json.loads(line)
            for line in (transport.root / "published.jsonl").read_text().splitlines()
        ]
        print(
            "\ndelta/full bytes per step:",
            {n: round(d / f, 4) for n, (d, f, _, _) in sizes.items()},
            "published:",
            published,
        )
        for d, f, _, _ in sizes.values():
            assert d < 0.5 * f
    finally:
        transport.close()
        pool.close()
