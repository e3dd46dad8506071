"""The negotiation pace's token buckets in the database, so several API replicas share one bucket per tenant.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02

- rate_buckets: one row per tenant that wrote to the negotiation routes (api/models_rate_buckets.py); used on
  PostgreSQL, where replicas share the database (SQLite's one API process keeps its buckets in memory).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "rate_buckets",
        sa.Column("tenant_id", sa.String(length=63), nullable=False),
        sa.Column("tokens", sa.Float(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_rate_buckets")),
    )


def downgrade() -> None:
    op.drop_table("rate_buckets")
