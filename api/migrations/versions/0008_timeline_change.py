"""How the job got into each shape of its timeline, and how long the change stood it still.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

- job_timeline: `change` (fresh, checkpoint, in_place; NULL in rows written before it was reported) and `pause_s`
  (in place: how long the running ranks stood still for the change).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CHANGES = ("fresh", "checkpoint", "in_place")


def upgrade() -> None:
    with op.batch_alter_table("job_timeline") as batch:
        batch.add_column(
            sa.Column(
                "change",
                sa.Enum(*CHANGES, name="epoch_change", native_enum=False, create_constraint=True, length=16),
                nullable=True,
            )
        )
        batch.add_column(sa.Column("pause_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_timeline") as batch:
        batch.drop_constraint(op.f("ck_job_timeline_epoch_change"), type_="check")
        batch.drop_column("pause_s")
        batch.drop_column("change")
