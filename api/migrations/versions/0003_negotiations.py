"""Negotiations: agreed job size, per-job cap, deferred reservations, negotiation history, idempotency, outbox.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

- jobs: `desired_workers` (the agreed size, 0 = not placed) and `allocated_gpus` (the job's total in the capacity
  ledger). CHECKs cap the job at `max_workers` and keep allocations whole workers, so the ledger's conditional UPDATE
  on the job row has a database backstop, exactly like `hosts.allocated_gpus <= gpus`.
- hosts: `generation` and `assigned_at` of the last desired-state assignment written for the host.
- allocations: `starts_at`, for capacity reserved now for a later, agreed start.
- negotiations, negotiation_rounds, idempotency_keys, outbox (see api/models.py for what each holds).

Existing jobs get their totals from their live allocations. That is only possible when those allocations are whole
workers within `max_workers` (nothing enforced that before this revision): otherwise the upgrade refuses, naming the
jobs, rather than invent a size.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=63)
NEGOTIATION_ID = sa.String(length=36)
KINDS = ("scale", "repartition", "defer", "migrate_region")
STATES = ("offered", "accepted", "rejected", "declined", "cancelled", "expired")
ACTORS = ("tenant", "provider")
ACTIONS = ("request", "offer", "decline", "counter", "accept", "reject", "cancel", "expire")
TOPICS = ("tenant_event", "desired_state")

_LIVE_GPUS = (
    "(SELECT COALESCE(SUM(a.gpus), 0) FROM allocations a "
    "WHERE a.tenant_id = jobs.tenant_id AND a.job_id = jobs.id AND a.released_at IS NULL)"
)


def _timestamp(name: str, *, nullable: bool = False) -> sa.Column[datetime]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _enum(name: str, values: Sequence[str]) -> sa.Enum:
    return sa.Enum(*values, name=name, native_enum=False, create_constraint=True, length=16)


def _refuse_jobs_that_are_not_whole_workers() -> None:
    bad = op.get_bind().execute(
        sa.text(
            f"SELECT tenant_id, id FROM jobs WHERE {_LIVE_GPUS} % gpus_per_worker <> 0 "
            f"OR {_LIVE_GPUS} > max_workers * gpus_per_worker ORDER BY tenant_id, id LIMIT 20"
        )
    ).all()
    if bad:
        jobs = ", ".join(f"{tenant}/{job}" for tenant, job in bad)
        raise RuntimeError(
            "cannot upgrade to 0003: these jobs hold allocations that are not whole workers within max_workers "
            f"(release or fix them first): {jobs}"
        )


def _upgrade_existing_tables() -> None:
    _refuse_jobs_that_are_not_whole_workers()
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("desired_workers", sa.Integer(), server_default=sa.text("0"), nullable=False))
        batch.add_column(sa.Column("allocated_gpus", sa.Integer(), server_default=sa.text("0"), nullable=False))
    op.execute(
        sa.text(
            f"UPDATE jobs SET allocated_gpus = {_LIVE_GPUS}, desired_workers = {_LIVE_GPUS} / gpus_per_worker"
        )
    )
    with op.batch_alter_table("jobs") as batch:
        batch.create_check_constraint(
            op.f("ck_jobs_desired_workers_within_max"), "desired_workers >= 0 AND desired_workers <= max_workers"
        )
        batch.create_check_constraint(
            op.f("ck_jobs_allocated_whole_workers"), "allocated_gpus = desired_workers * gpus_per_worker"
        )
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("generation", sa.Integer(), server_default=sa.text("0"), nullable=False))
        batch.add_column(_timestamp("assigned_at", nullable=True))
    with op.batch_alter_table("allocations") as batch:
        batch.add_column(_timestamp("starts_at", nullable=True))


def upgrade() -> None:
    _upgrade_existing_tables()
    op.create_table(
        "negotiations",
        sa.Column("id", NEGOTIATION_ID, nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("job_id", ID, nullable=False),
        sa.Column("kind", _enum("negotiation_kind", KINDS), nullable=False),
        sa.Column("state", _enum("negotiation_state", STATES), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("terms", sa.JSON(), nullable=False),
        sa.Column("offer", sa.JSON(), nullable=True),
        _timestamp("expires_at", nullable=True),
        sa.Column("accepted_option", sa.Integer(), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.CheckConstraint("round >= 1", name=op.f("ck_negotiations_round_positive")),
        sa.ForeignKeyConstraint(
            ["tenant_id", "job_id"],
            ["jobs.tenant_id", "jobs.id"],
            name=op.f("fk_negotiations_tenant_id_job_id_jobs"),
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_negotiations")),
    )
    op.create_index("ix_negotiations_tenant_id_created_at_id", "negotiations", ["tenant_id", "created_at", "id"])
    op.create_index("ix_negotiations_tenant_id_job_id", "negotiations", ["tenant_id", "job_id"])
    op.create_index("ix_negotiations_state_expires_at", "negotiations", ["state", "expires_at"])
    op.create_table(
        "negotiation_rounds",
        sa.Column("negotiation_id", NEGOTIATION_ID, nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("actor", _enum("negotiation_actor", ACTORS), nullable=False),
        sa.Column("action", _enum("negotiation_action", ACTIONS), nullable=False),
        _timestamp("at"),
        sa.Column("terms", sa.JSON(), nullable=True),
        sa.Column("offer", sa.JSON(), nullable=True),
        sa.Column("option", sa.Integer(), nullable=True),
        sa.Column("note", sa.String(length=500), nullable=True),
        sa.ForeignKeyConstraint(
            ["negotiation_id"],
            ["negotiations.id"],
            name=op.f("fk_negotiation_rounds_negotiation_id_negotiations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("negotiation_id", "seq", name=op.f("pk_negotiation_rounds")),
    )
    op.create_table(
        "idempotency_keys",
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("response_status", sa.Integer(), nullable=False),
        sa.Column("response_body", sa.JSON(), nullable=True),
        _timestamp("created_at"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_idempotency_keys_tenant_id_tenants"), ondelete="RESTRICT"
        ),
        sa.PrimaryKeyConstraint("tenant_id", "key", name=op.f("pk_idempotency_keys")),
    )
    op.create_table(
        "outbox",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("topic", _enum("outbox_topic", TOPICS), nullable=False),
        sa.Column("subject", sa.String(length=255), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("msg_id", sa.String(length=128), nullable=False),
        _timestamp("created_at"),
        _timestamp("delivered_at", nullable=True),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_error", sa.String(length=500), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox")),
    )
    op.create_index("ix_outbox_delivered_at_id", "outbox", ["delivered_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_outbox_delivered_at_id", table_name="outbox")
    op.drop_table("outbox")
    op.drop_table("idempotency_keys")
    op.drop_table("negotiation_rounds")
    op.drop_index("ix_negotiations_state_expires_at", table_name="negotiations")
    op.drop_index("ix_negotiations_tenant_id_job_id", table_name="negotiations")
    op.drop_index("ix_negotiations_tenant_id_created_at_id", table_name="negotiations")
    op.drop_table("negotiations")
    with op.batch_alter_table("allocations") as batch:
        batch.drop_column("starts_at")
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("assigned_at")
        batch.drop_column("generation")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint(op.f("ck_jobs_allocated_whole_workers"), type_="check")
        batch.drop_constraint(op.f("ck_jobs_desired_workers_within_max"), type_="check")
        batch.drop_column("allocated_gpus")
        batch.drop_column("desired_workers")
