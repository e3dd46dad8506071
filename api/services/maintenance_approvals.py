"""Maintenance approvals after the accept: queue one for the agents, record what they report, give up in time.

The accept of an `approve_maintenance` negotiation (`negotiation_accept.accept`) calls `queue_approval` in its
transaction: a `MaintenanceApprovalRow` is written and every host the job runs on gets a new desired state listing it
(`approval_commands`), queued in the outbox with the rest of the accept. The agents holding the notice report back
(`report_outcome`, `POST /v1/provider/negotiations/{id}/approval`): each report is a provider round in the
negotiation's history and moves the approval along `approval_lifecycle`'s table; repeated reports are duplicates,
so agents may report level state as often as they like. A final outcome takes the approval off its hosts' desired
state. An approval no agent settles within `APPROVAL_TTL` is recorded as failed by the sweeper (`expire_approvals`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from api.db import rows_matched
from api.models import Job, Negotiation
from api.models_approvals import OPEN_APPROVALS, ApprovalStatus, MaintenanceApprovalRow
from api.services.approval_commands import APPROVAL_TTL, MAX_OPEN_APPROVALS
from api.services.approval_lifecycle import OUTCOMES, next_approval_status
from api.services.errors import ConflictError, InvalidRequestError, NotFoundError, ServiceError
from api.services.host_assignments import placed_hosts, write_host_assignments
from api.services.ledger_lock import lock_ledger
from api.services.negotiation_store import append_round
from harmonaize.negotiation import NegotiationKind, NegotiationState, NegotiationTerms, RoundAction

__all__ = ["ApprovalReport", "expire_approvals", "queue_approval", "report_outcome"]

NOT_FOUND = "no accepted maintenance approval with this id"
DEFAULT_NOTES = {
    RoundAction.APPROVAL_PENDING: "waiting: a shared host's maintenance starts early only once all its tenants approve",
    RoundAction.APPROVED: "approved at the cloud: the maintenance may start now",
    RoundAction.APPROVAL_FAILED: "not approved: the maintenance keeps its scheduled time",
}
"""A report's note when the agent gives none."""
_RACE_ATTEMPTS = 3


@dataclass(frozen=True)
class ApprovalReport:
    """What became of a report: `recorded` (a new round) or `duplicate`, and the approval's status after it."""

    outcome: str
    status: ApprovalStatus


async def queue_approval(session: AsyncSession, negotiation: Negotiation, job: Job, *, now: datetime) -> set[str]:
    """Record the accepted approval (no commit); the hosts whose desired state must now list it.

    ConflictError (nothing changes, the offer stays open) when the job runs nowhere now or has too many approvals
    waiting already.
    """
    assert negotiation.kind is NegotiationKind.APPROVE_MAINTENANCE
    notice = NegotiationTerms.model_validate(negotiation.terms).notice_id
    assert notice is not None, "approve_maintenance terms name a notice"
    hosts = placed_hosts(job)
    if not hosts:
        raise ConflictError("the job runs on no host now: there is no maintenance of it to approve")
    waiting = await session.scalar(
        select(func.count())
        .select_from(MaintenanceApprovalRow)
        .where(
            MaintenanceApprovalRow.tenant_id == job.tenant_id,
            MaintenanceApprovalRow.job_id == job.id,
            MaintenanceApprovalRow.status.in_(OPEN_APPROVALS),
            MaintenanceApprovalRow.accepted_at > now - APPROVAL_TTL,
        )
    )
    if int(waiting or 0) >= MAX_OPEN_APPROVALS:
        raise ConflictError(
            f"the job has {MAX_OPEN_APPROVALS} maintenance approvals waiting for an outcome already: "
            "wait for their outcome first"
        )
    session.add(
        MaintenanceApprovalRow(
            negotiation_id=negotiation.id,
            tenant_id=job.tenant_id,
            job_id=job.id,
            notice_id=notice,
            status=ApprovalStatus.QUEUED,
            accepted_at=now,
            updated_at=now,
        )
    )
    await session.flush()  # the hosts' assignments are computed from the table in this transaction
    return hosts


async def report_outcome(
    session: AsyncSession, *, negotiation_id: str, outcome: RoundAction, note: str | None, now: datetime
) -> ApprovalReport:
    """Record an agent's outcome for the approval of `negotiation_id`, idempotently, and commit.

    NotFoundError for a negotiation that is no accepted approval; ApprovalConflictError (409) for an outcome that
    contradicts a final one; InvalidRequestError for a round that is no outcome.
    """
    if outcome not in OUTCOMES:
        raise InvalidRequestError(f"{outcome.value} is not an approval outcome")
    try:
        for _ in range(_RACE_ATTEMPTS):
            report = await _record(session, negotiation_id, outcome, note or DEFAULT_NOTES[outcome], now=now)
            if report is not None:
                await session.commit()
                return report
            await session.rollback()  # another report moved the approval meanwhile: read it again
        raise ConflictError("the maintenance approval keeps changing: report again")
    except BaseException:
        await session.rollback()
        raise


async def expire_approvals(session: AsyncSession, *, now: datetime) -> int:
    """Record approvals still open `APPROVAL_TTL` after their accept as failed, and commit; how many."""
    due = list(
        await session.scalars(
            select(MaintenanceApprovalRow.negotiation_id)
            .where(
                MaintenanceApprovalRow.status.in_(OPEN_APPROVALS),
                MaintenanceApprovalRow.accepted_at <= now - APPROVAL_TTL,
            )
            .order_by(MaintenanceApprovalRow.accepted_at)
        )
    )
    await session.rollback()
    minutes = int(APPROVAL_TTL.total_seconds() // 60)
    note = f"not approved within {minutes} minutes of the accept: the maintenance keeps its scheduled time"
    expired = 0
    for negotiation_id in due:
        try:
            report = await _record(session, negotiation_id, RoundAction.APPROVAL_FAILED, note, now=now)
            await session.commit()
        except ServiceError:  # settled or gone meanwhile: nothing left to expire
            await session.rollback()
            continue
        except BaseException:
            await session.rollback()
            raise
        expired += report is not None and report.outcome == "recorded"
    return expired


async def _record(
    session: AsyncSession, negotiation_id: str, outcome: RoundAction, note: str, *, now: datetime
) -> ApprovalReport | None:
    """One attempt (no commit); None when another writer changed the approval between the read and the update."""
    await lock_ledger(session)  # first: a final outcome rewrites the job's hosts' assignments
    approval = await session.get(MaintenanceApprovalRow, negotiation_id, populate_existing=True)
    negotiation = await session.get(Negotiation, negotiation_id, populate_existing=True)
    if approval is None or negotiation is None or negotiation.state is not NegotiationState.ACCEPTED:
        raise NotFoundError(NOT_FOUND)
    target = next_approval_status(approval.status, outcome)
    if target is None:
        return ApprovalReport(outcome="duplicate", status=approval.status)
    moved = await session.execute(
        update(MaintenanceApprovalRow)
        .where(
            MaintenanceApprovalRow.negotiation_id == negotiation_id,
            MaintenanceApprovalRow.status == approval.status,
        )
        .values(status=target, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    if rows_matched(moved) != 1:
        return None
    await session.execute(
        update(Negotiation)
        .where(Negotiation.id == negotiation_id)
        .values(version=Negotiation.version + 1, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    await append_round(session, negotiation, outcome, at=now, note=note)
    if target not in OPEN_APPROVALS:
        job = await session.get(Job, (approval.tenant_id, approval.job_id), populate_existing=True)
        if job is not None and (hosts := placed_hosts(job)):
            await write_host_assignments(session, hosts, now=now)
    return ApprovalReport(outcome="recorded", status=target)
