"""Initial schema: tenants, jobs, hosts and the capacity ledger (allocations).

Revision ID: 0001
Revises:
Create Date: 2026-11-30

Written out in full rather than importing `api.models`: a migration is a frozen record of one schema version and must
keep producing it after the models move on. Capacity invariants are CHECK constraints, so the database refuses an
overcommitted host even if some code path forgets the ledger's conditional update.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=63)


def _timestamp(name: str, *, nullable: bool = False) -> sa.Column[datetime]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _range(table: str, prefix: str) -> list[sa.CheckConstraint]:
    return [
        sa.CheckConstraint(f"{prefix}_min >= 1", name=op.f(f"ck_{table}_{prefix}_min_positive")),
        sa.CheckConstraint(f"{prefix}_min <= {prefix}_max", name=op.f(f"ck_{table}_{prefix}_range")),
    ]


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", ID, nullable=False),
        sa.Column("display_name", sa.String(length=200), nullable=False),
        sa.Column("token_id", sa.String(length=32), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("nats_user_public_key", sa.String(length=64), nullable=False),
        _timestamp("created_at"),
        _timestamp("revoked_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("nats_user_public_key", name=op.f("uq_tenants_nats_user_public_key")),
        sa.UniqueConstraint("token_id", name=op.f("uq_tenants_token_id")),
    )
    op.create_table(
        "hosts",
        sa.Column("id", ID, nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("locality_group", ID, nullable=False),
        sa.Column("allocated_gpus", sa.Integer(), server_default=sa.text("0"), nullable=False),
        _timestamp("created_at"),
        sa.CheckConstraint("gpus > 0", name=op.f("ck_hosts_gpus_positive")),
        sa.CheckConstraint(
            "allocated_gpus >= 0 AND allocated_gpus <= gpus", name=op.f("ck_hosts_allocated_within_capacity")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hosts")),
    )
    op.create_index(op.f("ix_hosts_locality_group"), "hosts", ["locality_group"], unique=False)
    op.create_table(
        "jobs",
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("id", ID, nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("min_workers", sa.Integer(), nullable=False),
        sa.Column("max_workers", sa.Integer(), nullable=False),
        sa.Column("gpus_per_worker", sa.Integer(), nullable=False),
        sa.Column(
            "parallel_plan",
            sa.Enum(
                "ddp", "fsdp", "hsdp", name="parallel_plan", native_enum=False, create_constraint=True, length=8
            ),
            nullable=False,
        ),
        sa.Column("checkpoint_interval_steps_min", sa.Integer(), nullable=False),
        sa.Column("checkpoint_interval_steps_max", sa.Integer(), nullable=False),
        sa.Column("compression_allowed", sa.JSON(), nullable=False),
        sa.Column("powersgd_max_rank", sa.Integer(), nullable=True),
        sa.Column("batch_size_min", sa.Integer(), nullable=False),
        sa.Column("batch_size_max", sa.Integer(), nullable=False),
        sa.Column("grad_accumulation_min", sa.Integer(), nullable=False),
        sa.Column("grad_accumulation_max", sa.Integer(), nullable=False),
        _timestamp("created_at"),
        sa.CheckConstraint("min_workers >= 1", name=op.f("ck_jobs_min_workers_positive")),
        sa.CheckConstraint("min_workers <= max_workers", name=op.f("ck_jobs_workers_range")),
        sa.CheckConstraint("gpus_per_worker >= 1", name=op.f("ck_jobs_gpus_per_worker_positive")),
        *_range("jobs", "checkpoint_interval_steps"),
        *_range("jobs", "batch_size"),
        *_range("jobs", "grad_accumulation"),
        sa.CheckConstraint(
            "powersgd_max_rank IS NULL OR powersgd_max_rank >= 1", name=op.f("ck_jobs_powersgd_max_rank_positive")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_jobs_tenant_id_tenants"), ondelete="RESTRICT"
        ),
        sa.PrimaryKeyConstraint("tenant_id", "id", name=op.f("pk_jobs")),
    )
    op.create_table(
        "allocations",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("job_id", ID, nullable=False),
        sa.Column("host_id", ID, nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        _timestamp("created_at"),
        _timestamp("released_at", nullable=True),
        sa.CheckConstraint("gpus > 0", name=op.f("ck_allocations_gpus_positive")),
        sa.ForeignKeyConstraint(
            ["host_id"], ["hosts.id"], name=op.f("fk_allocations_host_id_hosts"), ondelete="RESTRICT"
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id", "job_id"],
            ["jobs.tenant_id", "jobs.id"],
            name=op.f("fk_allocations_tenant_id_job_id_jobs"),
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_allocations")),
    )
    op.create_index(op.f("ix_allocations_host_id"), "allocations", ["host_id"], unique=False)
    op.create_index("ix_allocations_tenant_id_job_id", "allocations", ["tenant_id", "job_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_allocations_tenant_id_job_id", table_name="allocations")
    op.drop_index(op.f("ix_allocations_host_id"), table_name="allocations")
    op.drop_table("allocations")
    op.drop_table("jobs")
    op.drop_index(op.f("ix_hosts_locality_group"), table_name="hosts")
    op.drop_table("hosts")
    op.drop_table("tenants")
