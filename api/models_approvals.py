"""The maintenance approvals table, beside `api.models` (which imports this module, so its metadata always has it).

A module of its own only to keep `api.models` small; the conventions are that module's.
"""

from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import ForeignKey, ForeignKeyConstraint, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from api.models import ID_LENGTH, Base, UtcDateTime, _enum

__all__ = ["OPEN_APPROVALS", "ApprovalStatus", "MaintenanceApprovalRow"]


class ApprovalStatus(enum.StrEnum):
    """Where an accepted approval stands; changed only through `api.services.approval_lifecycle`."""

    QUEUED = "queued"  # in the job's hosts' desired state; no agent has reported yet
    PENDING = "pending"  # an agent has the notice, but not every tenant on its host has approved it yet
    APPROVED = "approved"  # the cloud accepted the early start (final)
    FAILED = "failed"  # no early start; the round's note says why (final)


OPEN_APPROVALS = (ApprovalStatus.QUEUED, ApprovalStatus.PENDING)
"""Statuses whose approval is still in its job's hosts' desired state."""


class MaintenanceApprovalRow(Base):
    """An accepted `approve_maintenance` negotiation, from the accept until the agents' outcome.

    While open (`OPEN_APPROVALS`) and younger than `approval_commands.APPROVAL_TTL`, it is part of the desired state
    of every host of its job (`AssignedJob.approvals`). `notice_id` is the tenant's pseudonym of the notice: the
    control plane cannot map it to a cloud notice, the agents holding the notice can.
    """

    __tablename__ = "maintenance_approvals"
    __table_args__ = (
        ForeignKeyConstraint(["tenant_id", "job_id"], ["jobs.tenant_id", "jobs.id"], ondelete="RESTRICT"),
        Index("ix_maintenance_approvals_status", "status"),
    )

    negotiation_id: Mapped[str] = mapped_column(
        String(36), ForeignKey("negotiations.id", ondelete="CASCADE"), primary_key=True
    )
    tenant_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    job_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    notice_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    status: Mapped[ApprovalStatus] = mapped_column(_enum(ApprovalStatus, "approval_status", 16))
    accepted_at: Mapped[datetime] = mapped_column(UtcDateTime())
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime())
