"""Node channels: nodes call in over a WebSocket, so the scheduler keeps no node URL.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch mode: SQLite rebuilds the table (it cannot drop a column in place everywhere).
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("http_url")


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("http_url", sa.String(512), nullable=False, server_default=""))
