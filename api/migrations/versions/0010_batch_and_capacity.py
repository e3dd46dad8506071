"""A job's global batch, the capacity view its tenant was last told, and when a host last came back up.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02

- jobs.global_batch: NULL (not kept) or >= 1, the samples per optimizer step the job's runtime keeps.
- jobs.capacity_digest: a digest of the last capacity event published for the job (NULL: none yet).
- hosts.up_at: when the host was last reported back up after an outage (a job's quarantine of it ends there).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("global_batch", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("capacity_digest", sa.String(length=64), nullable=True))
        batch.create_check_constraint(
            op.f("ck_jobs_global_batch_positive"), "global_batch IS NULL OR global_batch >= 1"
        )
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("up_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("up_at")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint(op.f("ck_jobs_global_batch_positive"), type_="check")
        batch.drop_column("capacity_digest")
        batch.drop_column("global_batch")
