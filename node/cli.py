"""`prime-node`: run a worker (standalone or in a pool), manage its key, prepare bundled
models, calibrate thresholds, fetch a weights version from swarm peers by hand.

Every command takes its settings through the shared config loader
(`protocol.config`): ``--section.key value`` flags, ``@ file.toml`` and ``PRIME_`` env vars.
"""

from __future__ import annotations

import typer
from rich.console import Console

from protocol.config import load_config_or_exit, write_resolved
from protocol.logs import setup_logging

app = typer.Typer(help="prime-swarm worker node.", no_args_is_help=True, add_completion=False)
console = Console(stderr=True)
EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


# Short flags for the common settings of `serve` and `join` (`prime-node serve --model X
# --port 8000`); `join`'s --pool, --scheduler, --operator, ... are top-level keys already.
ALIASES = {"--model": "--engine.model", "--port": "--server.port", "--host": "--server.host"}


def expand_aliases(args: list[str]) -> list[str]:
    """The CLI's short flags rewritten to their config paths."""
    out = []
    for arg in args:
        key, eq, value = arg.partition("=")
        out.append(ALIASES.get(key, key) + eq + value)
    return out


def _config(cls, args: list[str]):
    return load_config_or_exit(cls, expand_aliases(args))


@app.command(context_settings=EXTRA)
def serve(ctx: typer.Context) -> None:
    """Run a standalone worker: OpenAI-compatible API, proof and verify routes.

    Example: prime-node serve --model smollm2 --port 8000 (short for --engine.model, --server.port)
    """
    from node.assembly import assemble, load_engine
    from node.config import NodeConfig
    from protocol.http import serve_app
    from protocol.identity import Identity, public_key_from_node_id

    cfg = _config(NodeConfig, ctx.args)
    setup_logging()
    write_resolved(cfg, cfg.log_dir / "node.toml")
    identity = Identity.load_or_create(cfg.key_file)
    with console.status(f"loading {cfg.engine.model} on the {cfg.engine.kind} engine"):
        engine = load_engine(cfg.engine)
    server = assemble(
        engine,
        cfg.engine,
        identity,
        cfg.server,
        cfg.weights,
        policy=cfg.verification,
        pool_id=cfg.pool_id,
        trainer_keys={public_key_from_node_id(k) for k in cfg.trusted_keys},
        model_name=cfg.engine.model,
        api_key=cfg.server.api_key,
    )
    console.print(
        f"node [bold]{identity.node_id}[/bold] serving {cfg.engine.model} "
        f"at http://{cfg.server.host}:{cfg.server.port}/v1"
    )
    serve_app(server.app(), cfg.server)


@app.command(context_settings=EXTRA)
def fetch(ctx: typer.Context) -> None:
    """Download a version by its signed manifest from peers, checking every piece.

    Example: prime-node fetch --manifest step_3/.manifest --trusted_key 12D3KooW...
    --peers '["/ip4/1.2.3.4/tcp/4001/p2p/12D3KooW..."]'
    """
    import time

    from node.config import FetchConfig
    from protocol.identity import Identity, public_key_from_node_id
    from protocol.swarm.follow import follow
    from protocol.swarm.host import SwarmHost
    from protocol.swarm.manifest import ManifestError, open_manifest

    cfg = _config(FetchConfig, ctx.args)
    setup_logging()
    identity = Identity.load_or_create(cfg.key_file)
    envelope = cfg.manifest.read_bytes()
    with SwarmHost(identity, cfg.swarm, {public_key_from_node_id(cfg.trusted_key)}) as host:
        try:
            fut = host.fetch(envelope, cfg.dest.resolve(), cfg.peers)
        except ManifestError as exc:
            console.print(f"[red]{exc}[/red]")
            raise typer.Exit(2) from exc
        digest = open_manifest(envelope, host.trusted).digest()
        started = time.time()
        status = follow(
            host,
            digest,
            until=lambda s: s.complete,
            status_file=cfg.status_file,
            show_progress=cfg.progress,
        )
        console.print(
            f"step {status.step} complete in {status.folder} after {time.time() - started:.1f} s"
            f" ({status.downloaded / 2**20:.1f} MiB downloaded, {status.bad_pieces} bad pieces)"
        )
        fut.result()
        stop_at = time.time() + cfg.seed_after_s
        follow(
            host,
            digest,
            until=lambda _: time.time() > stop_at,
            status_file=cfg.status_file,
            show_progress=False,
        )


@app.command(context_settings=EXTRA)
def join(ctx: typer.Context) -> None:
    """Join a pool: check its signed config, register with its scheduler, serve, heartbeat.

    Example: prime-node join --pool demo --scheduler http://127.0.0.1:7000 --operator me
    [--invite TOKEN_OR_FILE] [--owner NODE_ID] [--model DIR] [--port N].
    SIGTERM/SIGINT leave cleanly (drain, then deregister; a second signal cuts the drain).
    Exit status: 0 left cleanly, 2 refused or scheduler unreachable at start, 3 banned.
    """
    import asyncio

    from node.config import JoinConfig
    from node.join import JoinError, run

    cfg = _config(JoinConfig, ctx.args)
    setup_logging()
    write_resolved(cfg, cfg.log_dir / "node.toml")
    try:
        asyncio.run(run(cfg))
    except JoinError as exc:
        console.print(f"join failed: {exc}", style="red", markup=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from exc


@app.command(context_settings=EXTRA)
def doctor(ctx: typer.Context) -> None:
    """Check, with the flags you would join with, that this node can work in the pool:
    the key, each scheduler URL, the clock, the pool config, the engine and its
    calibration, disk for weights, listen ports. Registers nothing. Exit 1 if any failed.

    Example: prime-node doctor --pool demo --scheduler http://127.0.0.1:7000 --engine.dtype bfloat16
    """
    import asyncio

    from node.config import JoinConfig
    from node.doctor import diagnose, print_report

    cfg = _config(JoinConfig, ctx.args)
    checks = asyncio.run(diagnose(cfg))
    print_report(checks, console)
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(1)


@app.command()
def keygen(
    key_file: str = typer.Option("~/.prime-swarm/node.key", help="Key file to create or read."),
) -> None:
    """Create the node key (mode 0600) if missing and print the node id."""
    from protocol.identity import Identity, IdentityError

    try:
        print(Identity.load_or_create(key_file).node_id)
    except IdentityError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc


@app.command("prepare-model")
def prepare_model(name: str = typer.Argument(..., help="'tiny' or 'smollm2'")) -> None:
    """Build (tiny) or dequantize (smollm2) a bundled model into the cache; print its folder."""
    from verifier.models import BUNDLED_MODELS, resolve_model

    if name not in BUNDLED_MODELS:
        console.print(f"[red]unknown bundled model {name!r}: use 'tiny' or 'smollm2'[/red]")
        raise typer.Exit(2)
    with console.status(f"preparing {name}"):
        print(resolve_model(name))


@app.command(context_settings=EXTRA)
def calibrate(ctx: typer.Context) -> None:
    """Measure honest proof/logprob/sampling errors on an engine pair and propose thresholds.

    Example: prime-node calibrate --generator.model smollm2 --rollouts 64 --out thresholds.toml
    """
    from node.calibrate import run_calibration
    from node.config import CalibrateConfig

    cfg = _config(CalibrateConfig, ctx.args)
    setup_logging("WARNING")
    run_calibration(cfg, console)


if __name__ == "__main__":
    app()
