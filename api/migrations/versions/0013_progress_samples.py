"""Progress over time: a job's step, loss and rate kept as downsampled samples, for its curves.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02

- job_progress_samples: one row per kept sample (api/models_job_runs.py).
- job_status.sampled_at: when the job's latest sample was taken, so a report decides without a read whether to add one.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_progress_samples",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=63), nullable=False),
        sa.Column("job_id", sa.String(length=63), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("samples_per_s", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id", "job_id"],
            ["jobs.tenant_id", "jobs.id"],
            name=op.f("fk_job_progress_samples_tenant_id_job_id_jobs"),
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_progress_samples")),
    )
    op.create_index(
        "ix_job_progress_samples_tenant_id_job_id_id", "job_progress_samples", ["tenant_id", "job_id", "id"]
    )
    with op.batch_alter_table("job_status") as batch:
        batch.add_column(sa.Column("sampled_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_status") as batch:
        batch.drop_column("sampled_at")
    op.drop_index("ix_job_progress_samples_tenant_id_job_id_id", table_name="job_progress_samples")
    op.drop_table("job_progress_samples")
