"""The scheduler's durable state: tables (SQLAlchemy Core) and the group-committing store.

Tables: `nodes` (admitted nodes, state, reputation), `requests` (every submitted request,
with its spec and seed), `results` (the results stream: one row per released request),
`verdicts` (audit: every verdict with the generator's signed rollout and the verifier's
signed verdict), `invites` (consumed invite ids), `nonces` (registration nonces, so a
replayed registration is refused even after a restart), `kv` (pool state: current weights).

Invariants:
- `results.request_id` is unique: a request is released at most once, enforced by the
  database itself, whatever the scheduler process does; `results.seq` is the stream order.
- A request is open (to be dispatched) exactly when it has no `results` row; a restart
  re-dispatches every open request, so a crash can cost work but never loses a request.
- Writes go through one `Writer` that commits them together (group commit); whoever needs
  a write to be durable before acting on it awaits the future `write` returns.
- Schema changes go through Alembic migrations (`scheduler/migrations`); the tables here
  and the migrated schema are compared by a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config as AlembicConfig
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    event,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.sql import Executable

log = logging.getLogger("prime.scheduler.db")
metadata = MetaData()

nodes = Table(
    "nodes",
    metadata,
    Column("node_id", String(128), primary_key=True),
    Column("pool_id", String(64), nullable=False),
    Column("public_key", LargeBinary, nullable=False),
    Column("operator", String(128), nullable=False, default=""),
    Column("address", String(64), nullable=False, default=""),
    Column("engine", String(16), nullable=False),
    Column("model", String(512), nullable=False, default=""),
    Column("capacity", Integer, nullable=False),
    Column("state", String(16), nullable=False),
    Column("reputation", Float, nullable=False),
    Column("weights_version", Integer, nullable=False, default=0),
    Column("weights_hash", String(128), nullable=False, default=""),
    Column("registered_at", Float, nullable=False),
    Column("last_seen", Float, nullable=False),
    Column("reason", Text, nullable=False, default=""),
    Column("earned", Integer, nullable=False, default=0, server_default="0"),
)

requests = Table(
    "requests",
    metadata,
    Column("request_id", String(128), primary_key=True),
    Column("source", String(16), nullable=False),
    Column("spec", LargeBinary, nullable=False),
    Column("seed", BigInteger, nullable=False),
    Column("submitted_at", Float, nullable=False),
    # OpenAI-endpoint calls: the generator's signed rollout, kept until its verdict.
    Column("rollout_envelope", LargeBinary, nullable=True),
)

results = Table(
    "results",
    metadata,
    Column("seq", BigInteger, primary_key=True, autoincrement=False),
    Column("request_id", String(128), nullable=False, unique=True),
    Column("source", String(16), nullable=False),
    Column("status", String(16), nullable=False),
    Column("detail", Text, nullable=False, default=""),
    Column("weights_version", Integer, nullable=False, default=0),
    Column("generator_id", String(128), nullable=False, default=""),
    Column("rollout_envelope", LargeBinary, nullable=False),
    Column("verdict_envelopes", LargeBinary, nullable=False),
    Column("released_at", Float, nullable=False),
)

verdicts = Table(
    "verdicts",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("request_id", String(128), nullable=False, index=True),
    Column("kind", String(16), nullable=False),
    Column("generator_id", String(128), nullable=False),
    Column("verifier_id", String(128), nullable=False),
    Column("accepted", Boolean, nullable=False),
    Column("reasons", Text, nullable=False, default=""),
    Column("rollout_envelope", LargeBinary, nullable=False),
    Column("verdict_envelope", LargeBinary, nullable=False),
    Column("created_at", Float, nullable=False),
)

invites = Table(
    "invites",
    metadata,
    Column("invite_id", String(64), primary_key=True),
    Column("node_id", String(128), nullable=False),
    Column("used_at", Float, nullable=False),
)

nonces = Table(
    "nonces",
    metadata,
    Column("key", String(160), primary_key=True),
    Column("expires", Float, nullable=False, index=True),
)

kv = Table(
    "kv",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", LargeBinary, nullable=False),
)

# Leader election between scheduler replicas sharing one database (migration 0002).
leases = Table(
    "leases",
    metadata,
    Column("name", String(32), primary_key=True),
    Column("holder", String(256), nullable=False),
    Column("expires", Float, nullable=False),
)

MIGRATIONS = Path(__file__).with_name("migrations")


def alembic_config(url: str) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url)
    return cfg


def insert_ignoring_duplicates(engine: AsyncEngine, table: Table):
    """INSERT that skips rows whose primary/unique key exists (SQLite and PostgreSQL)."""
    dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
    return dialect.insert(table).on_conflict_do_nothing()


def upsert_stmt(engine: AsyncEngine, table: Table):
    """INSERT a row, or overwrite every column of the row with the same primary key."""
    dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(table)
    keys = [c.name for c in table.primary_key.columns]
    return stmt.on_conflict_do_update(
        index_elements=keys,
        set_={c.name: stmt.excluded[c.name] for c in table.columns if c.name not in keys},
    )


def create_engine(url: str) -> AsyncEngine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(url, connect_args={"timeout": 30})

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record) -> None:
            # WAL: readers never block the writer; NORMAL is durable across process crashes.
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return create_async_engine(url, pool_size=10, max_overflow=10)


async def migrate(engine: AsyncEngine, url: str) -> None:
    """Bring the schema to the newest migration (idempotent)."""

    def upgrade(sync_conn) -> None:
        cfg = alembic_config(url)
        cfg.attributes["connection"] = sync_conn
        command.upgrade(cfg, "head")

    async with engine.begin() as conn:
        await conn.run_sync(upgrade)


class Writer:
    """Group commit: writes queued since the last flush commit together in one transaction.

    Writes of the same statement object run as one executemany (build statements once and
    reuse them). The future returned by `write` resolves once the transaction committed
    (or carries its error).
    """

    def __init__(self, engine: AsyncEngine, interval_s: float):
        self.engine = engine
        self.interval_s = interval_s
        self._queue: list[tuple[Executable, dict[str, Any], asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="db-writer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._flush()

    def write(self, stmt: Executable, params: dict[str, Any]) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((stmt, params, fut))
        self._wake.set()
        return fut

    def write_many(self, stmt: Executable, rows: Iterable[dict[str, Any]]) -> list[asyncio.Future]:
        return [self.write(stmt, r) for r in rows]

    async def _run(self) -> None:
        # At most one flush per interval; an idle writer flushes at once (no added latency),
        # a busy one batches whatever arrived while the previous flush ran.
        last = -1e9
        while True:
            await self._wake.wait()
            self._wake.clear()
            delay = self.interval_s - (time.monotonic() - last)
            if delay > 0:
                await asyncio.sleep(delay)
            last = time.monotonic()
            await self._flush()

    async def _flush(self) -> None:
        batch, self._queue = self._queue, []
        if not batch:
            return
        try:
            async with self.engine.begin() as conn:
                await _execute_grouped(conn, batch)
        except Exception as exc:  # noqa: BLE001 - every waiter must learn the outcome
            log.exception("database write of %d statements failed", len(batch))
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for *_, fut in batch:
            if not fut.done():
                fut.set_result(None)


async def _execute_grouped(conn: AsyncConnection, batch) -> None:
    # One executemany per statement. Reordering across statements is safe: the batch is
    # one transaction (all or nothing) and no table refers to another; writes of one
    # statement keep their order.
    groups: dict[int, tuple[Executable, list[dict[str, Any]]]] = {}
    for stmt, params, _ in batch:
        groups.setdefault(id(stmt), (stmt, []))[1].append(params)
    for stmt, params in groups.values():
        await conn.execute(stmt, params if len(params) > 1 else params[0])


async def try_lease(engine: AsyncEngine, name: str, holder: str, ttl_s: float) -> str:
    """Take or renew lease `name` for `holder` unless another holder's lease is live.

    Returns the holder after the attempt (== `holder` on success). Atomic on SQLite and
    PostgreSQL: one conditional UPDATE decides.
    """
    now = time.time()
    async with engine.begin() as conn:
        await conn.execute(
            insert_ignoring_duplicates(engine, leases), {"name": name, "holder": "", "expires": 0.0}
        )
        await conn.execute(
            update(leases)
            .where(leases.c.name == name, or_(leases.c.holder == holder, leases.c.expires < now))
            .values(holder=holder, expires=now + ttl_s)
        )
        return (await conn.execute(select(leases.c.holder).where(leases.c.name == name))).scalar()


async def max_seq(conn: AsyncConnection) -> int:
    return int((await conn.execute(select(func.coalesce(func.max(results.c.seq), 0)))).scalar())
