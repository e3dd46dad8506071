"""Committed outbox rows announce themselves on PostgreSQL (NOTIFY), so the relay of another replica wakes at once.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-03

- PostgreSQL only: a statement-level trigger on `outbox` runs `pg_notify('hz_outbox', '')` for every INSERT. A
  notification is sent when its transaction commits (never for one rolled back), and the same one raised several
  times in a transaction goes out once, so a request's commit wakes the leading relay once, whichever replica or
  code path wrote the rows (`api.services.relay_leadership`). Notifications stay inside the database, so two clouds
  on one server do not wake each other. SQLite has one API process per file, which wakes its own relay.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CHANNEL = "hz_outbox"
"""`api.services.relay_leadership.OUTBOX_CHANNEL` (a migration does not import the app)."""


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        "CREATE FUNCTION hz_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS "
        f"$$ BEGIN PERFORM pg_notify('{CHANNEL}', ''); RETURN NULL; END $$"
    )
    op.execute(
        "CREATE TRIGGER outbox_notify AFTER INSERT ON outbox "
        "FOR EACH STATEMENT EXECUTE FUNCTION hz_outbox_notify()"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER outbox_notify ON outbox")
    op.execute("DROP FUNCTION hz_outbox_notify()")
