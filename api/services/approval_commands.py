"""Which accepted maintenance approvals the agents are asked to carry out: the desired state's part of them.

An approval is a command to the agents of its job's hosts, and it travels as desired state (`AssignedJob.approvals`)
rather than as a message: agents are level-triggered on their host's assignment, so one that restarts, reconnects
or missed an update still finds every approval that awaits an outcome, and the shared-host rule (approve only when
every tenant on the host has) is a look at one assignment, which lists every tenant's jobs there. An approval stays
until its outcome is final, and at most `APPROVAL_TTL` after the accept: clouds announce a maintenance that can be
approved at most minutes ahead (Azure: ~15 min), so by then it has started anyway.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from api.models_approvals import OPEN_APPROVALS, MaintenanceApprovalRow
from harmonaize.desired_state import MaintenanceApproval

__all__ = ["APPROVAL_TTL", "MAX_OPEN_APPROVALS", "JobKey", "open_approvals"]

APPROVAL_TTL = timedelta(minutes=30)
"""How long an accepted approval waits for an outcome before the sweeper records it as failed."""

MAX_OPEN_APPROVALS = 16
"""Open approvals one job may have: the accept refuses more (a job has a handful of notices at most), so a tenant
cannot grow the assignment of a host it shares with others without bound."""

JobKey = tuple[str, str]
"""(tenant, job)."""


async def open_approvals(
    session: AsyncSession, jobs: set[JobKey], *, now: datetime
) -> dict[JobKey, tuple[MaintenanceApproval, ...]]:
    """The approvals awaiting an outcome for each of `jobs` (oldest first); jobs without any are left out.

    Open approvals are few at any time (minutes each), so one indexed query over all of them is cheaper than a join
    per host.
    """
    if not jobs:
        return {}
    rows = await session.scalars(
        select(MaintenanceApprovalRow)
        .where(
            MaintenanceApprovalRow.status.in_(OPEN_APPROVALS),
            MaintenanceApprovalRow.accepted_at > now - APPROVAL_TTL,
        )
        .order_by(MaintenanceApprovalRow.accepted_at, MaintenanceApprovalRow.negotiation_id)
    )
    found: dict[JobKey, list[MaintenanceApproval]] = {}
    for row in rows:
        key = (row.tenant_id, row.job_id)
        if key in jobs:
            found.setdefault(key, []).append(MaintenanceApproval(negotiation=row.negotiation_id, notice=row.notice_id))
    return {key: tuple(approvals[:MAX_OPEN_APPROVALS]) for key, approvals in found.items()}
