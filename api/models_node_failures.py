"""The node failures table, beside `api.models` (which imports this module, so its metadata always has the table).

A module of its own only to keep `api.models` small; the conventions are that module's.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Boolean, ForeignKey, ForeignKeyConstraint, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from api.models import ID_LENGTH, Base, UtcDateTime, _enum
from harmonaize.node_failures import NodeFailureReason

__all__ = ["JobNodeFailure"]


class JobNodeFailure(Base):
    """A job's node that failed on a healthy host (hung, or out of restarts), as its launcher reported it.

    One row per node and placement epoch (the unique key makes a repeated report a no-op). `released` says whether the
    node's workers left the job (a hung node's do, like a failed host's; a node out of restarts keeps its place).
    `detail` is for the provider (which worker, how long, which bound); the tenant sees kind, reason, step and times.
    """

    __tablename__ = "job_node_failures"
    __table_args__ = (
        ForeignKeyConstraint(["tenant_id", "job_id"], ["jobs.tenant_id", "jobs.id"], ondelete="RESTRICT"),
        UniqueConstraint("tenant_id", "job_id", "host_id", "epoch"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    job_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    host_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("hosts.id", ondelete="RESTRICT"))
    epoch: Mapped[int] = mapped_column(Integer)
    reason: Mapped[NodeFailureReason] = mapped_column(_enum(NodeFailureReason, "node_failure_reason", 16))
    step: Mapped[int | None] = mapped_column(Integer, default=None)
    released: Mapped[bool] = mapped_column(Boolean)
    detail: Mapped[str] = mapped_column(String(500), default="")
    detected_at: Mapped[datetime] = mapped_column(UtcDateTime())
    reported_at: Mapped[datetime] = mapped_column(UtcDateTime())
