"""A job's batch-size range becomes optional: absent means the provider may not change the batch size.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

There is no meaningful default batch size (it belongs to the job), so a job that states no range now stores NULLs
instead of a made-up value. A CHECK keeps the pair together: both bounds or neither. SQLite applies this in batch
mode (it recreates the table), which env.py turns on for it.

Downgrading needs a value for every job; it refuses, naming the jobs, rather than invent one.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BOTH_OR_NEITHER = "(batch_size_min IS NULL AND batch_size_max IS NULL) OR " \
    "(batch_size_min IS NOT NULL AND batch_size_max IS NOT NULL)"


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("batch_size_min", existing_type=sa.Integer(), nullable=True)
        batch.alter_column("batch_size_max", existing_type=sa.Integer(), nullable=True)
        batch.create_check_constraint(op.f("ck_jobs_batch_size_both_or_neither"), BOTH_OR_NEITHER)


def downgrade() -> None:
    unset = op.get_bind().execute(
        sa.text("SELECT tenant_id, id FROM jobs WHERE batch_size_min IS NULL ORDER BY tenant_id, id LIMIT 20")
    ).all()
    if unset:
        jobs = ", ".join(f"{tenant}/{job}" for tenant, job in unset)
        raise RuntimeError(f"cannot downgrade below 0002: these jobs have no batch_size range: {jobs}")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint(op.f("ck_jobs_batch_size_both_or_neither"), type_="check")
        batch.alter_column("batch_size_min", existing_type=sa.Integer(), nullable=False)
        batch.alter_column("batch_size_max", existing_type=sa.Integer(), nullable=False)
