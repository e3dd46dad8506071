"""Warm joiners: the hosts an open offer would grow a job onto start its node before the accept.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

- standby_nodes: one row per (negotiation, host), see api/models.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=63)


def upgrade() -> None:
    op.create_table(
        "standby_nodes",
        sa.Column("negotiation_id", sa.String(length=36), nullable=False),
        sa.Column("host_id", ID, nullable=False),
        sa.Column("workers", sa.Integer(), nullable=False),
        sa.CheckConstraint("workers >= 1", name=op.f("ck_standby_nodes_workers_positive")),
        sa.ForeignKeyConstraint(
            ["negotiation_id"], ["negotiations.id"], name=op.f("fk_standby_nodes_negotiation_id_negotiations"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["host_id"], ["hosts.id"], name=op.f("fk_standby_nodes_host_id_hosts"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("negotiation_id", "host_id", name=op.f("pk_standby_nodes")),
    )
    op.create_index(op.f("ix_standby_nodes_host_id"), "standby_nodes", ["host_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_standby_nodes_host_id"), table_name="standby_nodes")
    op.drop_table("standby_nodes")
