"""Desired state per host, recomputed from the capacity ledger whenever a host's placements change.

Agents are level-triggered: each watches its host's key and converges to the value, so every write carries the
host's *whole* assignment (every job placed there, its workers, GPUs and plan), never a delta. The assignment is
computed from the ledger's live allocations inside the transaction that changed them, gets the host's next
`generation`, and is queued in the outbox with that transaction; it reaches the KV bucket only if the change commits.

Capacity reserved for a later, agreed start (`allocations.starts_at`) counts against the host at once but joins the
assignment only from its start: `announce_due_reservations` (run by the background sweeper) rewrites the hosts whose
reservations have started since their last assignment.

An assignment also lists, apart from its jobs, the *standby* nodes of open offers that would grow a job onto the host
(`api.services.standby`): the launcher starts them early, nothing else treats the job as placed there.

Each job also carries a placement *epoch*: node launchers start one torchrun rendezvous per epoch, sized exactly to
the job's node count, so whenever the job's node set, worker counts or plan change, the epoch moves on and every
host of the job (old and new) is rewritten. Directives (the micro loop's settings) travel in the same assignment
but do not change the epoch: the running job applies them at a step boundary, without a restart.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import cast

from sqlalchemy import ColumnElement, Select, func, or_, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncSession

from api.models import Allocation, Host, Job, Negotiation
from api.models_standby import StandbyNode
from api.services.approval_commands import open_approvals
from api.services.job_lifecycle import advance, epoch_event
from api.services.ledger_lock import lock_ledger
from api.services.outbox import enqueue_desired_state
from harmonaize.desired_state import AssignedJob, HostAssignment, MaintenanceApproval, RestartMode
from harmonaize.job_runtime import Directives, JobRanges
from harmonaize.jobs import Compression
from harmonaize.negotiation import NegotiationState
from harmonaize.ranges import IntRange


def _effective(now: datetime) -> tuple[ColumnElement[bool], ColumnElement[bool]]:
    """Allocations that hold capacity at `now`: not released, and started (a reservation counts from its start)."""
    return Allocation.released_at.is_(None), or_(Allocation.starts_at.is_(None), Allocation.starts_at <= now)


def job_ranges(job: Job) -> JobRanges:
    """The tenant's declared micro-loop ranges of `job`, in the contract's shape (shared with the job's runtime)."""
    return JobRanges(
        checkpoint_interval_steps=IntRange(
            min=job.checkpoint_interval_steps_min, max=job.checkpoint_interval_steps_max
        ),
        compression_allowed=tuple(Compression(option) for option in job.compression_allowed),
        powersgd_max_rank=job.powersgd_max_rank,
        batch_size=(
            None
            if job.batch_size_min is None or job.batch_size_max is None
            else IntRange(min=job.batch_size_min, max=job.batch_size_max)
        ),
        gradient_accumulation=IntRange(min=job.grad_accumulation_min, max=job.grad_accumulation_max),
        global_batch=job.global_batch,
    )


def job_directives(job: Job) -> Directives:
    return Directives() if job.directives is None else Directives.model_validate(job.directives)


def _placement_hosts(placement: dict[str, object] | None) -> dict[str, int]:
    """Workers per host in a stored placement (as `_placement` writes it); empty for a job placed nowhere.

    The JSON column is typed loosely, so the shape written below is restated here, once.
    """
    return cast("dict[str, int]", (placement or {}).get("hosts") or {})


async def _placements(
    session: AsyncSession, jobs: Select[str, str], *, now: datetime
) -> dict[tuple[str, str], dict[str, int]]:
    """GPUs per host now of every job `jobs` selects (tenant, job), in one statement."""
    rows = await session.execute(
        select(Allocation.tenant_id, Allocation.job_id, Allocation.host_id, func.sum(Allocation.gpus))
        .where(tuple_(Allocation.tenant_id, Allocation.job_id).in_(jobs), *_effective(now))
        .group_by(Allocation.tenant_id, Allocation.job_id, Allocation.host_id)
    )
    found: dict[tuple[str, str], dict[str, int]] = {}
    for tenant_id, job_id, host_id, gpus in rows:
        found.setdefault((tenant_id, job_id), {})[host_id] = int(gpus)
    return found


def _placement(job: Job, gpus_by_host: dict[str, int]) -> dict[str, object]:
    """The job's effective node set: workers per host (whole workers only), and the plan they run."""
    hosts = {host: gpus // job.gpus_per_worker for host, gpus in gpus_by_host.items() if gpus >= job.gpus_per_worker}
    return {"plan": job.parallel_plan.value, "hosts": dict(sorted(hosts.items()))}


async def _compute(
    session: AsyncSession, hosts: dict[str, tuple[int, str]], *, now: datetime
) -> list[HostAssignment]:
    """The assignments of `hosts` (id -> its generation and group), in id order, read in three statements however
    many hosts: their jobs, those jobs' open approvals, and the standby nodes on them."""
    rows = await session.execute(
        select(Allocation.host_id, Job, func.sum(Allocation.gpus))
        .join(Job, (Job.tenant_id == Allocation.tenant_id) & (Job.id == Allocation.job_id))
        .where(Allocation.host_id.in_(list(hosts)), *_effective(now))
        .group_by(Allocation.host_id, Job.tenant_id, Job.id)
        .execution_options(populate_existing=True)
        .order_by(Allocation.host_id, Job.tenant_id, Job.id)
    )
    placed: dict[str, list[tuple[Job, int]]] = {}
    for host_id, job, gpus in rows:
        placed.setdefault(host_id, []).append((job, int(gpus)))
    approvals = await open_approvals(
        session, {(job.tenant_id, job.id) for jobs in placed.values() for job, _ in jobs}, now=now
    )
    standby = await _standby_jobs(session, list(hosts), now=now)
    assignments = []
    for host_id, (generation, group) in sorted(hosts.items()):
        jobs = [
            _assigned(job, workers=gpus // job.gpus_per_worker, epoch=job.placement_epoch,
                      nodes=len(_placement_hosts(job.placement)), restart=job.restart_mode,
                      approvals=approvals.get((job.tenant_id, job.id), ()))
            for job, gpus in placed.get(host_id, [])
        ]
        keys = {(job.tenant, job.job) for job in jobs}
        warm = [job for job in standby.get(host_id, []) if (job.tenant, job.job) not in keys]
        assignments.append(HostAssignment(
            host=host_id, locality_group=group, generation=generation, jobs=tuple(jobs), standby=tuple(warm),
            updated_at=now,
        ))
    return assignments


async def _standby_jobs(session: AsyncSession, host_ids: list[str], *, now: datetime) -> dict[str, list[AssignedJob]]:
    """Warm joiners per host: jobs an offered, unexpired negotiation would grow onto it (`api.services.standby`).

    Each is the node the accept would start, guessed now: the job's next epoch, one node more.
    """
    rows = await session.execute(
        select(StandbyNode.host_id, Job, StandbyNode.workers, Negotiation.expires_at)
        .join(Negotiation, Negotiation.id == StandbyNode.negotiation_id)
        .join(Job, (Job.tenant_id == Negotiation.tenant_id) & (Job.id == Negotiation.job_id))
        .where(
            StandbyNode.host_id.in_(host_ids),
            Negotiation.state == NegotiationState.OFFERED,
            Negotiation.expires_at > now,
        )
        .order_by(StandbyNode.host_id, Job.tenant_id, Job.id, Negotiation.expires_at.desc())
    )
    standby: dict[str, dict[tuple[str, str], AssignedJob]] = {}
    for host_id, job, workers, expires_at in rows:
        on_host = standby.setdefault(host_id, {})
        if (job.tenant_id, job.id) in on_host or not job.entrypoint:
            continue
        on_host[(job.tenant_id, job.id)] = _assigned(
            job, workers=workers, epoch=job.placement_epoch + 1, nodes=len(_placement_hosts(job.placement)) + 1,
            standby_until=expires_at,
        )
    return {host_id: list(jobs.values()) for host_id, jobs in standby.items()}


def _assigned(
    job: Job, *, workers: int, epoch: int, nodes: int, restart: RestartMode = RestartMode.GRACEFUL,
    standby_until: datetime | None = None, approvals: tuple[MaintenanceApproval, ...] = (),
) -> AssignedJob:
    """`job` as one host's assignment lists it: its workers there, its epoch and node count, plan and settings."""
    return AssignedJob(
        tenant=job.tenant_id,
        job=job.id,
        workers=workers,
        gpus=workers * job.gpus_per_worker,
        parallel_plan=job.parallel_plan,
        entrypoint=tuple(job.entrypoint or ()),
        epoch=epoch,
        nodes=nodes,
        restart=restart,
        ranges=job_ranges(job),
        directives=job_directives(job),
        approvals=approvals,
        standby_until=standby_until,
    )


async def _renew_epochs(
    session: AsyncSession, host_ids: set[str], *, now: datetime, restart: RestartMode
) -> set[str]:
    """Bump the epoch of every job whose node set or plan changed on `host_ids`; returns every host those jobs use(d).

    Candidates are the jobs with a live allocation on these hosts or one released in this transaction (released at
    `now`, the timestamp every release path of the caller's transaction uses). A job whose hosts change must be
    rewritten on *all* its hosts, old and new: each node's rendezvous is sized by the job's node count.
    """
    if not host_ids:
        return set()
    candidates = (
        select(Allocation.tenant_id, Allocation.job_id)
        .where(
            Allocation.host_id.in_(host_ids),
            or_(Allocation.released_at.is_(None), Allocation.released_at >= now),
        )
        .distinct()
    )
    jobs = list(await session.scalars(
        select(Job)
        .where(tuple_(Job.tenant_id, Job.id).in_(candidates))
        .order_by(Job.tenant_id, Job.id)
        .execution_options(populate_existing=True)
    ))
    placements = await _placements(session, candidates, now=now)
    touched: set[str] = set()
    for job in jobs:
        placement = _placement(job, placements.get((job.tenant_id, job.id), {}))
        if placement == job.placement:
            continue
        # the row is about to change: lock it now and read the phase a concurrent progress report may have moved
        await session.refresh(job, ["phase"], with_for_update=True)
        old_hosts = set(_placement_hosts(job.placement))
        job.placement = placement
        job.placement_epoch = job.placement_epoch + 1
        job.restart_mode = restart
        advance(job, epoch_event(workers_placed=bool(_placement_hosts(placement)), restart=restart))
        touched |= old_hosts | set(_placement_hosts(placement))
    await session.flush()
    return touched


async def write_host_assignments(
    session: AsyncSession,
    host_ids: Iterable[str],
    *,
    now: datetime,
    restart: RestartMode = RestartMode.GRACEFUL,
) -> list[HostAssignment]:
    """Bump each host's generation and queue its recomputed assignment; no commit (the caller's transaction).

    Jobs whose node set or plan changed get a new epoch first (`restart` says how their nodes move to it), and
    every host of such a job is rewritten too.
    """
    hosts = set(host_ids)
    hosts |= await _renew_epochs(session, hosts, now=now, restart=restart)
    bumped: dict[str, tuple[int, str]] = {}
    for host_id in sorted(hosts):  # one host at a time, in id order: the same lock order in every transaction
        row = (await session.execute(
            update(Host)
            .where(Host.id == host_id)
            .values(generation=Host.generation + 1, assigned_at=now)
            .returning(Host.generation, Host.locality_group)
            .execution_options(synchronize_session=False)
        )).first()
        if row is not None:
            bumped[host_id] = (int(row[0]), str(row[1]))
    assignments = await _compute(session, bumped, now=now) if bumped else []
    for assignment in assignments:
        enqueue_desired_state(session, assignment, now=now)
    return assignments


def placed_hosts(job: Job) -> set[str]:
    """The hosts the job's workers run on now (its stored placement; empty when it runs nowhere)."""
    return set(_placement_hosts(job.placement))


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
