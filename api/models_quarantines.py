"""The hosts a job moved off, beside `api.models` (which imports this module, so its metadata always has the table).

A module of its own only to keep `api.models` small; the conventions are that module's.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Exists, ForeignKeyConstraint, Index, Integer, String, bindparam, exists
from sqlalchemy.orm import Mapped, mapped_column

from api.models import ID_LENGTH, Base, Job, UtcDateTime

__all__ = ["JobHostQuarantine", "left_recently"]


class JobHostQuarantine(Base):
    """A host an accepted replacement moved the job off (under the tenant's name for it, as the option named it),
    and when: the job's new workers stay off it for `worker_replacement.QUARANTINE` (`avoided_hosts`).

    Written only by an accept that replaces hosts, so every offer and every capacity sweep reads the few rows of the
    last hour instead of decoding every accepted offer of that hour (a job rescaled every few seconds had hundreds).
    Append-only: a host left twice has two rows, the latest counts; rows past the quarantine are pruned.
    """

    __tablename__ = "job_host_quarantines"
    __table_args__ = (
        ForeignKeyConstraint(["tenant_id", "job_id"], ["jobs.tenant_id", "jobs.id"], ondelete="CASCADE"),
        Index("ix_job_host_quarantines_tenant_id_job_id_left_at", "tenant_id", "job_id", "left_at"),
        Index("ix_job_host_quarantines_left_at", "left_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    job_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    host_name: Mapped[str] = mapped_column(String(ID_LENGTH))
    """The tenant's pseudonym of the host (`harmonaize.pseudonyms.host_pseudonym`), as the accepted option named it."""
    left_at: Mapped[datetime] = mapped_column(UtcDateTime())


def left_recently() -> Exists:
    """Whether a job has a row at or after `quarantine_since` (a parameter), for a read of the job to fill in
    `Job.left_hosts_recently` (`with_expression`): jobs rarely replace hosts, so most offers need no quarantine read."""
    return exists().where(
        JobHostQuarantine.tenant_id == Job.tenant_id,
        JobHostQuarantine.job_id == Job.id,
        JobHostQuarantine.left_at >= bindparam("quarantine_since"),
    )
