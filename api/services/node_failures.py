"""Node failures on healthy hosts: a hung node leaves its job as a failed host's workers do; every failure is told.

Why the control plane takes a hung node out of its job: the launcher that killed the node cannot re-form the job
alone, since the node's peers stay stuck in their collective until a new epoch restarts them at a size that leaves the
node out, and that size is the ledger's. So the node's live allocations of that job on that host are released and the
job gets a new epoch with an *immediate* restart, as after a host outage (`host_outages`), but for this one job. The
host stays up and eligible: its agent answers and its other jobs run, so its freed GPUs may be placed again, also for
the tenant's own replacement request (nothing counts hangs per host yet to take a host that keeps hanging jobs out).

A node out of restarts keeps its place: it is recorded, shown in the job's status (whose phase becomes `failed`: the
job stands still until its epoch moves on) and told, and the tenant decides (a replacement, a smaller size, or a fix
of its code, which fails on every node alike more often than not).

The tenant learns of either from a `Failure` event (`node_hung` or `node_failed`, the launcher's reason as the reason
code, the host under the tenant's pseudonym), queued in the transaction that records it.

Idempotent, one row per node and epoch: a repeated report changes nothing (`duplicate`); a report for an epoch the job
has left, or for a host the job no longer runs on, describes nothing that still runs and changes nothing (`stale`).
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from api.models import Allocation, Host, Job
from api.models_node_failures import JobNodeFailure
from api.services.errors import ConflictError, NotFoundError
from api.services.host_assignments import write_host_assignments
from api.services.job_lifecycle import JobEvent, advance
from api.services.ledger_lock import lock_ledger
from api.services.outbox import enqueue_tenant_event
from harmonaize.desired_state import RestartMode
from harmonaize.events import Failure, FailureKind, Severity
from harmonaize.node_failures import NodeFailureReport
from harmonaize.pseudonyms import host_pseudonym

__all__ = ["NodeFailureOutcome", "failure_event", "recent_node_failures", "report_node_failure"]

RECENT_FAILURES = 10
"""How many node failures a job's status shows (newest first)."""


class NodeFailureOutcome(StrEnum):
    RELEASED = "released"
    """Recorded and told; the node's workers left the job (new epoch, immediate restart)."""
    RECORDED = "recorded"
    """Recorded and told; the node keeps its place."""
    DUPLICATE = "duplicate"
    STALE = "stale"


def failure_event(report: NodeFailureReport, *, secret: bytes) -> Failure:
    """The tenant's view of the report: kind, reason code and the tenant's pseudonym for the host."""
    return Failure(
        kind=FailureKind.NODE_HUNG if report.reason.hung else FailureKind.NODE_FAILED,
        host=host_pseudonym(secret, report.tenant, report.host),
        detected_at=report.detected_at,
        severity=Severity.CRITICAL,
        reason=report.reason.value,
    )


async def report_node_failure(
    session: AsyncSession, report: NodeFailureReport, *, now: datetime, secret: bytes
) -> NodeFailureOutcome:
    """Record `report`, take a hung node out of its job, queue the tenant's event, commit; see the module doc."""
    try:
        await lock_ledger(session)
        job = await session.get(Job, (report.tenant, report.job), populate_existing=True)
        if job is None:
            raise NotFoundError(f"no job {report.job!r} of tenant {report.tenant!r}")
        host = await session.get(Host, report.host, populate_existing=True)
        if host is None:
            raise NotFoundError(f"no host {report.host!r}")
        if report.epoch > job.placement_epoch:
            raise ConflictError(f"epoch {report.epoch} is ahead of the job's placement epoch {job.placement_epoch}")
        duplicate = await session.scalar(
            select(JobNodeFailure.id).where(
                JobNodeFailure.tenant_id == report.tenant,
                JobNodeFailure.job_id == report.job,
                JobNodeFailure.host_id == report.host,
                JobNodeFailure.epoch == report.epoch,
            )
        )
        if duplicate is not None:
            await session.rollback()
            return NodeFailureOutcome.DUPLICATE
        allocations = list(
            await session.scalars(
                select(Allocation).where(
                    Allocation.tenant_id == report.tenant,
                    Allocation.job_id == report.job,
                    Allocation.host_id == report.host,
                    Allocation.released_at.is_(None),
                    or_(Allocation.starts_at.is_(None), Allocation.starts_at <= now),
                )
            )
        )
        if report.epoch < job.placement_epoch or not allocations:
            await session.rollback()
            return NodeFailureOutcome.STALE
        released = report.reason.leaves_job
        if released:
            gpus = sum(allocation.gpus for allocation in allocations)
            for allocation in allocations:
                allocation.released_at = now
            host.allocated_gpus -= gpus
            job.allocated_gpus -= gpus
            job.desired_workers -= gpus // job.gpus_per_worker
            await session.flush()
            await write_host_assignments(session, {report.host}, now=now, restart=RestartMode.IMMEDIATE)
        else:
            advance(job, JobEvent.GIVE_UP)
        session.add(
            JobNodeFailure(
                tenant_id=report.tenant,
                job_id=report.job,
                host_id=report.host,
                epoch=report.epoch,
                reason=report.reason,
                step=report.step,
                released=released,
                detail=report.detail,
                detected_at=report.detected_at,
                reported_at=now,
            )
        )
        enqueue_tenant_event(
            session, tenant_id=report.tenant, job_id=report.job, data=failure_event(report, secret=secret), now=now
        )
        await session.commit()
        return NodeFailureOutcome.RELEASED if released else NodeFailureOutcome.RECORDED
    except BaseException:
        await session.rollback()
        raise


async def recent_node_failures(session: AsyncSession, *, tenant_id: str, job_id: str) -> list[JobNodeFailure]:
    """The job's latest node failures, newest first."""
    return list(
        await session.scalars(
            select(JobNodeFailure)
            .where(JobNodeFailure.tenant_id == tenant_id, JobNodeFailure.job_id == job_id)
            .order_by(JobNodeFailure.id.desc())
            .limit(RECENT_FAILURES)
        )
    )
