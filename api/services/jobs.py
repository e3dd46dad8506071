"""Tenants' jobs. Every function takes the tenant id first-class: there is no way to read a job without one.

A job id is unique only within its tenant, so looking up another tenant's job id finds nothing (NotFoundError), and
creating a job with an id some other tenant already uses succeeds: neither reveals that the other job exists.

A job created with `initial_workers` is placed in the same transaction: all of its workers or none, and no job.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from api.models import Job, utcnow
from api.schemas import JobCreate
from api.services.errors import ConflictError, InsufficientCapacityError, NotFoundError
from api.services.host_assignments import write_host_assignments
from api.services.ledger import change_job_workers, place_workers
from api.services.ledger_lock import lock_ledger


async def create_job(
    session: AsyncSession, *, tenant_id: str, spec: JobCreate, now: datetime | None = None
) -> Job:
    """Store a tenant's job, placing `spec.initial_workers` workers if given, and commit.

    ConflictError if this tenant already has a job with that id; InsufficientCapacityError (nothing stored) when the
    initial workers do not all fit.
    """
    now = now or utcnow()
    if await session.get(Job, (tenant_id, spec.id)) is not None:
        raise ConflictError(f"job {spec.id!r} already exists")
    job = Job(
        tenant_id=tenant_id,
        id=spec.id,
        name=spec.name or spec.id,
        min_workers=spec.min_workers,
        max_workers=spec.max_workers,
        gpus_per_worker=spec.gpus_per_worker,
        parallel_plan=spec.parallel_plan,
        checkpoint_interval_steps_min=spec.checkpoint_interval_steps.min,
        checkpoint_interval_steps_max=spec.checkpoint_interval_steps.max,
        compression_allowed=[option.value for option in spec.gradient_compression.allowed],
        powersgd_max_rank=spec.gradient_compression.powersgd_max_rank,
        batch_size_min=spec.batch_size.min if spec.batch_size else None,
        batch_size_max=spec.batch_size.max if spec.batch_size else None,
        grad_accumulation_min=spec.gradient_accumulation.min,
        grad_accumulation_max=spec.gradient_accumulation.max,
        global_batch=spec.global_batch,
        desired_workers=0,
        allocated_gpus=0,
        entrypoint=list(spec.entrypoint),
        created_at=now,
    )
    session.add(job)
    try:
        await session.flush()
        if spec.initial_workers:
            await _place_initial_workers(session, job, spec.initial_workers, now=now)
        await session.commit()
    except IntegrityError as exc:
        await session.rollback()
        raise ConflictError(f"job {spec.id!r} already exists") from exc
    except BaseException:
        await session.rollback()
        raise
    return job


async def _place_initial_workers(session: AsyncSession, job: Job, workers: int, *, now: datetime) -> None:
    await lock_ledger(session)
    await change_job_workers(session, job, workers, expected_workers=0)
    try:
        placed = await place_workers(session, job, workers, now=now)
    except InsufficientCapacityError as exc:
        raise InsufficientCapacityError(
            f"cannot place the {workers} initial workers: {exc.reason}; the job was not created"
        ) from exc
    await write_host_assignments(session, {placement.allocation.host_id for placement in placed}, now=now)
    job.desired_workers = workers
    job.allocated_gpus = workers * job.gpus_per_worker


async def get_job(session: AsyncSession, *, tenant_id: str, job_id: str) -> Job:
    """The tenant's job, or NotFoundError (also when another tenant has a job with this id)."""
    job = await session.get(Job, (tenant_id, job_id))
    if job is None:
        raise NotFoundError("job not found")
    return job


async def list_jobs(
    session: AsyncSession, *, tenant_id: str, after: str | None = None, limit: int = 100
) -> list[Job]:
    """A page of the tenant's jobs in id order; pass the last id seen as `after` for the next page."""
    query = select(Job).where(Job.tenant_id == tenant_id).order_by(Job.id).limit(limit)
    if after is not None:
        query = query.where(Job.id > after)
    return list(await session.scalars(query))
