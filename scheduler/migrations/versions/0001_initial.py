"""Initial schema: nodes, requests, results, verdicts, invites, nonces, kv.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "nodes",
        sa.Column("node_id", sa.String(128), primary_key=True),
        sa.Column("pool_id", sa.String(64), nullable=False),
        sa.Column("public_key", sa.LargeBinary, nullable=False),
        sa.Column("operator", sa.String(128), nullable=False),
        sa.Column("http_url", sa.String(512), nullable=False),
        sa.Column("address", sa.String(64), nullable=False),
        sa.Column("engine", sa.String(16), nullable=False),
        sa.Column("model", sa.String(512), nullable=False),
        sa.Column("capacity", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reputation", sa.Float, nullable=False),
        sa.Column("weights_version", sa.Integer, nullable=False),
        sa.Column("weights_hash", sa.String(128), nullable=False),
        sa.Column("registered_at", sa.Float, nullable=False),
        sa.Column("last_seen", sa.Float, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
    )
    op.create_table(
        "requests",
        sa.Column("request_id", sa.String(128), primary_key=True),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("spec", sa.LargeBinary, nullable=False),
        sa.Column("seed", sa.BigInteger, nullable=False),
        sa.Column("submitted_at", sa.Float, nullable=False),
        sa.Column("rollout_envelope", sa.LargeBinary, nullable=True),
    )
    op.create_table(
        "results",
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("request_id", sa.String(128), nullable=False, unique=True),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
        sa.Column("weights_version", sa.Integer, nullable=False),
        sa.Column("generator_id", sa.String(128), nullable=False),
        sa.Column("rollout_envelope", sa.LargeBinary, nullable=False),
        sa.Column("verdict_envelopes", sa.LargeBinary, nullable=False),
        sa.Column("released_at", sa.Float, nullable=False),
    )
    op.create_table(
        "verdicts",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("generator_id", sa.String(128), nullable=False),
        sa.Column("verifier_id", sa.String(128), nullable=False),
        sa.Column("accepted", sa.Boolean, nullable=False),
        sa.Column("reasons", sa.Text, nullable=False),
        sa.Column("rollout_envelope", sa.LargeBinary, nullable=False),
        sa.Column("verdict_envelope", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_index("ix_verdicts_request_id", "verdicts", ["request_id"])
    op.create_table(
        "invites",
        sa.Column("invite_id", sa.String(64), primary_key=True),
        sa.Column("node_id", sa.String(128), nullable=False),
        sa.Column("used_at", sa.Float, nullable=False),
    )
    op.create_table(
        "nonces",
        sa.Column("key", sa.String(160), primary_key=True),
        sa.Column("expires", sa.Float, nullable=False),
    )
    op.create_index("ix_nonces_expires", "nonces", ["expires"])
    op.create_table(
        "kv",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.LargeBinary, nullable=False),
    )


def downgrade() -> None:
    for name in ("kv", "nonces", "invites", "verdicts", "results", "requests", "nodes"):
        op.drop_table(name)
