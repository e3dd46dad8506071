"""Maintenance approvals: a negotiation kind, the agents' outcome rounds, and the approvals awaiting an outcome.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02

- negotiations.kind: also `approve_maintenance` (19 characters: the column grows from 16 to 32).
- negotiation_rounds.action: also `approval_pending`, `approved` and `approval_failed`, the provider's rounds that
  record what became of an accepted approval.
- maintenance_approvals: one row per accepted approval, from the accept until its outcome (api/models_approvals.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KINDS_BEFORE = ("scale", "repartition", "defer", "migrate_region")
KINDS_AFTER = (*KINDS_BEFORE, "approve_maintenance")
ACTIONS_BEFORE = ("request", "offer", "decline", "counter", "accept", "reject", "cancel", "expire")
ACTIONS_AFTER = (*ACTIONS_BEFORE, "approval_pending", "approved", "approval_failed")
STATUSES = ("queued", "pending", "approved", "failed")


def _enum(name: str, values: Sequence[str], length: int = 16) -> sa.Enum:
    return sa.Enum(*values, name=name, native_enum=False, create_constraint=True, length=length)


def upgrade() -> None:
    # alter_column replaces the CHECK of `existing_type` with the new type's (on SQLite by rebuilding the table)
    with op.batch_alter_table("negotiations") as batch:
        batch.alter_column(
            "kind",
            type_=_enum("negotiation_kind", KINDS_AFTER, 32),
            existing_type=_enum("negotiation_kind", KINDS_BEFORE),
            existing_nullable=False,
        )
    with op.batch_alter_table("negotiation_rounds") as batch:
        batch.alter_column(
            "action",
            type_=_enum("negotiation_action", ACTIONS_AFTER),
            existing_type=_enum("negotiation_action", ACTIONS_BEFORE),
            existing_nullable=False,
        )
    op.create_table(
        "maintenance_approvals",
        sa.Column("negotiation_id", sa.String(length=36), nullable=False),
        sa.Column("tenant_id", sa.String(length=63), nullable=False),
        sa.Column("job_id", sa.String(length=63), nullable=False),
        sa.Column("notice_id", sa.String(length=63), nullable=False),
        sa.Column("status", _enum("approval_status", STATUSES), nullable=False),
        sa.Column("accepted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["negotiation_id"],
            ["negotiations.id"],
            name=op.f("fk_maintenance_approvals_negotiation_id_negotiations"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id", "job_id"],
            ["jobs.tenant_id", "jobs.id"],
            name=op.f("fk_maintenance_approvals_tenant_id_job_id_jobs"),
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("negotiation_id", name=op.f("pk_maintenance_approvals")),
    )
    op.create_index("ix_maintenance_approvals_status", "maintenance_approvals", ["status"])


def downgrade() -> None:
    op.drop_index("ix_maintenance_approvals_status", table_name="maintenance_approvals")
    op.drop_table("maintenance_approvals")
    new_actions = ", ".join(f"'{action}'" for action in ACTIONS_AFTER[len(ACTIONS_BEFORE):])
    op.execute(f"DELETE FROM negotiation_rounds WHERE action IN ({new_actions})")
    op.execute(
        "DELETE FROM negotiation_rounds WHERE negotiation_id IN "
        "(SELECT id FROM negotiations WHERE kind = 'approve_maintenance')"
    )
    op.execute("DELETE FROM standby_nodes WHERE negotiation_id IN "
               "(SELECT id FROM negotiations WHERE kind = 'approve_maintenance')")
    op.execute("DELETE FROM negotiations WHERE kind = 'approve_maintenance'")
    with op.batch_alter_table("negotiation_rounds") as batch:
        batch.alter_column(
            "action",
            type_=_enum("negotiation_action", ACTIONS_BEFORE),
            existing_type=_enum("negotiation_action", ACTIONS_AFTER),
            existing_nullable=False,
        )
    with op.batch_alter_table("negotiations") as batch:
        batch.alter_column(
            "kind",
            type_=_enum("negotiation_kind", KINDS_BEFORE),
            existing_type=_enum("negotiation_kind", KINDS_AFTER, 32),
            existing_nullable=False,
        )
