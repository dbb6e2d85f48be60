"""`prime-node doctor`: will this node work in this pool? One table of checks, each pass,
warn or fail, with what to do about a failure.

It takes the same flags as `prime-node join` (so an operator runs it with the command line
they will join with) and checks, without registering or taking any work: the node key;
each scheduler URL (reachable, serving the pool asked for, active or standby); the clock
against the scheduler's (envelopes live `DEFAULT_TTL_S`, so a skew near that rejects
every message); the pool's signed config (right pool id, right owner with `--owner`); the
engine (the pool's model loads on the device and dtype asked for) and whether the pool's
thresholds were calibrated for its engine mix; free disk for weights; that the HTTP and
swarm listen ports are free; the node channel (the WebSocket the node will open to each
scheduler gets its challenge: no proxy or firewall in the way strips the upgrade); and how
swarm peers will reach this node (directly at a public address, or only through the
pool's relay when its addresses are private: behind NAT).

Invariants: nothing is sent to the scheduler but GETs of /health, /v1/pool and the
channel's upgrade (closed after the challenge, no hello: nothing registers); every check
runs even when an earlier one failed, unless it needs what that one would have given (the
engine check needs the pool config); the exit code is 1 when any check failed, 0
otherwise (warnings do not fail).
"""

from __future__ import annotations

import asyncio
import ipaddress
import shutil
import socket
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Literal

import aiohttp
from rich.console import Console
from rich.table import Table

from node.config import JoinConfig
from node.join import JoinError, fetch_pool
from protocol.channel import read_challenge, ws_url
from protocol.envelope import DEFAULT_TTL_S
from protocol.identity import Identity, IdentityError
from protocol.messages import PoolConfig

WARN_SKEW_S = 2.0
FAIL_SKEW_S = DEFAULT_TTL_S / 4
# Weights on disk: the versions a node keeps plus one being downloaded, of this many bytes
# per parameter (bf16 on the wire).
BYTES_PER_PARAM = 2


@dataclass
class Check:
    name: str
    status: Literal["pass", "warn", "fail"]
    detail: str
    fix: str = ""


async def _scheduler_checks(cfg: JoinConfig, session: aiohttp.ClientSession) -> list[Check]:
    out = []
    for url in cfg.scheduler_urls:
        t0 = time.time()
        try:
            async with session.get(f"{url}/health") as resp:
                body = await resp.json(content_type=None) if resp.status == 200 else {}
                date = resp.headers.get("Date")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            out.append(
                Check(
                    f"scheduler {url}",
                    "fail",
                    f"unreachable: {type(exc).__name__}: {exc}",
                    "check the URL and that this machine can open a connection to it "
                    "(firewall, VPN, the scheduler's --server.host)",
                )
            )
            continue
        t1 = time.time()
        pool_id = body.get("pool_id")
        if pool_id != cfg.pool:
            out.append(
                Check(
                    f"scheduler {url}",
                    "fail",
                    f"serves pool {pool_id!r}, not {cfg.pool!r}",
                    "pass the pool id this scheduler serves with --pool, or its URL",
                )
            )
            continue
        status = body.get("status", "?")
        out.append(
            Check(
                f"scheduler {url}",
                "pass" if status == "ok" else "warn",
                f"pool {pool_id!r}, {status}, {body.get('nodes', {})} nodes, "
                f"{(t1 - t0) * 1000:.0f} ms",
                "" if status == "ok" else "a standby replica: list the active one as well",
            )
        )
        their = body.get("time")
        if their is None and date:
            their = parsedate_to_datetime(date).timestamp() + 0.5  # whole seconds
        if their is None:
            continue
        skew = (t0 + t1) / 2 - float(their)
        verdict = "pass" if abs(skew) < WARN_SKEW_S else "warn"
        verdict = "fail" if abs(skew) >= FAIL_SKEW_S else verdict
        out.append(
            Check(
                f"clock vs {url}",
                verdict,
                f"this clock is {skew:+.2f} s off the scheduler's "
                f"(signed messages live {DEFAULT_TTL_S:.0f} s)",
                "" if verdict == "pass" else "run NTP (systemd-timesyncd, chrony) on this machine",
            )
        )
    return out


async def _channel_check(url: str, session: aiohttp.ClientSession) -> Check:
    """Open the node channel's WebSocket and read its challenge; send no hello."""
    try:
        async with session.ws_connect(ws_url(url)) as ws:
            first = await ws.receive(timeout=10)
            read_challenge(first.data, 1024)
    except (aiohttp.ClientError, TimeoutError, ValueError, TypeError) as exc:
        return Check(
            f"channel {url}",
            "fail",
            f"the WebSocket to {ws_url(url)} failed: {type(exc).__name__}: {exc}",
            "a proxy or firewall between here and the scheduler must pass WebSocket "
            "upgrades (HTTP/1.1 Upgrade); with a standby replica, list the active one too",
        )
    return Check(f"channel {url}", "pass", "WebSocket upgrade and challenge received")


def _reachability_check(cfg: JoinConfig) -> Check:
    """How swarm peers will reach this node: its announced (or listen) addresses."""
    peer = cfg.weights.peer
    hosts = [a.split("/")[2] for a in (peer.announce_addrs or peer.listen) if a.count("/") >= 2]
    try:
        private = [h for h in hosts if not ipaddress.ip_address(h).is_global]
    except ValueError:  # a DNS name: whatever it resolves to elsewhere
        return Check("swarm reachability", "pass", f"announces {', '.join(hosts)}")
    if not private:
        return Check("swarm reachability", "pass", f"direct at {', '.join(hosts)}")
    if peer.use_relay:
        return Check(
            "swarm reachability",
            "warn",
            f"{', '.join(hosts)} is private: peers outside this network reach this node "
            "only through the pool's relay (the trainer's seed)",
            "fine behind NAT; for direct trades forward a port and set "
            "--weights.peer.announce-addrs to the public address",
        )
    return Check(
        "swarm reachability",
        "fail",
        f"{', '.join(hosts)} is private and use_relay is off: peers outside this network "
        "cannot fetch from this node",
        "turn --weights.peer.use-relay on, or forward a port and announce it",
    )


def _key_check(cfg: JoinConfig) -> Check:
    path = cfg.key_file.expanduser()
    if not path.exists():
        return Check("node key", "warn", f"{path} does not exist yet", "join creates it")
    try:
        # The file exists: load_or_create only reads it.
        return Check("node key", "pass", f"{path}: {Identity.load_or_create(path).node_id}")
    except IdentityError as exc:
        return Check("node key", "fail", str(exc), "fix its mode (0600) or move it away")


def _engine_checks(cfg: JoinConfig, pool: PoolConfig) -> tuple[list[Check], int]:
    """The engine loads and its mix is covered; returns the model's parameter count."""
    from node.engines import create_engine, engine_mix

    try:
        engine_cfg = cfg.engine.resolve(pool.model)
        t0 = time.monotonic()
        engine = create_engine(engine_cfg)
    except Exception as exc:  # noqa: BLE001 - any load failure is this check's answer
        return [
            Check(
                "engine",
                "fail",
                f"{cfg.engine.kind} cannot serve {pool.model!r}: {type(exc).__name__}: {exc}",
                "point --engine.model at a local copy of the pool's model; "
                "check --engine.device (cuda needs a CUDA build of torch)",
            )
        ], 0
    mix = engine_mix(engine, cfg.engine.kind)
    model = getattr(engine, "model", None)  # the torch engine's module; vLLM keeps its own
    params = sum(p.numel() for p in model.parameters()) if model is not None else 0
    checks = [
        Check(
            "engine",
            "pass",
            f"{engine_cfg.model} on {mix.label()}, loaded in {time.monotonic() - t0:.1f} s",
        )
    ]
    covered = pool.verification.engine_mixes
    if mix.covered_by(covered):
        checks.append(Check("calibration", "pass", f"the pool's thresholds cover {mix.label()}"))
    else:
        checks.append(
            Check(
                "calibration",
                "fail",
                f"the pool's thresholds cover {', '.join(m.label() for m in covered) or 'no mix'}"
                f", not {mix.label()}: the scheduler would refuse this node",
                "pass --engine.dtype / --engine.device / --engine.kind to match one, or run "
                "`prime-node calibrate` for this mix and send the pool owner its TOML",
            )
        )
    return checks, params


def _disk_check(cfg: JoinConfig, params: int) -> Check:
    folder = cfg.weights.folder.expanduser()
    probe = next((p for p in (folder, *folder.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free
    need = (cfg.weights.keep_versions + 1) * params * BYTES_PER_PARAM
    detail = f"{free / 2**30:.1f} GiB free at {probe}"
    if need and free < need:
        return Check(
            "disk for weights",
            "fail",
            f"{detail}; {cfg.weights.keep_versions} kept versions and one download need "
            f"{need / 2**30:.1f} GiB",
            "free space there, lower --weights.keep-versions or move --weights.folder",
        )
    return Check(
        "disk for weights", "pass", detail + (f" (need {need / 2**30:.2f})" if need else "")
    )


def _port_checks(cfg: JoinConfig) -> list[Check]:
    out = []
    wanted = [("HTTP port", cfg.server.host, cfg.server.port)]
    if cfg.weights.swarm:
        for addr in cfg.weights.peer.listen:
            parts = addr.split("/")
            if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp":
                wanted.append((f"swarm {addr}", parts[2], int(parts[4])))
    for name, host, port in wanted:
        # Whether others can reach it (NAT, firewall) is not tested here.
        if port == 0:
            out.append(Check(name, "pass", "any free port (0); reachability not tested"))
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError as exc:
                out.append(
                    Check(name, "fail", f"{host}:{port}: {exc.strerror}", "pick another port")
                )
                continue
        out.append(Check(name, "pass", f"{host}:{port} is free; reachability not tested"))
    return out


async def diagnose(cfg: JoinConfig) -> list[Check]:
    checks = [_key_check(cfg)]
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        checks += await _scheduler_checks(cfg, session)
        for url in cfg.scheduler_urls:
            checks.append(await _channel_check(url, session))
        pool = None
        if any(c.status != "fail" for c in checks if c.name.startswith("scheduler ")):
            try:
                pool, _ = await fetch_pool(session, cfg.model_copy(update={"startup_attempts": 1}))
                checks.append(
                    Check("pool config", "pass", f"{pool.pool_id!r}, model {pool.model!r}")
                )
            except JoinError as exc:
                checks.append(Check("pool config", "fail", str(exc), "see the message"))
    params = 0
    if pool is not None:
        engine_checks, params = await asyncio.to_thread(_engine_checks, cfg, pool)
        checks += engine_checks
    checks.append(_disk_check(cfg, params))
    checks += _port_checks(cfg)
    if cfg.weights.swarm:
        checks.append(_reachability_check(cfg))
    return checks


def print_report(checks: list[Check], console: Console) -> None:
    style = {"pass": "green", "warn": "yellow", "fail": "red"}
    table = Table(title="prime-node doctor")
    for col in ("check", "status", "detail", "what to do"):
        table.add_column(col, overflow="fold")
    for c in checks:
        table.add_row(c.name, f"[{style[c.status]}]{c.status}[/]", c.detail, c.fix)
    console.print(table)
