"""The hosts a job moved off, kept as rows instead of read out of every accepted offer of the last hour.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03

- job_host_quarantines: one row per host an accepted replacement moved a job off (api/models_quarantines.py).
  The upgrade copies in the replacements accepted within the last hour (the quarantine's length), so a job does not
  grow back onto a host it just left because the control plane was upgraded; the downgrade drops the table (the
  accepted offers it was derived from are untouched).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

QUARANTINE = timedelta(hours=1)
"""`api.services.worker_replacement.QUARANTINE` when this revision was written (a migration does not import the app)."""

_NEGOTIATIONS = sa.table(
    "negotiations",
    sa.column("tenant_id", sa.String()),
    sa.column("job_id", sa.String()),
    sa.column("kind", sa.String()),
    sa.column("state", sa.String()),
    sa.column("offer", sa.JSON()),
    sa.column("accepted_option", sa.Integer()),
    sa.column("updated_at", sa.DateTime(timezone=True)),
)


def upgrade() -> None:
    quarantines = op.create_table(
        "job_host_quarantines",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=63), nullable=False),
        sa.Column("job_id", sa.String(length=63), nullable=False),
        sa.Column("host_name", sa.String(length=63), nullable=False),
        sa.Column("left_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id", "job_id"],
            ["jobs.tenant_id", "jobs.id"],
            name=op.f("fk_job_host_quarantines_tenant_id_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_host_quarantines")),
    )
    op.create_index(
        "ix_job_host_quarantines_tenant_id_job_id_left_at", "job_host_quarantines", ["tenant_id", "job_id", "left_at"]
    )
    op.create_index("ix_job_host_quarantines_left_at", "job_host_quarantines", ["left_at"])
    rows = _recent_replacements(datetime.now(UTC) - QUARANTINE)
    if rows:
        op.bulk_insert(quarantines, rows)


def _recent_replacements(since: datetime) -> list[dict[str, Any]]:
    """One row per host named by the accepted option of every scale negotiation accepted since `since`."""
    found = op.get_bind().execute(
        sa.select(
            _NEGOTIATIONS.c.tenant_id, _NEGOTIATIONS.c.job_id, _NEGOTIATIONS.c.offer,
            _NEGOTIATIONS.c.accepted_option, _NEGOTIATIONS.c.updated_at,
        ).where(
            _NEGOTIATIONS.c.kind == "scale",
            _NEGOTIATIONS.c.state == "accepted",
            _NEGOTIATIONS.c.accepted_option.is_not(None),
            _NEGOTIATIONS.c.updated_at >= since,
        )
    )
    rows: list[dict[str, Any]] = []
    for tenant_id, job_id, offer, index, accepted_at in found:
        offer = json.loads(offer) if isinstance(offer, str) else offer
        options = (offer or {}).get("options") or []
        if 0 <= index < len(options):
            for name in options[index].get("replaced_hosts") or ():
                left_at = accepted_at if accepted_at.tzinfo else accepted_at.replace(tzinfo=UTC)
                rows.append({"tenant_id": tenant_id, "job_id": job_id, "host_name": name, "left_at": left_at})
    return rows


def downgrade() -> None:
    op.drop_index("ix_job_host_quarantines_left_at", table_name="job_host_quarantines")
    op.drop_index("ix_job_host_quarantines_tenant_id_job_id_left_at", table_name="job_host_quarantines")
    op.drop_table("job_host_quarantines")
