"""Host outages: when the fleet monitor reports a host down, the provider takes its workers out of every job at once.

Why the control plane shrinks the jobs itself instead of waiting for the tenant: the survivors of a job can only
resume once their node launchers restart them with the new, exact node count, and that count is the provider's
knowledge. Releasing the dead host's allocations bumps each affected job's placement epoch with an *immediate*
restart (the survivors cannot finish a collective checkpoint with a dead peer), so the launchers kill and restart the
surviving nodes at once and torch elastic's rendezvous completes without waiting for timeouts. The tenant learns of
the failure from the event and may negotiate a replacement; the released GPUs are not offered again until the host
is reported back up.

Both calls are idempotent: reporting a down host again, or an up host up, changes nothing.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from api.models import Allocation, Host, Job
from api.services.errors import NotFoundError
from api.services.host_assignments import write_host_assignments
from api.services.ledger_lock import lock_ledger
from harmonaize.desired_state import RestartMode


async def mark_host_down(session: AsyncSession, host_id: str, *, now: datetime) -> list[tuple[str, str]]:
    """Mark `host_id` down, release every live allocation on it, shrink the jobs, commit; returns the jobs shrunk."""
    try:
        await lock_ledger(session)
        host = await session.get(Host, host_id, populate_existing=True)
        if host is None:
            raise NotFoundError(f"no host {host_id!r}")
        was_down = host.down_at is not None
        if not was_down:
            host.down_at = now
        allocations = list(
            await session.scalars(
                select(Allocation).where(Allocation.host_id == host_id, Allocation.released_at.is_(None))
            )
        )
        if was_down and not allocations:
            await session.rollback()
            return []
        shrunk: dict[tuple[str, str], int] = {}
        for allocation in allocations:
            allocation.released_at = now
            key = (allocation.tenant_id, allocation.job_id)
            shrunk[key] = shrunk.get(key, 0) + allocation.gpus
        host.allocated_gpus = 0
        for (tenant_id, job_id), gpus in sorted(shrunk.items()):
            job = await session.get(Job, (tenant_id, job_id), populate_existing=True)
            assert job is not None, "an allocation's job exists (foreign key)"
            job.allocated_gpus -= gpus
            job.desired_workers -= gpus // job.gpus_per_worker
        await session.flush()
        await write_host_assignments(session, {host_id}, now=now, restart=RestartMode.IMMEDIATE)
        await session.commit()
        return sorted(shrunk)
    except BaseException:
        await session.rollback()
        raise


async def mark_host_up(session: AsyncSession, host_id: str, *, now: datetime) -> Host:
    """Let the host take placements again (nothing returns to it by itself: tenants negotiate for capacity, and
    learn of it from their jobs' capacity events). A host back from an outage is a repaired one: jobs that moved
    off it before it went down may return (`worker_replacement.avoided_hosts`)."""
    host = await session.get(Host, host_id)
    if host is None:
        raise NotFoundError(f"no host {host_id!r}")
    if host.down_at is not None:
        host.down_at = None
        host.up_at = now
        await session.commit()
    return host
