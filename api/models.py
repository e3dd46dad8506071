"""The control plane's tables, as SQLAlchemy 2 typed declarative models.

These models are the *description* the code queries through; the schema itself is created only by the Alembic
migrations in `api/migrations/`, and a test checks that both agree (`compare_metadata` finds no difference).

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
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, query_expression
from sqlalchemy.types import TypeDecorator

from harmonaize.desired_state import RestartMode
from harmonaize.jobs import DirectiveState, JobPhase, ParallelPlan
from harmonaize.negotiation import Actor, NegotiationKind, NegotiationState, RoundAction

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


def _enum(enum_class: type[enum.Enum], name: str, length: int) -> Enum:
    """A string column limited to the enum's values by a CHECK (portable: no native PostgreSQL enum types)."""
    return Enum(
        enum_class,
        name=name,
        native_enum=False,
        create_constraint=True,
        length=length,
        values_callable=lambda members: [member.value for member in members],
    )


class Job(Base):
    """A tenant's elastic training job and the ranges within which the provider may tune it.

    A NULL batch-size range means the provider may not change the batch size (it has no default to fall back on).
    `desired_workers` is the agreed size (0: not placed); `allocated_gpus` is the job's running total in the capacity
    ledger. The CHECKs tie them together (every allocation is whole workers) and cap the job at `max_workers`, so no
    code path can grant a job more than the tenant allowed, even under concurrency.
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
        CheckConstraint("global_batch IS NULL OR global_batch >= 1", name="global_batch_positive"),
        CheckConstraint(
            "powersgd_max_rank IS NULL OR powersgd_max_rank >= 1", name="powersgd_max_rank_positive"
        ),
        CheckConstraint(
            "desired_workers >= 0 AND desired_workers <= max_workers", name="desired_workers_within_max"
        ),
        CheckConstraint("allocated_gpus = desired_workers * gpus_per_worker", name="allocated_whole_workers"),
    )

    tenant_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("tenants.id", ondelete="RESTRICT"), primary_key=True
    )
    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    min_workers: Mapped[int] = mapped_column(Integer)
    max_workers: Mapped[int] = mapped_column(Integer)
    gpus_per_worker: Mapped[int] = mapped_column(Integer)
    parallel_plan: Mapped[ParallelPlan] = mapped_column(_enum(ParallelPlan, "parallel_plan", 8))
    checkpoint_interval_steps_min: Mapped[int] = mapped_column(Integer)
    checkpoint_interval_steps_max: Mapped[int] = mapped_column(Integer)
    compression_allowed: Mapped[list[str]] = mapped_column(JSON)
    powersgd_max_rank: Mapped[int | None] = mapped_column(Integer, default=None)
    batch_size_min: Mapped[int | None] = mapped_column(Integer, default=None)
    batch_size_max: Mapped[int | None] = mapped_column(Integer, default=None)
    grad_accumulation_min: Mapped[int] = mapped_column(Integer)
    grad_accumulation_max: Mapped[int] = mapped_column(Integer)
    global_batch: Mapped[int | None] = mapped_column(Integer, default=None)
    capacity_digest: Mapped[str | None] = mapped_column(String(64), default=None)
    """Of the last capacity event its tenant was sent (`api.services.capacity_events`); None: none yet."""
    desired_workers: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    allocated_gpus: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    entrypoint: Mapped[list[str]] = mapped_column(JSON, default=list, server_default=text("'[]'"))
    placement: Mapped[dict[str, object] | None] = mapped_column(JSON, default=None)
    placement_epoch: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    restart_mode: Mapped[RestartMode] = mapped_column(
        _enum(RestartMode, "restart_mode", 16), default=RestartMode.GRACEFUL, server_default=RestartMode.GRACEFUL.value
    )
    directives: Mapped[dict[str, object] | None] = mapped_column(JSON, default=None)
    phase: Mapped[JobPhase] = mapped_column(
        _enum(JobPhase, "job_phase", 16), default=JobPhase.PENDING, server_default=JobPhase.PENDING.value
    )
    """Where the job stands; changed only through `api.services.job_lifecycle`."""
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    left_hosts_recently: Mapped[bool | None] = query_expression()
    """Not a column: whether the job moved off a host within the quarantine, where the read that loaded it asked
    (`models_quarantines.left_recently`), so an offer knows without a statement that none is to be avoided; None
    where it did not ask."""


class Host(Base):
    """A GPU host. `allocated_gpus` is the capacity ledger's running total, guarded by a CHECK constraint.

    `generation` counts the desired-state assignments written for the host (agents tell a new decision from a replay
    by it); `assigned_at` is when the last one was computed, so reservations that start later can be announced once.
    """

    __tablename__ = "hosts"
    __table_args__ = (
        CheckConstraint("gpus > 0", name="gpus_positive"),
        CheckConstraint("allocated_gpus >= 0 AND allocated_gpus <= gpus", name="allocated_within_capacity"),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    gpus: Mapped[int] = mapped_column(Integer)
    locality_group: Mapped[str] = mapped_column(String(ID_LENGTH), index=True)
    allocated_gpus: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    generation: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    assigned_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), default=None)
    down_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), default=None)
    up_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), default=None)
    """When it was last reported back up after an outage: a job's quarantine of the host ends there."""
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class Allocation(Base):
    """GPUs of one host granted to one job; `released_at` set once they are given back (rows are never deleted).

    `starts_at` (NULL: at once) is set for capacity reserved now for an agreed later start: the GPUs count against
    the host from the moment of agreement, the workers appear in the host's desired state from `starts_at`.
    """

    __tablename__ = "allocations"
    __table_args__ = (
        CheckConstraint("gpus > 0", name="gpus_positive"),
        ForeignKeyConstraint(
            ["tenant_id", "job_id"], ["jobs.tenant_id", "jobs.id"], ondelete="RESTRICT"
        ),
        # with the release time: every ledger read wants the live rows only (migration 0016)
        Index("ix_allocations_tenant_id_job_id_released_at", "tenant_id", "job_id", "released_at"),
        Index("ix_allocations_host_id_released_at", "host_id", "released_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    job_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    host_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("hosts.id", ondelete="RESTRICT")
    )
    gpus: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    starts_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), default=None)
    released_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), default=None)



class Negotiation(Base):
    """One negotiation about one job: its current state, latest terms and offer (the rounds keep the history).

    `version` is bumped by every change; changes are conditional UPDATEs on (id, state, version), so two concurrent
    answers to one offer cannot both win. `accepted_option` is an index into `offer["options"]`.
    """

    __tablename__ = "negotiations"
    __table_args__ = (
        CheckConstraint("round >= 1", name="round_positive"),
        ForeignKeyConstraint(["tenant_id", "job_id"], ["jobs.tenant_id", "jobs.id"], ondelete="RESTRICT"),
        Index("ix_negotiations_tenant_id_created_at_id", "tenant_id", "created_at", "id"),
        Index("ix_negotiations_tenant_id_job_id", "tenant_id", "job_id"),
        Index("ix_negotiations_state_expires_at", "state", "expires_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    job_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    kind: Mapped[NegotiationKind] = mapped_column(_enum(NegotiationKind, "negotiation_kind", 32))
    state: Mapped[NegotiationState] = mapped_column(_enum(NegotiationState, "negotiation_state", 16))
    round: Mapped[int] = mapped_column(Integer)
    terms: Mapped[dict[str, object]] = mapped_column(JSON)
    offer: Mapped[dict[str, object] | None] = mapped_column(JSON, default=None)
    expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), default=None)
    accepted_option: Mapped[int | None] = mapped_column(Integer, default=None)
    version: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime())


class NegotiationRound(Base):
    """One step of a negotiation, as it happened: who did what, when, with which terms or offer."""

    __tablename__ = "negotiation_rounds"
    __table_args__ = (PrimaryKeyConstraint("negotiation_id", "seq"),)

    negotiation_id: Mapped[str] = mapped_column(String(36), ForeignKey("negotiations.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    round: Mapped[int] = mapped_column(Integer)
    actor: Mapped[Actor] = mapped_column(_enum(Actor, "negotiation_actor", 16))
    action: Mapped[RoundAction] = mapped_column(_enum(RoundAction, "negotiation_action", 16))
    at: Mapped[datetime] = mapped_column(UtcDateTime())
    terms: Mapped[dict[str, object] | None] = mapped_column(JSON, default=None)
    offer: Mapped[dict[str, object] | None] = mapped_column(JSON, default=None)
    option: Mapped[int | None] = mapped_column(Integer, default=None)
    note: Mapped[str | None] = mapped_column(String(500), default=None)


class IdempotencyKey(Base):
    """The first response to a tenant's idempotency key, replayed for every retry of the same request."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (PrimaryKeyConstraint("tenant_id", "key"),)

    tenant_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("tenants.id", ondelete="RESTRICT"))
    key: Mapped[str] = mapped_column(String(200))
    fingerprint: Mapped[str] = mapped_column(String(64))
    response_status: Mapped[int] = mapped_column(Integer)
    response_body: Mapped[dict[str, object] | None] = mapped_column(JSON, default=None)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())


class OutboxTopic(enum.StrEnum):
    TENANT_EVENT = "tenant_event"  # a CloudEvent for a tenant's stream (subject = NATS subject)
    DESIRED_STATE = "desired_state"  # a HostAssignment for the desired-state KV bucket (subject = key)


class OutboxMessage(Base):
    """A message to publish, written in the transaction that decided it; the relay delivers it afterwards.

    The integer id gives the delivery order. Rows are kept after delivery (`delivered_at`) as an audit trail.
    """

    __tablename__ = "outbox"
    __table_args__ = (Index("ix_outbox_delivered_at_id", "delivered_at", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    topic: Mapped[OutboxTopic] = mapped_column(_enum(OutboxTopic, "outbox_topic", 16))
    subject: Mapped[str] = mapped_column(String(255))
    payload: Mapped[bytes] = mapped_column(LargeBinary)
    msg_id: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    delivered_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), default=None)
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    last_error: Mapped[str | None] = mapped_column(String(500), default=None)


class JobDirective(Base):
    """One micro-loop decision about a job: the full settings it asked for, and what became of it.

    A proposal the control plane refused (outside the tenant's ranges) is kept with `version` NULL: it was never
    issued. An issued version is later marked applied or refused by the job's runtime, at `step`.
    """

    __tablename__ = "job_directives"
    __table_args__ = (
        ForeignKeyConstraint(["tenant_id", "job_id"], ["jobs.tenant_id", "jobs.id"], ondelete="RESTRICT"),
        Index("ix_job_directives_tenant_id_job_id_created_at", "tenant_id", "job_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    job_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    version: Mapped[int | None] = mapped_column(Integer, default=None)
    state: Mapped[DirectiveState] = mapped_column(_enum(DirectiveState, "directive_state", 16))
    settings: Mapped[dict[str, object]] = mapped_column(JSON)
    reason: Mapped[str] = mapped_column(String(500), default="")
    refusals: Mapped[list[str]] = mapped_column(JSON, default=list)
    step: Mapped[int | None] = mapped_column(Integer, default=None)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime())


import api.models_approvals  # noqa: E402,F401  (its table, on the same metadata; a module of its own for size)
import api.models_job_runs  # noqa: E402,F401  (the same)
import api.models_node_failures  # noqa: E402,F401  (the same)
import api.models_quarantines  # noqa: E402,F401  (the same)
import api.models_rate_buckets  # noqa: E402,F401  (the same)
import api.models_standby  # noqa: E402,F401  (the same)
