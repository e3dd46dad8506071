"""Allocations indexed with their release time, so a read of the live ones never walks the released ones.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04

A released allocation stays (a tenant's history, the ledger's audit), so a host or job that has run for a while
holds far more released rows than live ones. Every ledger read asks for the live ones (`released_at IS NULL`),
by host or by job; with indexes on the host, and on the tenant and job, alone, each such read visited every row
that host or job ever had: an accept, which reads them several times, slowed down with the age of the cloud.

- ix_allocations_host_id -> ix_allocations_host_id_released_at (host_id, released_at)
- ix_allocations_tenant_id_job_id -> ix_allocations_tenant_id_job_id_released_at (tenant_id, job_id, released_at)

`released_at IS NULL` (and `released_at >= :now`, the rows a transaction has just released) is then a seek in
either database. The foreign keys on the host and on the job keep an index led by their columns.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0016"
down_revision: str | Sequence[str] | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_allocations_host_id_released_at", "allocations", ["host_id", "released_at"])
    op.create_index(
        "ix_allocations_tenant_id_job_id_released_at", "allocations", ["tenant_id", "job_id", "released_at"]
    )
    op.drop_index("ix_allocations_host_id", table_name="allocations")
    op.drop_index("ix_allocations_tenant_id_job_id", table_name="allocations")


def downgrade() -> None:
    op.create_index("ix_allocations_tenant_id_job_id", "allocations", ["tenant_id", "job_id"])
    op.create_index("ix_allocations_host_id", "allocations", ["host_id"])
    op.drop_index("ix_allocations_tenant_id_job_id_released_at", table_name="allocations")
    op.drop_index("ix_allocations_host_id_released_at", table_name="allocations")
