"""The job's lifecycle phase, stored where the control plane changes it (see api/services/job_lifecycle.py).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

- jobs: `phase` (pending, placed, running, restarting, finished, failed). Existing jobs get the phase their stored
  state implies: pending without workers, placed before any progress, running when the latest progress is from the
  current epoch, restarting when it is from an earlier one. No earlier report said whether a run had finished and
  no node failure is judged here, so none starts out finished or failed.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PHASES = ("pending", "placed", "running", "restarting", "finished", "failed")

_STATUS = "SELECT 1 FROM job_status s WHERE s.tenant_id = jobs.tenant_id AND s.job_id = jobs.id"
BACKFILL = (
    "UPDATE jobs SET phase = CASE"
    " WHEN desired_workers = 0 THEN 'pending'"
    f" WHEN NOT EXISTS ({_STATUS}) THEN 'placed'"
    f" WHEN EXISTS ({_STATUS} AND s.epoch = jobs.placement_epoch) THEN 'running'"
    " ELSE 'restarting' END"
)


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(
            sa.Column(
                "phase",
                sa.Enum(*PHASES, name="job_phase", native_enum=False, create_constraint=True, length=16),
                server_default="pending",
                nullable=False,
            )
        )
    op.execute(BACKFILL)


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint(op.f("ck_jobs_job_phase"), type_="check")
        batch.drop_column("phase")
