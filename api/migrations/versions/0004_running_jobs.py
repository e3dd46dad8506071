"""Running jobs: what to launch, placement epochs, host outages, micro-loop directives, reported progress.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30

- jobs: `entrypoint` (what torchrun runs), `placement` (the job's last announced node set and plan) with
  `placement_epoch` (bumped whenever it changes; node launchers restart the job's nodes on a new epoch),
  `restart_mode` (graceful for agreements, immediate after a host failure) and `directives` (the provider's current
  micro-level settings for the job).
- hosts: `down_at`, set while the fleet monitor reports the host down (nothing is placed on it).
- job_directives, job_status, job_timeline (see api/models.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=63)
RESTART_MODES = ("graceful", "immediate")
DIRECTIVE_STATES = ("issued", "refused", "applied")
PLANS = ("ddp", "fsdp", "hsdp")


def _enum(name: str, values: Sequence[str], length: int = 16) -> sa.Enum:
    return sa.Enum(*values, name=name, native_enum=False, create_constraint=True, length=length)


def _timestamp(name: str, *, nullable: bool = False) -> sa.Column[datetime]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _job_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["tenant_id", "job_id"],
        ["jobs.tenant_id", "jobs.id"],
        name=op.f(f"fk_{table}_tenant_id_job_id_jobs"),
        ondelete="RESTRICT",
    )


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("entrypoint", sa.JSON(), server_default=sa.text("'[]'"), nullable=False))
        batch.add_column(sa.Column("placement", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("placement_epoch", sa.Integer(), server_default=sa.text("0"), nullable=False))
        batch.add_column(
            sa.Column(
                "restart_mode", _enum("restart_mode", RESTART_MODES), server_default="graceful", nullable=False
            )
        )
        batch.add_column(sa.Column("directives", sa.JSON(), nullable=True))
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(_timestamp("down_at", nullable=True))
    op.create_table(
        "job_directives",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("job_id", ID, nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("state", _enum("directive_state", DIRECTIVE_STATES), nullable=False),
        sa.Column("settings", sa.JSON(), nullable=False),
        sa.Column("reason", sa.String(length=500), nullable=False),
        sa.Column("refusals", sa.JSON(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        _job_fk("job_directives"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_directives")),
    )
    op.create_index(
        "ix_job_directives_tenant_id_job_id_created_at", "job_directives", ["tenant_id", "job_id", "created_at"]
    )
    op.create_table(
        "job_status",
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("job_id", ID, nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("progress", sa.JSON(), nullable=False),
        _timestamp("reported_at"),
        _job_fk("job_status"),
        sa.PrimaryKeyConstraint("tenant_id", "job_id", name=op.f("pk_job_status")),
    )
    op.create_table(
        "job_timeline",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("job_id", ID, nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("parallel_plan", _enum("parallel_plan", PLANS, 8), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("resumed_from_step", sa.Integer(), nullable=True),
        _timestamp("at"),
        _job_fk("job_timeline"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_timeline")),
    )
    op.create_index("ix_job_timeline_tenant_id_job_id_id", "job_timeline", ["tenant_id", "job_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_job_timeline_tenant_id_job_id_id", table_name="job_timeline")
    op.drop_table("job_timeline")
    op.drop_table("job_status")
    op.drop_index("ix_job_directives_tenant_id_job_id_created_at", table_name="job_directives")
    op.drop_table("job_directives")
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("down_at")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint(op.f("ck_jobs_restart_mode"), type_="check")
        batch.drop_column("directives")
        batch.drop_column("restart_mode")
        batch.drop_column("placement_epoch")
        batch.drop_column("placement")
        batch.drop_column("entrypoint")
