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

from sqlalchemy import bindparam, exists, select
from sqlalchemy.ext.asyncio import AsyncSession

from api.db import execute_core
from api.models_approvals import OPEN_APPROVALS, MaintenanceApprovalRow
from harmonaize.desired_state import MaintenanceApproval

__all__ = ["ANY_OPEN", "APPROVAL_TTL", "MAX_OPEN_APPROVALS", "JobKey", "open_approvals"]

APPROVAL_TTL = timedelta(minutes=30)
"""How long an accepted approval waits for an outcome before the sweeper records it as failed."""

MAX_OPEN_APPROVALS = 16
"""Open approvals one job may have: the accept refuses more (a job has a handful of notices at most), so a tenant
cannot grow the assignment of a host it shares with others without bound."""

_A = MaintenanceApprovalRow.__table__.c
_OPEN = (
    select(_A.tenant_id, _A.job_id, _A.negotiation_id, _A.notice_id)
    .where(_A.status.in_(OPEN_APPROVALS), _A.accepted_at > bindparam("since"))
    .order_by(_A.accepted_at, _A.negotiation_id)
)
"""Built once, on the table (`api.db.execute_core`): every host assignment written reads it."""
ANY_OPEN = exists().where(_A.status.in_(OPEN_APPROVALS), _A.accepted_at > bindparam("approvals_since"))
"""Whether any approval is open (`_OPEN` would find one), as a column for another statement to return: with none
open, as is usual, a host assignment skips the read (`approvals_since`: now - APPROVAL_TTL)."""

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
    found: dict[JobKey, list[MaintenanceApproval]] = {}
    for tenant_id, job_id, negotiation_id, notice_id in await execute_core(
        session, _OPEN, {"since": now - APPROVAL_TTL}
    ):
        key = (tenant_id, job_id)
        if key in jobs:
            found.setdefault(key, []).append(MaintenanceApproval(negotiation=negotiation_id, notice=notice_id))
    return {key: tuple(approvals[:MAX_OPEN_APPROVALS]) for key, approvals in found.items()}
