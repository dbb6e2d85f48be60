"""`prime-node join` without a scheduler: the node's own checks and its caller rule.

Covers what the node decides by itself: it refuses a pool config for another pool or from
another owner (exit 2, before loading any model), a scheduler that never answers (exit 2),
and a refused registration (exit 2, the scheduler's message shown); it runs its worker
with every engine flag it was given, as `prime-node serve` does; it reads and checks
invite tokens; `NodeServer(callers=...)` takes proof-route work only from the scheduler's
key; relayed weights load only under the trainer's key and never roll back.

The only scheduler surface here is `pool_route`, a stand-in for the scheduler's one
GET /v1/pool route (an owner-signed `PoolConfig`); every other scheduler route is absent
from it, so a POST to register gets aiohttp's plain 404 (with `restarting=True` it gets
503, as from a scheduler that is restarting: the node keeps retrying, and serving).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from node.config import EngineConfig, JoinConfig
from node.join import JoinError, read_invite
from node.server import NodeServer
from node.worker import Worker
from protocol.config import ConfigError, load_config
from protocol.envelope import UntrustedSenderError, open_envelope, seal
from protocol.identity import Identity
from protocol.messages import (
    Invite,
    PoolConfig,
    Rollout,
    RolloutRequest,
    SamplingParams,
    VerifyRequest,
    WeightUpdate,
)
from protocol.processes import free_port
from tests.nodes import REPO
from tests.pools import tiny_verification

MSGPACK = {"Content-Type": "application/msgpack"}


@pytest.fixture(autouse=True)
def _no_prime_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("PRIME_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def owner() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def trainer() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def pool(trainer) -> PoolConfig:
    return PoolConfig(
        pool_id="pool-a",
        model="tiny",
        trainer_public_key=trainer.public_key,
        verification=tiny_verification(),
    )


async def _scheduler_stand_in(owner: Identity, pool: PoolConfig, restarting: bool):
    """Serve GET /v1/pool (and, if `restarting`, a 503 to every register); yield the URL."""
    signed = seal(owner, pool, ttl_s=60)

    async def get_pool(_request: web.Request) -> web.Response:
        return web.Response(body=signed, content_type="application/msgpack")

    async def restarting_register(_request: web.Request) -> web.Response:
        return web.Response(status=503, text="restarting")

    app = web.Application()
    app.router.add_get("/v1/pool", get_pool)
    if restarting:
        app.router.add_post("/v1/nodes/register", restarting_register)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


@pytest.fixture
async def pool_route(owner, pool):
    """Stand-in for the scheduler's GET /v1/pool only; yields its base URL."""
    async for url in _scheduler_stand_in(owner, pool, restarting=False):
        yield url


@pytest.fixture
async def restarting_scheduler(owner, pool):
    """`pool_route` whose register route answers 503 (a scheduler restarting)."""
    async for url in _scheduler_stand_in(owner, pool, restarting=True):
        yield url


async def spawn_join(tmp_path: Path, *args: str) -> asyncio.subprocess.Process:
    """Start `python -m node.cli join` (stdout and stderr piped)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_")}
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "node.cli",
        "join",
        "--key-file",
        str(tmp_path / "node.key"),
        "--log-dir",
        str(tmp_path / "logs"),
        *args,
        cwd=REPO,
        env={**env, "OMP_NUM_THREADS": "1"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def join_cli(tmp_path: Path, *args: str, timeout_s: float = 120) -> tuple[int, str]:
    """Run `python -m node.cli join` to its end; return its exit code and stderr."""
    proc = await spawn_join(tmp_path, *args)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode, err.decode(errors="replace")


# ------------------------------------------------------------------ join refuses


async def test_join_refuses_another_pool(tmp_path, pool_route):
    code, err = await join_cli(tmp_path, "--pool", "pool-b", "--scheduler", pool_route)
    assert code == 2, err
    assert f"the scheduler at {pool_route} serves pool 'pool-a', not 'pool-b'" in err
    assert "loading" not in err  # refused before any model was loaded
    assert (tmp_path / "logs" / "node.toml").is_file()


async def test_join_refuses_a_pool_signed_by_another_owner(tmp_path, pool_route, owner):
    other = Identity.generate().node_id
    code, err = await join_cli(
        tmp_path, "--pool", "pool-a", "--scheduler", pool_route, "--owner", other
    )
    assert code == 2, err
    assert f"is signed by {owner.node_id}, not by the owner {other}" in err


async def test_join_gives_up_on_an_unreachable_scheduler(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    code, err = await join_cli(
        tmp_path, "--pool", "pool-a", "--scheduler", url, "--startup-attempts", "2"
    )
    assert code == 2, err
    assert f"scheduler {url} unreachable after 2 attempt(s)" in err


async def test_join_shows_the_schedulers_refusal_to_register(tmp_path, pool_route, owner):
    # The stand-in has no register route: its 404 is a refusal like any other 4xx.
    code, err = await join_cli(
        tmp_path, "--pool", "pool-a", "--scheduler", pool_route, "--owner", owner.node_id
    )
    assert code == 2, err
    assert "the scheduler refused to admit this node (HTTP 404): 404: Not Found" in err


async def test_join_runs_its_worker_with_every_engine_flag(tmp_path, restarting_scheduler, owner):
    """`join` assembles its node as `serve` does (`node.assembly`): every engine flag
    reaches the worker, as the node's own /health reports while it serves and retries a
    scheduler that answers 503. (`--engine.proof-processes` used to be dropped.)"""
    port = free_port()
    proc = await spawn_join(
        tmp_path,
        "--pool", "pool-a", "--scheduler", restarting_scheduler, "--owner", owner.node_id,
        "--server.port", str(port), "--startup-attempts", "8",
        "--engine.proof-processes", "2", "--engine.max-batch-size", "3",
        "--engine.batch-wait-ms", "7", "--engine.max-model-len", "300",
    )  # fmt: skip
    health = None
    try:
        async with aiohttp.ClientSession() as http:
            deadline = asyncio.get_running_loop().time() + 120
            while health is None and proc.returncode is None:
                assert asyncio.get_running_loop().time() < deadline, "node never served /health"
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"http://127.0.0.1:{port}/health") as resp:
                        health = await resp.json()
                await asyncio.sleep(0.2)
    finally:
        if proc.returncode is None:
            proc.terminate()
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert health is not None, err.decode(errors="replace")
    assert health["worker"] == {
        "max_batch_size": 3,
        "batch_wait_ms": 7.0,
        "max_model_len": 300,
        "proof_processes": 2,
    }


# ------------------------------------------------------------------ config


def test_join_config_needs_pool_and_scheduler():
    with pytest.raises(ConfigError, match="scheduler"):
        load_config(JoinConfig, ["--pool", "p"])
    with pytest.raises(ConfigError, match="pool"):
        load_config(JoinConfig, ["--scheduler", "http://127.0.0.1:7000"])


def test_join_config_checks_urls_and_hosts():
    base = ["--pool", "p", "--scheduler", "http://127.0.0.1:7000/"]
    cfg = load_config(JoinConfig, base)
    assert cfg.scheduler == "http://127.0.0.1:7000" and cfg.server.port == 0
    with pytest.raises(ConfigError, match="must start with http"):
        load_config(JoinConfig, ["--pool", "p", "--scheduler", "127.0.0.1:7000"])
    # Nobody dials a pool node (its scheduler calls come over the channel it opens), so
    # it may listen anywhere; there is no address to advertise.
    assert load_config(JoinConfig, [*base, "--server.host", "0.0.0.0"]).server.host == "0.0.0.0"
    with pytest.raises(ConfigError, match="advertise_url"):
        load_config(JoinConfig, [*base, "--advertise-url", "http://n1:9000"])
    with pytest.raises(ConfigError, match="not an Ed25519 node id"):
        load_config(JoinConfig, [*base, "--owner", "someone"])


def test_join_engine_model_defaults_to_the_pools():
    base = ["--pool", "p", "--scheduler", "http://127.0.0.1:7000"]
    cfg = load_config(JoinConfig, [*base, "--engine.dtype", "float32"])
    assert cfg.engine.model is None
    resolved = cfg.engine.resolve("tiny")
    assert isinstance(resolved, EngineConfig) and resolved.model == "tiny"
    assert resolved.dtype == "float32"
    chosen = load_config(JoinConfig, [*base, "--engine.model", "smollm2"])
    assert chosen.engine.resolve("tiny").model == "smollm2"
    with pytest.raises(ValueError, match="neither a bundled model"):
        cfg.engine.resolve("/no/such/model")


# ------------------------------------------------------------------ invites


def _token(identity: Identity, invite: Invite, ttl_s: float = 7 * 86400) -> str:
    return base64.urlsafe_b64encode(seal(identity, invite, ttl_s)).decode().rstrip("=")


def test_invite_token_or_file(tmp_path, owner, pool):
    node = Identity.generate().node_id
    token = _token(owner, Invite(pool_id="pool-a", invite_id="inv-00001", node_id=node))
    raw = read_invite(token, pool, owner.public_key, node)
    assert open_envelope(raw, Invite, max_ttl_s=10 * 86400).message.invite_id == "inv-00001"
    f = tmp_path / "invite.txt"
    f.write_text(token + "\n")
    assert read_invite(str(f), pool, owner.public_key, node) == raw


def test_invite_refused_when_not_the_owners_or_not_for_us(owner, pool):
    node = Identity.generate().node_id
    stranger = Identity.generate()
    cases = {
        "not by the owner": _token(stranger, Invite(pool_id="pool-a", invite_id="inv-00001")),
        "for pool 'pool-z'": _token(owner, Invite(pool_id="pool-z", invite_id="inv-00001")),
        "bound to node": _token(
            owner, Invite(pool_id="pool-a", invite_id="inv-00001", node_id=stranger.node_id)
        ),
        "expired": _token(owner, Invite(pool_id="pool-a", invite_id="inv-00001"), ttl_s=-1),
        "neither a file nor a valid invite token": "no-such-file.txt",
    }
    for expected, token in cases.items():
        with pytest.raises(JoinError, match=expected):
            read_invite(token, pool, owner.public_key, node)


# ------------------------------------------------------------------ the node's callers


@pytest.fixture(scope="module")
def engine(tiny_path):
    """A tiny engine of this module's own: the weights tests change its version."""
    from node.engines.torch_engine import TorchEngine

    return TorchEngine(EngineConfig(model="tiny"))


@pytest.fixture
async def node_server(engine, trainer, pool):
    """A real NodeServer on loopback; yields (server, base URL)."""
    identity = Identity.generate()
    worker = Worker(
        engine,
        identity,
        pool.verification,
        max_batch_size=4,
        batch_wait_s=0.0,
        max_model_len=512,
        pool_id=pool.pool_id,
    )
    server = NodeServer(
        worker,
        model_name="tiny",
        trusted_keys=[trainer.node_id],
        max_body_bytes=1 << 20,
        max_concurrent=8,
        rollout_cache_size=8,
        callers=set(),
    )
    runner = web.AppRunner(server.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield server, f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


def _rollout_request(engine, request_id: str) -> RolloutRequest:
    return RolloutRequest(
        request_id=request_id,
        pool_id="pool-a",
        prompt_ids=engine.tokenizer.encode("abc", add_special_tokens=False),
        sampling=SamplingParams(max_tokens=8),
        seed=1,
    )


async def test_node_takes_work_only_from_its_callers(node_server, engine):
    server, url = node_server
    scheduler, stranger = Identity.generate(), Identity.generate()
    async with aiohttp.ClientSession() as http:

        async def post(route: str, identity: Identity, message) -> tuple[int, bytes]:
            body = seal(identity, message)
            async with http.post(f"{url}{route}", data=body, headers=MSGPACK) as resp:
                return resp.status, await resp.read()

        # Before registration (callers = empty set) nobody may send work.
        status, body = await post("/v1/rollouts", scheduler, _rollout_request(engine, "r0"))
        assert status == 403, body
        server.callers = {scheduler.public_key}
        status, body = await post("/v1/rollouts", stranger, _rollout_request(engine, "r1"))
        assert status == 403 and b"is not trusted for RolloutRequest" in body
        status, body = await post("/v1/rollouts", scheduler, _rollout_request(engine, "r2"))
        assert status == 200, body
        rollout = open_envelope(body, Rollout).message
        assert rollout.request_id == "r2" and rollout.node_id == server.worker.node_id
        verify = VerifyRequest(rollout_envelope=body)
        status, body = await post("/v1/verify", stranger, verify)
        assert status == 403 and b"is not trusted for VerifyRequest" in body
        # The OpenAI-compatible surface is not signed: the caller rule does not apply to it.
        async with http.get(f"{url}/health") as resp:
            assert resp.status == 200
    assert server.in_flight == 0 and server.worker.outstanding_tokens == 0


async def test_relayed_weights_need_the_trainer_and_never_roll_back(
    node_server, engine, trainer, tiny_path
):
    server, _ = node_server
    base_hash = engine.weights_hash
    v1 = WeightUpdate(version=1, path=str(tiny_path))
    with pytest.raises(UntrustedSenderError):
        await server.load_relayed_weights(seal(Identity.generate(), v1))
    assert engine.weights_version == 0
    # Relayed long after the trainer signed it: expired, yet its signature still counts.
    assert await server.load_relayed_weights(seal(trainer, v1, ttl_s=-600))
    assert (engine.weights_version, engine.weights_hash) == (1, base_hash)
    assert not await server.load_relayed_weights(seal(trainer, v1))
    v0 = WeightUpdate(version=0, path=str(tiny_path))
    assert not await server.load_relayed_weights(seal(trainer, v0))
    assert engine.weights_version == 1


async def test_join_refuses_to_generate_with_an_engine_mix_the_pool_never_calibrated(
    tmp_path, pool_route, owner
):
    """The pool's thresholds hold for torch/float32/cpu: a bf16 node would be judged by
    thresholds that are wrong for it, so it refuses before registering, and says why."""
    code, err = await join_cli(
        tmp_path,
        "--pool", "pool-a", "--scheduler", pool_route, "--owner", owner.node_id,
        "--engine.dtype", "bfloat16",
    )  # fmt: skip
    assert code == 2, err
    assert "calibrated for torch/float32/cpu" in err and "torch/bfloat16/cpu" in err
