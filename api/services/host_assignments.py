"""Desired state per host, recomputed from the capacity ledger whenever a host's placements change.

Agents are level-triggered: each watches its host's key and converges to the value, so every write carries the
host's *whole* assignment (every job placed there, its workers, GPUs and plan), never a delta. The assignment is
computed from the ledger's live allocations inside the transaction that changed them, gets the host's next
`generation`, and is queued in the outbox with that transaction; it reaches the KV bucket only if the change commits.

Capacity reserved for a later, agreed start (`allocations.starts_at`) counts against the host at once but joins the
assignment only from its start: `announce_due_reservations` (run by the background sweeper) rewrites the hosts whose
reservations have started since their last assignment.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from api.models import Allocation, Host, Job
from api.services.ledger_lock import lock_ledger
from api.services.outbox import enqueue_desired_state
from harmonaize.desired_state import AssignedJob, HostAssignment


def _effective(now: datetime):  # type: ignore[no-untyped-def]
    return Allocation.released_at.is_(None), or_(Allocation.starts_at.is_(None), Allocation.starts_at <= now)


async def compute_assignment(session: AsyncSession, host_id: str, *, generation: int, now: datetime) -> HostAssignment:
    """What should run on `host_id` at `now`, from the ledger (jobs sorted by tenant and id)."""
    group = await session.scalar(select(Host.locality_group).where(Host.id == host_id))
    rows = await session.execute(
        select(Allocation.tenant_id, Allocation.job_id, func.sum(Allocation.gpus), Job.gpus_per_worker, Job.parallel_plan)
        .join(Job, (Job.tenant_id == Allocation.tenant_id) & (Job.id == Allocation.job_id))
        .where(Allocation.host_id == host_id, *_effective(now))
        .group_by(Allocation.tenant_id, Allocation.job_id, Job.gpus_per_worker, Job.parallel_plan)
        .order_by(Allocation.tenant_id, Allocation.job_id)
    )
    jobs = tuple(
        AssignedJob(tenant=tenant, job=job, workers=int(gpus) // per_worker, gpus=int(gpus), parallel_plan=plan)
        for tenant, job, gpus, per_worker, plan in rows
    )
    return HostAssignment(host=host_id, locality_group=group or "", generation=generation, jobs=jobs, updated_at=now)


async def write_host_assignments(
    session: AsyncSession, host_ids: Iterable[str], *, now: datetime
) -> list[HostAssignment]:
    """Bump each host's generation and queue its recomputed assignment; no commit (the caller's transaction)."""
    assignments = []
    for host_id in sorted(set(host_ids)):
        await session.execute(
            update(Host)
            .where(Host.id == host_id)
            .values(generation=Host.generation + 1, assigned_at=now)
            .execution_options(synchronize_session=False)
        )
        generation = await session.scalar(select(Host.generation).where(Host.id == host_id))
        assignment = await compute_assignment(session, host_id, generation=int(generation or 0), now=now)
        enqueue_desired_state(session, assignment, now=now)
        assignments.append(assignment)
    return assignments


async def job_hosts(session: AsyncSession, *, tenant_id: str, job_id: str) -> set[str]:
    """Hosts holding any live allocation of the job (effective or reserved)."""
    rows = await session.scalars(
        select(Allocation.host_id)
        .where(Allocation.tenant_id == tenant_id, Allocation.job_id == job_id, Allocation.released_at.is_(None))
        .distinct()
    )
    return set(rows)


async def announce_due_reservations(session: AsyncSession, *, now: datetime) -> list[HostAssignment]:
    """Rewrite the hosts whose reserved workers have started since their last assignment, and commit.

    Checked without the ledger lock first (the sweeper runs this every tick); rewriting a host is always safe, since
    the assignment is recomputed from the ledger under the lock.
    """
    rows = await session.scalars(
        select(Allocation.host_id)
        .join(Host, Host.id == Allocation.host_id)
        .where(
            Allocation.released_at.is_(None),
            Allocation.starts_at.is_not(None),
            Allocation.starts_at <= now,
            or_(Host.assigned_at.is_(None), Allocation.starts_at > Host.assigned_at),
        )
        .distinct()
    )
    hosts = set(rows)
    if not hosts:
        await session.rollback()
        return []
    await lock_ledger(session)
    assignments = await write_host_assignments(session, hosts, now=now)
    await session.commit()
    return assignments
