"""Progress a running job reports (through its host's node launcher): latest status, shape timeline, outcomes.

Reports arrive from whichever host runs the job's global rank 0, at least once and possibly out of order (a
launcher may relay a stale file from before a restart), so they are applied monotonically: a report older than the
stored one (lower epoch, or the same epoch and a lower step) only contributes what is new in it (directive outcomes).
The timeline gets a row, and the tenant a `JobUpdate` event, whenever the job first runs in a new shape (epoch,
world size, plan): that is when an agreement was actually carried out, and from which checkpoint. Newer reports
are also kept as samples over time (step, loss, rate), downsampled by the job's age, for the job's curves. A newer
report from the job's current epoch moves its phase (`job_lifecycle`): running, or finished with the run's final
report.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from api.models import Job
from api.models_job_runs import JobProgressSample, JobStatus, JobTimelineEntry
from api.services.errors import NotFoundError
from api.services.job_directives import record_outcome
from api.services.job_lifecycle import JobEvent, advance
from api.services.outbox import enqueue_tenant_event
from harmonaize.events.job import JobUpdate
from harmonaize.job_runtime import DirectiveState, JobProgress


async def report_progress(session: AsyncSession, progress: JobProgress, *, now: datetime) -> bool:
    """Store a progress report and commit; True when it was newer than what was stored."""
    tenant_id, job_id = progress.tenant, progress.job
    try:
        # locked first: the report may move the job's phase, as a concurrent new epoch may
        job = await session.get(Job, (tenant_id, job_id), with_for_update=True, populate_existing=True)
        if job is None:
            raise NotFoundError("job not found")
        for outcome in progress.outcomes:
            await record_outcome(
                session,
                tenant_id=tenant_id,
                job_id=job_id,
                version=outcome.version,
                applied=outcome.status is DirectiveState.APPLIED,
                step=outcome.step,
                reasons=outcome.reasons,
                now=now,
            )
        status = await session.get(JobStatus, (tenant_id, job_id), with_for_update=True)
        newer = status is None or (progress.epoch, progress.step) >= (status.epoch, status.step)
        if newer:
            payload = progress.model_dump(mode="json")
            reshaped = status is None or (status.epoch, status.world_size) != (progress.epoch, progress.world_size)
            if status is None:
                status = JobStatus(
                    tenant_id=tenant_id,
                    job_id=job_id,
                    epoch=progress.epoch,
                    step=progress.step,
                    world_size=progress.world_size,
                    progress=payload,
                    reported_at=now,
                )
                session.add(status)
            else:
                status.epoch, status.step, status.world_size = progress.epoch, progress.step, progress.world_size
                status.progress, status.reported_at = payload, now
            if reshaped or progress.finished or _sample_due(status.sampled_at, job.created_at, now=now):
                status.sampled_at = now
                session.add(_sample(progress, now))
            await _extend_timeline(session, progress, now=now)
            if progress.epoch == job.placement_epoch:
                advance(job, JobEvent.FINISH if progress.finished else JobEvent.PROGRESS)
        await session.commit()
        return newer
    except BaseException:
        await session.rollback()
        raise


SAMPLE_MIN_S = 1.0
SAMPLE_TARGET = 500
"""Samples kept per job age: the period grows with the job's age (`age / SAMPLE_TARGET`, at least `SAMPLE_MIN_S`),
so a job of any length has a few hundred samples per doubling of its age: fine-grained early, bounded later. The
first report of each shape (epoch, world size) and the final one are always kept."""


def _sample_due(sampled_at: datetime | None, created_at: datetime, *, now: datetime) -> bool:
    if sampled_at is None:
        return True
    period = max(SAMPLE_MIN_S, (now - created_at).total_seconds() / SAMPLE_TARGET)
    return (now - sampled_at).total_seconds() >= period


def _sample(progress: JobProgress, now: datetime) -> JobProgressSample:
    return JobProgressSample(
        tenant_id=progress.tenant,
        job_id=progress.job,
        at=now,
        epoch=progress.epoch,
        step=progress.step,
        world_size=progress.world_size,
        loss=progress.loss,
        samples_per_s=progress.samples_per_s,
    )


async def progress_samples(
    session: AsyncSession, *, tenant_id: str, job_id: str, limit: int
) -> list[JobProgressSample]:
    """The job's latest `limit` samples, oldest first."""
    newest = list(
        await session.scalars(
            select(JobProgressSample)
            .where(JobProgressSample.tenant_id == tenant_id, JobProgressSample.job_id == job_id)
            .order_by(JobProgressSample.id.desc())
            .limit(limit)
        )
    )
    return newest[::-1]


async def _extend_timeline(session: AsyncSession, progress: JobProgress, *, now: datetime) -> None:
    last = await session.scalar(
        select(JobTimelineEntry)
        .where(JobTimelineEntry.tenant_id == progress.tenant, JobTimelineEntry.job_id == progress.job)
        .order_by(JobTimelineEntry.id.desc())
        .limit(1)
    )
    shape = (progress.epoch, progress.world_size, progress.parallel_plan)
    if last is not None and (last.epoch, last.world_size, last.parallel_plan) == shape:
        return
    if last is not None and last.epoch > progress.epoch:
        return
    if progress.epoch_step is not None:
        first_step = progress.epoch_step
    else:
        first_step = progress.resumed_from_step if progress.resumed_from_step is not None else 0
    session.add(
        JobTimelineEntry(
            tenant_id=progress.tenant,
            job_id=progress.job,
            epoch=progress.epoch,
            world_size=progress.world_size,
            parallel_plan=progress.parallel_plan,
            step=first_step,
            resumed_from_step=progress.resumed_from_step,
            change=progress.change,
            pause_s=progress.pause_s,
            at=now,
        )
    )
    enqueue_tenant_event(
        session,
        tenant_id=progress.tenant,
        job_id=progress.job,
        data=JobUpdate(
            epoch=progress.epoch,
            world_size=progress.world_size,
            parallel_plan=progress.parallel_plan,
            step=first_step,
            resumed_from_step=progress.resumed_from_step,
            at=now,
        ),
        now=now,
    )


async def job_status(session: AsyncSession, *, tenant_id: str, job_id: str) -> JobStatus | None:
    return await session.get(JobStatus, (tenant_id, job_id))


async def job_timeline(session: AsyncSession, *, tenant_id: str, job_id: str) -> list[JobTimelineEntry]:
    """Every shape the job ran in, oldest first."""
    return list(
        await session.scalars(
            select(JobTimelineEntry)
            .where(JobTimelineEntry.tenant_id == tenant_id, JobTimelineEntry.job_id == job_id)
            .order_by(JobTimelineEntry.id)
        )
    )
