"""What running jobs report: the latest progress of each and the shapes each ran in, beside `api.models` (which
imports this module, so its metadata always has the tables).

A module of its own only to keep `api.models` small; the conventions are that module's.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, Float, ForeignKeyConstraint, Index, Integer, PrimaryKeyConstraint, String
from sqlalchemy.orm import Mapped, mapped_column

from api.models import ID_LENGTH, Base, UtcDateTime, _enum
from harmonaize.job_runtime import EpochChange
from harmonaize.jobs import ParallelPlan

__all__ = ["JobProgressSample", "JobStatus", "JobTimelineEntry"]


class JobStatus(Base):
    """The latest progress a running job reported (one row per job), as its global rank 0 wrote it."""

    __tablename__ = "job_status"
    __table_args__ = (
        PrimaryKeyConstraint("tenant_id", "job_id"),
        ForeignKeyConstraint(["tenant_id", "job_id"], ["jobs.tenant_id", "jobs.id"], ondelete="RESTRICT"),
    )

    tenant_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    job_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    epoch: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    progress: Mapped[dict[str, object]] = mapped_column(JSON)
    reported_at: Mapped[datetime] = mapped_column(UtcDateTime())
    sampled_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), default=None)
    """When the job's latest `JobProgressSample` was taken (None: none yet)."""


class JobTimelineEntry(Base):
    """A shape the job actually ran in: from `step` on, at `world_size` with `parallel_plan` (epoch `epoch`)."""

    __tablename__ = "job_timeline"
    __table_args__ = (
        ForeignKeyConstraint(["tenant_id", "job_id"], ["jobs.tenant_id", "jobs.id"], ondelete="RESTRICT"),
        Index("ix_job_timeline_tenant_id_job_id_id", "tenant_id", "job_id", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    job_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    epoch: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    parallel_plan: Mapped[ParallelPlan] = mapped_column(_enum(ParallelPlan, "parallel_plan", 8))
    step: Mapped[int] = mapped_column(Integer)
    resumed_from_step: Mapped[int | None] = mapped_column(Integer, default=None)
    change: Mapped[EpochChange | None] = mapped_column(_enum(EpochChange, "epoch_change", 16), default=None)
    """How the job got into this shape (fresh, checkpoint, in_place); None in rows from before it was reported."""
    pause_s: Mapped[float | None] = mapped_column(Float, default=None)
    """How long the job stood still for the change (`JobProgress.pause_s`)."""
    at: Mapped[datetime] = mapped_column(UtcDateTime())


class JobProgressSample(Base):
    """The job's progress at one moment (step, loss, rate), kept over time for its curves; downsampled on write
    (`api.services.job_progress`), since a job reports several times a second."""

    __tablename__ = "job_progress_samples"
    __table_args__ = (
        ForeignKeyConstraint(["tenant_id", "job_id"], ["jobs.tenant_id", "jobs.id"], ondelete="RESTRICT"),
        Index("ix_job_progress_samples_tenant_id_job_id_id", "tenant_id", "job_id", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    job_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    at: Mapped[datetime] = mapped_column(UtcDateTime())
    epoch: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float, default=None)
    samples_per_s: Mapped[float | None] = mapped_column(Float, default=None)
