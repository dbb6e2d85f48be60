"""Alembic environment of the scheduler's schema.

Runs on the connection the scheduler hands over (`config.attributes["connection"]`, see
`scheduler.db.migrate`), or, from the alembic command line, on `sqlalchemy.url`.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from scheduler.db import metadata

config = context.config


def run(connection) -> None:
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    run(connection)
else:
    # Offline use (`alembic upgrade head` by hand) with a synchronous driver.
    url = config.get_main_option("sqlalchemy.url").replace("+aiosqlite", "").replace("+asyncpg", "")
    with create_engine(url).connect() as conn:
        run(conn)
        conn.commit()
