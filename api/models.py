"""The control plane's tables, as SQLAlchemy 2 typed declarative models.

These models are the *description* the code queries through; the schema itself is created only by the Alembic
migrations in `migrations/`, and a test checks that both agree (`compare_metadata` finds no difference).

Invariants live in the database wherever it can hold them, because the API is not the only writer that matters under
concurrency: two requests that each checked "there is room" in Python can both be wrong, a CHECK constraint cannot.
Hence `0 <= allocated_gpus <= gpus` on hosts, `1 <= min <= max` on every tenant range, and a composite foreign key
that makes an allocation's tenant the same as its job's tenant.

Jobs are keyed by (tenant_id, id): a job id is the tenant's own name, unique only within that tenant, so two tenants
may both call their job `train` and neither learns that the other exists. Allocation ids are random, never sequential,
so they reveal nothing about how busy the provider is.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime

from sqlalchemy import (
    JSON,
    CheckConstraint,
    DateTime,
    Enum,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from harmonaize.jobs import Compression, ParallelPlan

ID_LENGTH = 63
"""Longest tenant, job or host id (see harmonaize.ids)."""

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
"""Deterministic constraint names, so migrations (and SQLite batch mode, which recreates tables) can refer to them."""


def utcnow() -> datetime:
    """Timestamps are always timezone-aware UTC."""
    return datetime.now(UTC)


class UtcDateTime(TypeDecorator[datetime]):
    """A timestamp that is aware UTC on the way in and on the way out, on every backend.

    SQLite stores no offset and hands back naive values; PostgreSQL hands back the session's time zone. Normalising
    here keeps comparisons and JSON output identical across both.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetimes are ambiguous; pass an aware (UTC) datetime")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)




class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _range_checks(prefix: str) -> tuple[CheckConstraint, CheckConstraint]:
    """`1 <= <prefix>_min <= <prefix>_max`: a tenant's range is never empty and never below one."""
    return (
        CheckConstraint(f"{prefix}_min >= 1", name=f"{prefix}_min_positive"),
        CheckConstraint(f"{prefix}_min <= {prefix}_max", name=f"{prefix}_range"),
    )


class Tenant(Base):
    """A customer. Its API token is stored only as a SHA-256 hash; its NATS user only as a public key."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    display_name: Mapped[str] = mapped_column(String(200))
    token_id: Mapped[str] = mapped_column(String(32), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64))
    nats_user_public_key: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), default=None)


class Job(Base):
    """A tenant's elastic training job and the ranges within which the provider may tune it.

    A NULL batch-size range means the provider may not change the batch size (it has no default to fall back on).
    """

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint("min_workers >= 1", name="min_workers_positive"),
        CheckConstraint("min_workers <= max_workers", name="workers_range"),
        CheckConstraint("gpus_per_worker >= 1", name="gpus_per_worker_positive"),
        *_range_checks("checkpoint_interval_steps"),
        *_range_checks("batch_size"),
        CheckConstraint(
            "(batch_size_min IS NULL AND batch_size_max IS NULL) OR "
            "(batch_size_min IS NOT NULL AND batch_size_max IS NOT NULL)",
            name="batch_size_both_or_neither",
        ),
        *_range_checks("grad_accumulation"),
        CheckConstraint(
            "powersgd_max_rank IS NULL OR powersgd_max_rank >= 1", name="powersgd_max_rank_positive"
        ),
    )

    tenant_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("tenants.id", ondelete="RESTRICT"), primary_key=True
    )
    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    min_workers: Mapped[int] = mapped_column(Integer)
    max_workers: Mapped[int] = mapped_column(Integer)
    gpus_per_worker: Mapped[int] = mapped_column(Integer)
    parallel_plan: Mapped[ParallelPlan] = mapped_column(
        Enum(
            ParallelPlan,
            name="parallel_plan",
            native_enum=False,
            create_constraint=True,
            length=8,
            values_callable=lambda plans: [plan.value for plan in plans],
        )
    )
    checkpoint_interval_steps_min: Mapped[int] = mapped_column(Integer)
    checkpoint_interval_steps_max: Mapped[int] = mapped_column(Integer)
    compression_allowed: Mapped[list[str]] = mapped_column(JSON)
    powersgd_max_rank: Mapped[int | None] = mapped_column(Integer, default=None)
    batch_size_min: Mapped[int | None] = mapped_column(Integer, default=None)
    batch_size_max: Mapped[int | None] = mapped_column(Integer, default=None)
    grad_accumulation_min: Mapped[int] = mapped_column(Integer)
    grad_accumulation_max: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class Host(Base):
    """A GPU host. `allocated_gpus` is the capacity ledger's running total, guarded by a CHECK constraint."""

    __tablename__ = "hosts"
    __table_args__ = (
        CheckConstraint("gpus > 0", name="gpus_positive"),
        CheckConstraint("allocated_gpus >= 0 AND allocated_gpus <= gpus", name="allocated_within_capacity"),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    gpus: Mapped[int] = mapped_column(Integer)
    locality_group: Mapped[str] = mapped_column(String(ID_LENGTH), index=True)
    allocated_gpus: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class Allocation(Base):
    """GPUs of one host granted to one job; `released_at` set once they are given back (rows are never deleted)."""

    __tablename__ = "allocations"
    __table_args__ = (
        CheckConstraint("gpus > 0", name="gpus_positive"),
        ForeignKeyConstraint(
            ["tenant_id", "job_id"], ["jobs.tenant_id", "jobs.id"], ondelete="RESTRICT"
        ),
        Index("ix_allocations_tenant_id_job_id", "tenant_id", "job_id"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    job_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    host_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("hosts.id", ondelete="RESTRICT"), index=True
    )
    gpus: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    released_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), default=None)

