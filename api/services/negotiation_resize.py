"""Carrying out an accepted option's size: the job's workers placed or released, or moved off the hosts it replaces.

Inside the accept's transaction, under the ledger lock (`negotiation_accept.accept`). New workers never go to a host the
job is kept off (`worker_replacement.avoided_hosts`); a release may free any. When the workers no longer fit,
InsufficientCapacityError says that nothing changed and until when the offer stays open (the caller rolls back).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession

from api.models import Job
from api.services.errors import InsufficientCapacityError
from api.services.ledger import (
    CountersMoved,
    change_job_workers,
    change_job_workers_reading,
    place_workers,
    release_workers,
)
from api.services.negotiation_store import read_job_again
from api.services.worker_replacement import avoided_hosts, move_workers, quarantine, resolve

__all__ = ["replace", "resize"]


async def resize(
    session: AsyncSession, job: Job, workers: int, *, now: datetime, starts_at: datetime | None, secret: bytes,
    expires_at: datetime, read_again: datetime | None = None,
) -> set[str]:
    """Bring `job` to `workers` (the hosts touched); placed workers start at `starts_at` (None: now).

    `read_again`: the quarantine's start, when `job` was read before the caller waited for the ledger lock
    (PostgreSQL): the update of its counters then refreshes it too (`change_job_workers_reading`; a grow's also
    reads the hosts its placement starts from, a shrink's the allocations it releases), and if the job changed
    meanwhile it is read anew and the size decided on what it is now (the target is absolute).
    """
    delta = workers - job.desired_workers
    moved: CountersMoved | None = None
    if read_again is not None:
        moved = await change_job_workers_reading(session, job, delta, expected_workers=job.desired_workers,
                                                 quarantine_since=read_again)
        if moved is None:
            job = await read_job_again(session, job, quarantine_since=read_again)
            if workers == job.desired_workers:
                return set()
            return await resize(session, job, workers, now=now, starts_at=starts_at, secret=secret,
                                expires_at=expires_at)
    else:
        await change_job_workers(session, job, delta, expected_workers=job.desired_workers)
    if delta < 0:
        return await release_workers(session, job, -delta, now=now,
                                     most_recent_first=moved.most_recent_first if moved else None)
    avoid = await avoided_hosts(session, job, secret=secret, now=now)
    try:
        placed = await place_workers(session, job, delta, now=now, starts_at=starts_at, exclude_hosts=avoid,
                                     snapshot=moved.hosts if moved else None)
    except InsufficientCapacityError as exc:
        raise _capacity_gone(exc, expires_at) from exc
    return {placement.allocation.host_id for placement in placed}


async def replace(
    session: AsyncSession, job: Job, names: Sequence[str], workers: int, *, now: datetime, secret: bytes,
    expires_at: datetime,
) -> set[str]:
    """Move `job`'s workers off the hosts the tenant named (`names`), to `workers` in all, and keep it off them for
    a while (`worker_replacement.quarantine`); the hosts touched."""
    avoid = await avoided_hosts(session, job, secret=secret, now=now)
    resolved = await resolve(session, job, names, secret=secret)
    try:
        touched = await move_workers(session, job, resolved.host_ids, workers, now=now, avoid=avoid)
    except InsufficientCapacityError as exc:
        raise _capacity_gone(exc, expires_at) from exc
    await quarantine(session, job, names, now=now)
    return touched


def _capacity_gone(exc: InsufficientCapacityError, expires_at: datetime) -> InsufficientCapacityError:
    until = expires_at.strftime("%Y-%m-%dT%H:%M:%SZ")
    return InsufficientCapacityError(
        f"the capacity for this option is gone: {exc.reason}. Nothing changed; the offer stays open until "
        f"{until}: counter with fewer workers"
    )
