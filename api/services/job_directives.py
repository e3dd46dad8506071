"""The provider's micro-level directives for a running job: checked against the tenant's ranges, versioned, visible.

The micro loop proposes the *whole* setting it wants now (level, not a delta), plus `checkpoint_now` for a one-off
request. An unchanged proposal is a no-op, so the loop may repeat itself every tick. A changed one becomes the next
version: stored, put into the job's hosts' desired state (the node launchers hand it to the job's runtime, which
applies it at a step boundary, without a restart) and published to the tenant as an `issued` event.

A proposal outside the tenant's declared ranges is refused here, before any job sees it: it is stored with no
version and published to the tenant as `refused`, with the reasons, and the caller gets them too. The check is the
same function the job's runtime applies again (`harmonaize.job_runtime.violations`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from api.models import Job, JobDirective
from api.services.assigned_jobs import job_directives, job_ranges
from api.services.errors import NotFoundError
from api.services.host_assignments import job_hosts, write_host_assignments
from api.services.outbox import enqueue_tenant_event
from harmonaize.events.directive import DirectiveUpdate
from harmonaize.job_runtime import Directives, violations
from harmonaize.jobs import DirectiveState
from harmonaize.timeids import uuid7


@dataclass(frozen=True)
class DirectiveProposal:
    """What the micro loop wants the job's settings to be now (None: the job's own choice)."""

    checkpoint_now: bool = False
    checkpoint_interval_steps: int | None = None
    compression: str | None = None
    powersgd_rank: int | None = None
    batch_size: int | None = None
    gradient_accumulation: int | None = None
    reason: str = ""


@dataclass(frozen=True)
class DirectiveDecision:
    record: JobDirective | None
    directives: Directives
    refusals: tuple[str, ...] = ()

    @property
    def refused(self) -> bool:
        return bool(self.refusals)


async def propose(
    session: AsyncSession, *, tenant_id: str, job_id: str, proposal: DirectiveProposal, now: datetime
) -> DirectiveDecision:
    """Issue the proposal as the job's next directive version, refuse it, or do nothing when it changes nothing."""
    job = await session.get(Job, (tenant_id, job_id), with_for_update=True, populate_existing=True)
    if job is None:
        raise NotFoundError("job not found")
    current = job_directives(job)
    candidate = Directives(
        version=current.version + 1,
        checkpoint_requests=current.checkpoint_requests + (1 if proposal.checkpoint_now else 0),
        checkpoint_interval_steps=proposal.checkpoint_interval_steps,
        compression=proposal.compression,
        powersgd_rank=proposal.powersgd_rank,
        batch_size=proposal.batch_size,
        gradient_accumulation=proposal.gradient_accumulation,
        reason=proposal.reason,
    )
    if _same_settings(candidate, current) and not proposal.checkpoint_now:
        await session.rollback()
        return DirectiveDecision(None, current)
    refusals = tuple(violations(job_ranges(job), candidate))
    record = JobDirective(
        id=uuid7(),
        tenant_id=tenant_id,
        job_id=job_id,
        version=None if refusals else candidate.version,
        state=DirectiveState.REFUSED if refusals else DirectiveState.ISSUED,
        settings=candidate.model_dump(mode="json"),
        reason=proposal.reason,
        refusals=list(refusals),
        created_at=now,
        updated_at=now,
    )
    session.add(record)
    if not refusals:
        job.directives = candidate.model_dump(mode="json")
        await session.flush()
        await write_host_assignments(session, await job_hosts(session, tenant_id=tenant_id, job_id=job_id), now=now)
    _announce(session, record, candidate, now=now)
    await session.commit()
    return DirectiveDecision(record, current if refusals else candidate, refusals)


def _same_settings(a: Directives, b: Directives) -> bool:
    fields = ("checkpoint_interval_steps", "compression", "powersgd_rank", "batch_size", "gradient_accumulation")
    return all(getattr(a, name) == getattr(b, name) for name in fields)


def _announce(session: AsyncSession, record: JobDirective, directives: Directives, *, now: datetime) -> None:
    enqueue_tenant_event(
        session,
        tenant_id=record.tenant_id,
        job_id=record.job_id,
        data=DirectiveUpdate(
            version=record.version,
            state=record.state,
            checkpoint_requests=directives.checkpoint_requests,
            checkpoint_interval_steps=directives.checkpoint_interval_steps,
            compression=directives.compression,
            powersgd_rank=directives.powersgd_rank,
            batch_size=directives.batch_size,
            gradient_accumulation=directives.gradient_accumulation,
            reason=record.reason,
            refusals=tuple(record.refusals)[:16],
            step=record.step,
            at=now,
        ),
        now=now,
    )


async def record_outcome(
    session: AsyncSession,
    *,
    tenant_id: str,
    job_id: str,
    version: int,
    applied: bool,
    step: int,
    reasons: tuple[str, ...],
    now: datetime,
) -> bool:
    """Mark an issued version applied or refused by the job's runtime (once); True when this changed something."""
    record = await session.scalar(
        select(JobDirective).where(
            JobDirective.tenant_id == tenant_id,
            JobDirective.job_id == job_id,
            JobDirective.version == version,
            JobDirective.state == DirectiveState.ISSUED,
        )
    )
    if record is None:
        return False
    record.state = DirectiveState.APPLIED if applied else DirectiveState.REFUSED
    record.step = step
    record.refusals = list(reasons)
    record.updated_at = now
    _announce(session, record, Directives.model_validate(record.settings), now=now)
    return True


async def list_directives(
    session: AsyncSession, *, tenant_id: str, job_id: str, limit: int = 100
) -> list[JobDirective]:
    """The job's directive history, newest first."""
    return list(
        await session.scalars(
            select(JobDirective)
            .where(JobDirective.tenant_id == tenant_id, JobDirective.job_id == job_id)
            .order_by(JobDirective.created_at.desc(), JobDirective.id.desc())
            .limit(limit)
        )
    )
