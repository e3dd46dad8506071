"""A node failure reason for in-place nodes that exit with an error: `crashed`.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

- job_node_failures.reason: also `crashed`. An in-place node is not restarted by its launcher (its peers have
  moved on without it), so its exit takes it out of the job like a hung node's; see api/services/node_failures.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BEFORE = ("frozen", "stalled", "out_of_restarts")
AFTER = (*BEFORE, "crashed")


def _reasons(values: tuple[str, ...]) -> sa.Enum:
    return sa.Enum(*values, name="node_failure_reason", native_enum=False, create_constraint=True, length=16)


def upgrade() -> None:
    # alter_column replaces the CHECK of `existing_type` with the new type's (on SQLite by rebuilding the table)
    with op.batch_alter_table("job_node_failures") as batch:
        batch.alter_column("reason", type_=_reasons(AFTER), existing_type=_reasons(BEFORE), existing_nullable=False)


def downgrade() -> None:
    op.execute("DELETE FROM job_node_failures WHERE reason = 'crashed'")
    with op.batch_alter_table("job_node_failures") as batch:
        batch.alter_column("reason", type_=_reasons(BEFORE), existing_type=_reasons(AFTER), existing_nullable=False)
