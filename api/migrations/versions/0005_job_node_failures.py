"""Node failures on healthy hosts: hung nodes and nodes out of restarts, as the node launchers report them.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-07

- job_node_failures: one row per (tenant, job, host, placement epoch), see api/models.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=63)
REASONS = ("frozen", "stalled", "out_of_restarts")


def upgrade() -> None:
    op.create_table(
        "job_node_failures",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("job_id", ID, nullable=False),
        sa.Column("host_id", ID, nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column(
            "reason",
            sa.Enum(*REASONS, name="node_failure_reason", native_enum=False, create_constraint=True, length=16),
            nullable=False,
        ),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("released", sa.Boolean(), nullable=False),
        sa.Column("detail", sa.String(length=500), nullable=False),
        sa.Column("detected_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("reported_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id", "job_id"],
            ["jobs.tenant_id", "jobs.id"],
            name=op.f("fk_job_node_failures_tenant_id_job_id_jobs"),
            ondelete="RESTRICT",
        ),
        sa.ForeignKeyConstraint(
            ["host_id"], ["hosts.id"], name=op.f("fk_job_node_failures_host_id_hosts"), ondelete="RESTRICT"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_node_failures")),
        sa.UniqueConstraint(
            "tenant_id", "job_id", "host_id", "epoch", name=op.f("uq_job_node_failures_tenant_id_job_id_host_id_epoch")
        ),
    )


def downgrade() -> None:
    op.drop_table("job_node_failures")
