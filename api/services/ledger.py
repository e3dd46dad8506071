"""The capacity ledger: GPUs of a host granted to jobs, never more than the host has.

The guarantee comes from the database, not from a read-then-write in Python. Granting n GPUs is one conditional
statement,

    UPDATE hosts SET allocated_gpus = allocated_gpus + :n WHERE id = :host AND allocated_gpus + :n <= gpus

and the rowcount says whether it happened. It is correct on PostgreSQL (the row lock makes a concurrent update
re-check the condition against the committed value) and on SQLite (which ignores SELECT ... FOR UPDATE but has one
writer at a time), and the CHECK constraint `allocated_gpus <= gpus` refuses anything that slips past it. The
allocation row is inserted in the same transaction, so the ledger rows and the hosts' totals move together.

Placing by locality group reads candidate hosts (best fit first, to keep large holes for large jobs) and tries the
conditional update on each; losing a race on one host only moves on to the next, and a few re-reads pick up space
freed meanwhile. A snapshot that says "room" is only ever a hint.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import Select, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm.attributes import set_committed_value

from api.models import Allocation, Host, Job, utcnow
from api.services.errors import ConflictError, InsufficientCapacityError, NotFoundError

PLACEMENT_ROUNDS = 3
"""Re-reads of the candidate hosts before giving up: each round only starts if the previous one lost every race."""


@dataclass(frozen=True)
class Placement:
    """An allocation with its host's locality group (which the allocation row does not store)."""

    allocation: Allocation
    locality_group: str


async def _try_reserve(session: AsyncSession, host_id: str, gpus: int) -> bool:
    result = await session.execute(
        update(Host)
        .where(Host.id == host_id, Host.allocated_gpus + gpus <= Host.gpus)
        .values(allocated_gpus=Host.allocated_gpus + gpus)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def _candidates(gpus: int, *, host_id: str | None, locality_group: str | None) -> Select[tuple[str, str]]:
    free = Host.gpus - Host.allocated_gpus
    query = select(Host.id, Host.locality_group).where(free >= gpus).order_by(free, Host.id)
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
) -> Placement:
    """Grant `gpus` GPUs of one host to a job and commit, or raise without changing anything.

    Scope: `host_id` (that host), `locality_group` (any host in it) or neither (any host). Raises NotFoundError for
    an unknown job, host or group, InsufficientCapacityError when no host in scope has room. Safe to call from any
    number of concurrent sessions.
    """
    if await session.get(Job, (tenant_id, job_id)) is None:
        raise NotFoundError(f"no job {job_id!r} for tenant {tenant_id!r}")
    await _check_scope(session, host_id=host_id, locality_group=locality_group)
    query = _candidates(gpus, host_id=host_id, locality_group=locality_group)
    for _ in range(PLACEMENT_ROUNDS):
        candidates = (await session.execute(query)).all()
        if not candidates:
            break
        for candidate_id, group in candidates:
            if await _try_reserve(session, candidate_id, gpus):
                allocation = Allocation(
                    id=uuid.uuid4().hex,
                    tenant_id=tenant_id,
                    job_id=job_id,
                    host_id=candidate_id,
                    gpus=gpus,
                    created_at=utcnow(),
                )
                session.add(allocation)
                await session.commit()
                return Placement(allocation=allocation, locality_group=group)
    await session.rollback()
    scope = f"host {host_id!r}" if host_id else f"locality group {locality_group!r}" if locality_group else "any host"
    raise InsufficientCapacityError(f"not enough free GPUs for {gpus} on {scope}")


async def release(session: AsyncSession, allocation_id: str) -> Placement:
    """Give an allocation's GPUs back to its host and commit; ConflictError if it was already released.

    The allocation is marked released by a conditional update too, so two concurrent releases cannot both return
    the GPUs to the host.
    """
    allocation = await session.get(Allocation, allocation_id)
    if allocation is None:
        raise NotFoundError(f"no allocation {allocation_id!r}")
    released_at = utcnow()
    marked = await session.execute(
        update(Allocation)
        .where(Allocation.id == allocation_id, Allocation.released_at.is_(None))
        .values(released_at=released_at)
        .execution_options(synchronize_session=False)
    )
    if marked.rowcount != 1:
        await session.rollback()
        raise ConflictError(f"allocation {allocation_id!r} is already released")
    returned = await session.execute(
        update(Host)
        .where(Host.id == allocation.host_id, Host.allocated_gpus >= allocation.gpus)
        .values(allocated_gpus=Host.allocated_gpus - allocation.gpus)
        .execution_options(synchronize_session=False)
    )
    if returned.rowcount != 1:
        await session.rollback()
        raise RuntimeError(
            f"ledger inconsistent: host {allocation.host_id!r} has fewer GPUs allocated than {allocation_id!r}"
        )
    await session.commit()
    set_committed_value(allocation, "released_at", released_at)
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
