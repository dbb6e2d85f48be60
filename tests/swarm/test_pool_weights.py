"""A trainer and 8 capped workers of a real pool: the trainer publishes a new policy over
the swarm; every worker fetches it from the others, checks it, hot-swaps it into its
engine and reports it; a ninth worker joining late catches up from the peers alone.

Real processes on loopback: `prime-scheduler serve` (also the swarm tracker) and
`prime-node join` workers on the tiny model; the trainer side is the real
`SwarmTransport` with the pool's trainer key, published through the scheduler as the
orchestrator does.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import aiohttp
import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from protocol.client import RemoteError
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import SwarmAnnounce, WeightUpdate
from protocol.swarm.config import SwarmConfig
from protocol.swarm.manifest import sign_manifest
from protocol.swarm.tracker import TrackerClient
from tests.pools import make_pool
from trainer.config import WeightsConfig
from trainer.weights import MARKER, SwarmTransport
from verifier.models import load_tokenizer, resolve_model

KiB = 1024
RATE = 256 * KiB  # every node's upload cap (a slow home uplink, scaled to the tiny model)


def files_digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MARKER
    }


def wait_versions(pool, expected: dict[str, int], timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if pool.health()["healthy_versions"] == expected:
            return
        time.sleep(0.5)
    raise TimeoutError(f"healthy versions {pool.health()['healthy_versions']} != {expected}")


@pytest.mark.slow
def test_eight_capped_workers_fetch_check_and_load_a_new_policy(tmp_path: Path) -> None:
    pool = make_pool(tmp_path / "pool")
    cap = ["--weights.peer.upload_rate", str(RATE)]
    transport = SwarmTransport(
        tmp_path / "run",
        WeightsConfig(
            transport="swarm",
            keep_last=3,
            swarm=SwarmConfig(upload_rate=RATE, piece_size=64 * KiB),
            trainer_key=pool.workdir / "trainer.key",
        ),
    )
    try:
        pool.start_scheduler("--lifecycle.swarm_announce_interval_s", "2")
        names = [f"w{i}" for i in range(8)]
        for name in names:
            pool.join(name, *cap, wait=False)
        for name in names:
            pool.wait_joined(name)

        # Step 1 of "training": the tiny model, perturbed.
        tiny = resolve_model("tiny")
        state = load_file(tiny / "model.safetensors")
        gen = torch.Generator().manual_seed(1)
        state = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
        transport.save(1, state, AutoConfig.from_pretrained(tiny), load_tokenizer(tiny))
        update = transport.update(1)
        size = sum(p.stat().st_size for p in transport.folder(1).iterdir() if p.name != MARKER)

        started = time.time()
        asyncio.run(_publish(pool, update))
        wait_versions(pool, {"1": 8}, timeout_s=120)
        elapsed = time.time() - started

        # Every worker holds byte-identical files under the signed manifest and serves them.
        reference = files_digest(transport.folder(1))
        for name in names:
            node_id = pool.node_id(name)
            (folder,) = (pool.workdir / "weights" / node_id).glob("step_1_*")
            assert files_digest(folder) == reference, name
        for name in names:
            held = httpx.get(pool.nodes[name].health_url).json()
            assert (held["weights_version"], held["weights_hash"]) == (1, update.weights_hash)

        # The tracker saw every worker finish; a stranger may not use it.
        assert pool.health()["swarms"][update.weights_hash[:12]]["seeds"] == 8
        with pytest.raises(RemoteError) as refused:
            asyncio.run(_announce_as_stranger(pool.url, update.weights_hash))
        assert refused.value.status == 404

        seed = transport.host.status(update.weights_hash)
        trainer_upload = seed.uploaded / size
        # A star would upload 8 copies; the swarm needs about one and a bit.
        assert trainer_upload < 3.0, trainer_upload

        # A forged manifest (right content, wrong signer) inside a trainer-signed update is
        # refused by a worker, which keeps serving what it has.
        forged = update.model_copy(
            update={
                "version": 2,
                "manifest": sign_manifest(Identity.generate(), _manifest(update)),
            }
        )
        node_url = pool.nodes["w0"].health_url.removesuffix("/health")
        resp = httpx.post(
            f"{node_url}/v1/weights/update",
            content=seal(pool.trainer, forged),
            headers={"Content-Type": "application/msgpack"},
        )
        assert resp.status_code == 400 and "not trusted" in resp.text
        assert httpx.get(f"{node_url}/health").json()["weights_version"] == 1

        # A ninth worker joins late: the tracker names complete peers, the trainer is spared.
        pool.join("late", *cap)
        wait_versions(pool, {"1": 9}, timeout_s=90)
        late = transport.host.status(update.weights_hash).per_peer.get(pool.node_id("late"))
        assert late is None or late.uploaded == 0
        (folder,) = (pool.workdir / "weights" / pool.node_id("late")).glob("step_1_*")
        assert files_digest(folder) == reference
        print(
            f"8 workers at {RATE // KiB} KiB/s loaded {size / KiB:.0f} KiB in {elapsed:.1f} s "
            f"(S/B = {size / RATE:.1f} s); trainer uploaded {trainer_upload:.2f} x S"
        )
    finally:
        transport.close()
        pool.close()


async def _publish(pool, update: WeightUpdate) -> None:
    async with pool.client() as client:
        await client.publish_weights(update)


async def _announce_as_stranger(url: str, digest: str) -> None:
    async with aiohttp.ClientSession() as session:
        tracker = TrackerClient(session, lambda: url, Identity.generate())
        await tracker.announce(SwarmAnnounce(manifest_hash=digest))


def _manifest(update: WeightUpdate):
    from protocol.envelope import open_envelope
    from protocol.messages import Manifest

    return open_envelope(update.manifest, Manifest, check_expiry=False).message
