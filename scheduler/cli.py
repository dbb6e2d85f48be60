"""`prime-scheduler`: run a pool's scheduler daemon, create pools, issue invites and API keys,
migrate.

Every command takes its settings through the shared config loader (`protocol.config`):
``--section.key value`` flags, ``@ file.toml`` and ``PRIME_`` env vars.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from protocol.config import load_config_or_exit, write_resolved
from protocol.logs import setup_logging

app = typer.Typer(help="prime-swarm scheduler daemon.", no_args_is_help=True, add_completion=False)
pool_app = typer.Typer(help="Create pools, invites and API keys.", no_args_is_help=True)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
app.add_typer(pool_app, name="pool")
app.add_typer(db_app, name="db")
console = Console(stderr=True)
EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}
DEFAULT_OWNER_KEY = Path("~/.prime-swarm/owner.key")


@app.command(context_settings=EXTRA)
def serve(ctx: typer.Context) -> None:
    """Run the scheduler of one pool.

    Example: prime-scheduler serve @ configs/pools/demo.toml --server.port 7000
    """
    from scheduler.config import SchedulerConfig
    from scheduler.pool import PoolError
    from scheduler.server import run

    cfg = load_config_or_exit(SchedulerConfig, ctx.args)
    setup_logging()
    write_resolved(cfg, cfg.log_dir / "scheduler.toml")
    try:
        run(cfg)
    except PoolError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc


@pool_app.command("create", context_settings=EXTRA)
def pool_create(ctx: typer.Context) -> None:
    """Write a pool config signed by the owner key (and a scheduler config next to it).

    Example: prime-scheduler pool create --pool-id demo --trainer trainer.key
    @ configs/verification/tiny-torch-cpu-fp32.toml --admission.mode invite
    """
    import tomli_w

    from protocol.identity import Identity
    from protocol.messages import PoolConfig
    from scheduler.config import PoolCreateConfig
    from scheduler.pool import write_pool

    cfg = load_config_or_exit(PoolCreateConfig, ctx.args)
    owner = Identity.load_or_create(cfg.owner_key.expanduser())
    pool = PoolConfig(
        pool_id=cfg.pool_id,
        model=cfg.model,
        trainer_public_key=cfg.trainer_public_key(),
        admission=cfg.admission,
        verification=cfg.verification,
        reputation=cfg.reputation,
        checkers=cfg.checkers,
        async_level=cfg.async_level,
    )
    out = cfg.out or Path("configs/pools") / f"{cfg.pool_id}.pool"
    write_pool(out, owner, pool)
    serve_cfg = out.with_suffix(".toml")
    if not serve_cfg.exists():
        serve_cfg.write_text(
            f"# Scheduler of pool {cfg.pool_id}: prime-scheduler serve @ {serve_cfg}\n"
            + tomli_w.dumps(
                {
                    "pool_file": str(out),
                    "key_file": f"runs/{cfg.pool_id}/scheduler.key",
                    "log_dir": f"runs/{cfg.pool_id}/logs",
                    "database": {"url": f"sqlite+aiosqlite:///runs/{cfg.pool_id}/scheduler.db"},
                    "server": {"port": cfg.port},
                }
            )
        )
    console.print(f"pool [bold]{cfg.pool_id}[/bold] signed by owner {owner.node_id}")
    print(out)


def _owned_pool(pool_file: Path, owner_key: Path):
    """The pool file and its owner identity, or a clear exit."""
    from protocol.identity import Identity
    from scheduler.pool import PoolError, read_pool

    try:
        pool = read_pool(pool_file)
    except (PoolError, OSError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    if not owner_key.expanduser().is_file():
        console.print(f"[red]owner key {owner_key} not found[/red]")
        raise typer.Exit(2)
    owner = Identity.load_or_create(owner_key.expanduser())
    if owner.public_key != pool.owner_key:
        console.print(f"[red]{owner_key} is not the owner key of pool {pool.config.pool_id}[/red]")
        raise typer.Exit(2)
    return pool, owner


@pool_app.command("invite")
def pool_invite(
    pool_file: Annotated[Path, typer.Option(help="The signed pool file.")],
    owner_key: Annotated[Path, typer.Option(help="Owner key file.")] = DEFAULT_OWNER_KEY,
    ttl_h: Annotated[float, typer.Option(help="Hours the invite stays valid.")] = 24.0,
    node_id: Annotated[str, typer.Option(help="Bind the invite to this node id.")] = "",
) -> None:
    """Print a single-use invite token for an invite-only pool."""
    from scheduler.pool import make_invite

    pool, owner = _owned_pool(pool_file, owner_key)
    print(make_invite(owner, pool.config.pool_id, ttl_h * 3600, node_id))


@pool_app.command("api-key")
def pool_api_key(
    pool_file: Annotated[Path, typer.Option(help="The signed pool file.")],
    name: Annotated[str, typer.Option(help="Who the key is for (shown in logs).")],
    owner_key: Annotated[Path, typer.Option(help="Owner key file.")] = DEFAULT_OWNER_KEY,
    ttl_h: Annotated[float, typer.Option(help="Hours the key stays valid.", min=0.001)] = 24.0
    * 365,
    rate: Annotated[float, typer.Option(help="Sustained calls per second.", min=0.001)] = 20.0,
    burst: Annotated[int, typer.Option(help="Calls at once above the rate.", min=1)] = 64,
) -> None:
    """Print an API key (bearer token) for the pool's OpenAI endpoint; its key id (for
    `--openai.revoked-keys`) goes to stderr."""
    from scheduler.pool import check_api_key, make_api_key

    pool, owner = _owned_pool(pool_file, owner_key)
    token = make_api_key(owner, pool.config.pool_id, name, ttl_h * 3600, rate, burst)
    console.print(f"API key {check_api_key(token, pool).key_id} for {name!r}")
    print(token)


@db_app.command("upgrade")
def db_upgrade(
    url: str = typer.Option(
        ..., help="Database URL (sqlite+aiosqlite:///... or postgresql+asyncpg://...)."
    ),
) -> None:
    """Apply the schema migrations (the daemon also does this at start)."""
    import asyncio

    from scheduler import db

    async def go() -> None:
        engine = db.create_engine(url)
        await db.migrate(engine, url)
        await engine.dispose()

    asyncio.run(go())
    print("schema is at the newest migration")


@app.command()
def version() -> None:
    """Print the protocol version this scheduler speaks."""
    from protocol import PROTOCOL_VERSION

    print(f"prime-swarm protocol v{PROTOCOL_VERSION}")


if __name__ == "__main__":
    app()
