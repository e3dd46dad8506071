"""The admin's allocations: grant a job GPUs of one host, or give them back, each a one-shot use case that commits.

They sit on the ledger's in-transaction primitives (`ledger`), with the same guarantee (conditional updates, never
more than a host or job holds), and hold the whole ledger while they change it, as any exclusive ledger change does.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Select, select
from sqlalchemy.ext.asyncio import AsyncSession

from api.models import Allocation, Host, Job, utcnow
from api.services import ledger_rows
from api.services.errors import InsufficientCapacityError, InvalidRequestError, NotFoundError
from api.services.host_assignments import write_host_assignments
from api.services.ledger import PLACEMENT_ROUNDS, Placement, change_job_workers, new_allocation_id
from api.services.ledger_lock import lock_ledger


def _candidates(gpus: int, *, host_id: str | None, locality_group: str | None) -> Select[str, str]:
    free = Host.gpus - Host.allocated_gpus
    query = select(Host.id, Host.locality_group).where(free >= gpus, Host.down_at.is_(None)).order_by(free, Host.id)
    if host_id is not None:
        query = query.where(Host.id == host_id)
    if locality_group is not None:
        query = query.where(Host.locality_group == locality_group)
    return query


async def _check_scope(session: AsyncSession, *, host_id: str | None, locality_group: str | None) -> None:
    if host_id is not None and await session.get(Host, host_id) is None:
        raise NotFoundError(f"no host {host_id!r}")
    if locality_group is not None:
        found = await session.scalar(select(Host.id).where(Host.locality_group == locality_group).limit(1))
        if found is None:
            raise NotFoundError(f"no hosts in locality group {locality_group!r}")


async def allocate(
    session: AsyncSession,
    *,
    tenant_id: str,
    job_id: str,
    gpus: int,
    host_id: str | None = None,
    locality_group: str | None = None,
    now: datetime | None = None,
) -> Placement:
    """Grant `gpus` GPUs of one host to a job (whole workers) and commit, or raise without changing anything.

    Scope: `host_id` (that host), `locality_group` (any host in it) or neither (any host). Raises NotFoundError for
    an unknown job, host or group, InvalidRequestError unless `gpus` is a multiple of the job's `gpus_per_worker`,
    JobLimitError beyond the job's `max_workers`, InsufficientCapacityError when no host in scope has room. Safe to
    call from any number of concurrent sessions.
    """
    now = now or utcnow()
    job = await session.get(Job, (tenant_id, job_id))
    if job is None:
        raise NotFoundError(f"no job {job_id!r} for tenant {tenant_id!r}")
    if gpus % job.gpus_per_worker:
        raise InvalidRequestError(
            f"job {job_id!r} runs {job.gpus_per_worker} GPU(s) per worker: allocate a multiple of that, not {gpus}"
        )
    await _check_scope(session, host_id=host_id, locality_group=locality_group)
    await lock_ledger(session)
    try:
        await change_job_workers(session, job, gpus // job.gpus_per_worker)
        query = _candidates(gpus, host_id=host_id, locality_group=locality_group)
        for _ in range(PLACEMENT_ROUNDS):
            candidates = (await session.execute(query)).all()
            if not candidates:
                break
            for candidate_id, group in candidates:
                allocation = Allocation(
                    id=new_allocation_id(), tenant_id=tenant_id, job_id=job_id, host_id=candidate_id, gpus=gpus,
                    created_at=now, starts_at=None,
                )
                if await ledger_rows.grant(session, allocation):
                    await write_host_assignments(session, [candidate_id], now=now)
                    await session.commit()
                    return Placement(allocation=allocation, locality_group=group)
    except BaseException:
        await session.rollback()
        raise
    await session.rollback()
    scope = f"host {host_id!r}" if host_id else f"locality group {locality_group!r}" if locality_group else "any host"
    raise InsufficientCapacityError(f"not enough free GPUs for {gpus} on {scope}")


async def release(session: AsyncSession, allocation_id: str, *, now: datetime | None = None) -> Placement:
    """Give an allocation's GPUs back to its host and job, and commit; ConflictError if it was already released.

    The allocation is marked released by a conditional update too, so two concurrent releases cannot both return
    the GPUs to the host.
    """
    now = now or utcnow()
    allocation = await session.get(Allocation, allocation_id)
    if allocation is None:
        raise NotFoundError(f"no allocation {allocation_id!r}")
    await lock_ledger(session)
    try:
        await ledger_rows.release(session, allocation, give=allocation.gpus, now=now)
        job = await session.get(Job, (allocation.tenant_id, allocation.job_id))
        assert job is not None, "allocations reference their job by a foreign key"
        await change_job_workers(session, job, -(allocation.gpus // job.gpus_per_worker))
        await write_host_assignments(session, [allocation.host_id], now=now)
        await session.commit()
    except BaseException:
        await session.rollback()
        raise
    group = await session.scalar(select(Host.locality_group).where(Host.id == allocation.host_id))
    return Placement(allocation=allocation, locality_group=group or "")


async def list_placements(
    session: AsyncSession,
    *,
    tenant_id: str | None = None,
    job_id: str | None = None,
    include_released: bool = False,
) -> list[Placement]:
    """Allocations with their hosts' groups, oldest first, optionally narrowed to a tenant and job."""
    query = (
        select(Allocation, Host.locality_group)
        .join(Host, Host.id == Allocation.host_id)
        .order_by(Allocation.created_at, Allocation.id)
    )
    if tenant_id is not None:
        query = query.where(Allocation.tenant_id == tenant_id)
    if job_id is not None:
        query = query.where(Allocation.job_id == job_id)
    if not include_released:
        query = query.where(Allocation.released_at.is_(None))
    rows = await session.execute(query)
    return [Placement(allocation=allocation, locality_group=group) for allocation, group in rows]
