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
host of the job (old and new) is rewritten (`placement_epochs`). Directives (the micro loop's settings) travel in
the same assignment but do not change the epoch: the running job applies them at a step boundary, without a
restart.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, NamedTuple, Protocol, cast

from sqlalchemy import Row, Table, bindparam, exists, func, literal_column, or_, select, true, update
from sqlalchemy.ext.asyncio import AsyncSession

from api.db import execute_core
from api.models import Allocation, Host, Job, Negotiation
from api.models_standby import StandbyNode
from api.services.approval_commands import ANY_OPEN, APPROVAL_TTL, open_approvals
from api.services.ledger_lock import lock_ledger
from api.services.outbox import enqueue_desired_state
from api.services.placement_epochs import EFFECTIVE, placement_hosts, renew_epochs
from harmonaize.desired_state import AssignedJob, HostAssignment, MaintenanceApproval, RestartMode
from harmonaize.job_runtime import Directives, JobRanges
from harmonaize.jobs import Compression, ParallelPlan
from harmonaize.negotiation import NegotiationState
from harmonaize.ranges import IntRange

_A, _J, _H = Allocation.__table__.c, Job.__table__.c, Host.__table__.c


class AssignableJob(Protocol):
    """What an assignment and a job's runtime settings read of a job: a `Job`, or a row of `_ASSIGNED_COLUMNS`
    (an assignment lists every job on its host: rows are read for them, rather than objects hydrated)."""

    @property
    def tenant_id(self) -> str: ...
    @property
    def id(self) -> str: ...
    @property
    def gpus_per_worker(self) -> int: ...
    @property
    def parallel_plan(self) -> ParallelPlan: ...
    @property
    def entrypoint(self) -> list[str]: ...
    @property
    def placement(self) -> dict[str, object] | None: ...
    @property
    def placement_epoch(self) -> int: ...
    @property
    def restart_mode(self) -> RestartMode: ...
    @property
    def directives(self) -> dict[str, object] | None: ...
    @property
    def checkpoint_interval_steps_min(self) -> int: ...
    @property
    def checkpoint_interval_steps_max(self) -> int: ...
    @property
    def compression_allowed(self) -> list[str]: ...
    @property
    def powersgd_max_rank(self) -> int | None: ...
    @property
    def batch_size_min(self) -> int | None: ...
    @property
    def batch_size_max(self) -> int | None: ...
    @property
    def grad_accumulation_min(self) -> int: ...
    @property
    def grad_accumulation_max(self) -> int: ...
    @property
    def global_batch(self) -> int | None: ...


_ASSIGNED_COLUMNS = (
    _J.tenant_id, _J.id, _J.gpus_per_worker, _J.parallel_plan, _J.entrypoint, _J.placement, _J.placement_epoch,
    _J.restart_mode, _J.directives, _J.checkpoint_interval_steps_min, _J.checkpoint_interval_steps_max,
    _J.compression_allowed, _J.powersgd_max_rank, _J.batch_size_min, _J.batch_size_max, _J.grad_accumulation_min,
    _J.grad_accumulation_max, _J.global_batch,
)
"""The columns `AssignableJob` names, in a statement's select list (each row's slice of them is then read as a
`_JobColumns`)."""


class _JobColumns(NamedTuple):
    """`_ASSIGNED_COLUMNS`' values of one row, in their order: an `AssignableJob` whose attributes are read as fast as
    a tuple's items. A SQLAlchemy row's own attribute lookup costs about 0.4 us, twenty times an item's, and an
    assignment reads some twenty of them for every job on its host."""

    tenant_id: str
    id: str
    gpus_per_worker: int
    parallel_plan: ParallelPlan
    entrypoint: list[str]
    placement: dict[str, object] | None
    placement_epoch: int
    restart_mode: RestartMode
    directives: dict[str, object] | None
    checkpoint_interval_steps_min: int
    checkpoint_interval_steps_max: int
    compression_allowed: list[str]
    powersgd_max_rank: int | None
    batch_size_min: int | None
    batch_size_max: int | None
    grad_accumulation_min: int
    grad_accumulation_max: int
    global_batch: int | None


assert _JobColumns._fields == tuple(column.name for column in _ASSIGNED_COLUMNS), "one order, restated once"


def job_ranges(job: AssignableJob) -> JobRanges:
    """The tenant's declared micro-loop ranges of `job`, in the contract's shape (shared with the job's runtime)."""
    return _ranges(
        job.checkpoint_interval_steps_min, job.checkpoint_interval_steps_max, tuple(job.compression_allowed),
        job.powersgd_max_rank, job.batch_size_min, job.batch_size_max, job.grad_accumulation_min,
        job.grad_accumulation_max, job.global_batch,
    )


@functools.lru_cache(maxsize=4096)
def _ranges(
    checkpoint_min: int, checkpoint_max: int, compression: tuple[str, ...], powersgd_max_rank: int | None,
    batch_min: int | None, batch_max: int | None, accumulation_min: int, accumulation_max: int,
    global_batch: int | None,
) -> JobRanges:
    """Memoised by value (the models are frozen, so sharing one is safe): every assignment of a host lists each job
    on it, and validating the same ranges again for each was most of the CPU of writing one."""
    return JobRanges(
        checkpoint_interval_steps=IntRange(min=checkpoint_min, max=checkpoint_max),
        compression_allowed=tuple(Compression(option) for option in compression),
        powersgd_max_rank=powersgd_max_rank,
        batch_size=None if batch_min is None or batch_max is None else IntRange(min=batch_min, max=batch_max),
        gradient_accumulation=IntRange(min=accumulation_min, max=accumulation_max),
        global_batch=global_batch,
    )


def job_directives(job: AssignableJob) -> Directives:
    return Directives() if job.directives is None else Directives.model_validate(job.directives)


_PLACED_JOBS = (
    select(_A.host_id, func.sum(_A.gpus).label("gpus_here"), *_ASSIGNED_COLUMNS)
    .join(Job.__table__, (_J.tenant_id == _A.tenant_id) & (_J.id == _A.job_id))
    .where(_A.host_id.in_(bindparam("hosts", expanding=True)), *EFFECTIVE)
    .group_by(_A.host_id, _J.tenant_id, _J.id)
    .order_by(_A.host_id, _J.tenant_id, _J.id)
)
"""The jobs with effective allocations on `hosts`, with their GPUs there."""


async def _compute(
    session: AsyncSession, hosts: dict[str, tuple[int, str]], rows: Iterable[Sequence[Any]], *, now: datetime,
    approvals_open: bool, standby_rows: bool,
) -> list[HostAssignment]:
    """The assignments of `hosts` (id -> its generation and group), in id order, from `rows` (`_PLACED_JOBS`'s
    columns: their jobs) and at most two more statements however many hosts: those jobs' open approvals (only if any
    is open), and the standby nodes on them (only if a host has any)."""
    placed: dict[str, list[tuple[AssignableJob, int]]] = {}
    for row in rows:
        if (host_id := row[0]) is not None:
            placed.setdefault(host_id, []).append((_JobColumns._make(row[2:]), int(row[1])))
    approvals = await open_approvals(
        session, {(job.tenant_id, job.id) for jobs in placed.values() for job, _ in jobs}, now=now
    ) if approvals_open else {}
    standby = await _standby_jobs(session, list(hosts), now=now) if standby_rows else {}
    assignments = []
    for host_id, (generation, group) in sorted(hosts.items()):
        jobs = [
            _assigned(job, workers=gpus // job.gpus_per_worker, epoch=job.placement_epoch,
                      nodes=len(placement_hosts(job.placement)), restart=job.restart_mode,
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


_S, _N = StandbyNode.__table__.c, Negotiation.__table__.c
_STANDBY = (
    select(_S.host_id, _S.workers, _N.expires_at, *_ASSIGNED_COLUMNS)
    .select_from(StandbyNode.__table__)
    .join(Negotiation.__table__, _N.id == _S.negotiation_id)
    .join(Job.__table__, (_J.tenant_id == _N.tenant_id) & (_J.id == _N.job_id))
    .where(
        _S.host_id.in_(bindparam("hosts", expanding=True)),
        _N.state == NegotiationState.OFFERED,
        _N.expires_at > bindparam("now"),
    )
    .order_by(_S.host_id, _J.tenant_id, _J.id, _N.expires_at.desc())
)
"""The warm joiners on `hosts` of offers still open at `now`, with their jobs."""


async def _standby_jobs(session: AsyncSession, host_ids: list[str], *, now: datetime) -> dict[str, list[AssignedJob]]:
    """Warm joiners per host: jobs an offered, unexpired negotiation would grow onto it (`api.services.standby`).

    Each is the node the accept would start, guessed now: the job's next epoch, one node more.
    """
    rows = await execute_core(session, _STANDBY, {"hosts": host_ids, "now": now})
    standby: dict[str, dict[tuple[str, str], AssignedJob]] = {}
    for row in rows:
        host_id, workers, expires_at, job = row[0], row[1], row[2], _JobColumns._make(row[3:])
        on_host = standby.setdefault(host_id, {})
        if (job.tenant_id, job.id) in on_host or not job.entrypoint:
            continue
        on_host[(job.tenant_id, job.id)] = _assigned(
            job, workers=workers, epoch=job.placement_epoch + 1, nodes=len(placement_hosts(job.placement)) + 1,
            standby_until=expires_at,
        )
    return {host_id: list(jobs.values()) for host_id, jobs in standby.items()}


def _assigned(
    job: AssignableJob, *, workers: int, epoch: int, nodes: int, restart: RestartMode = RestartMode.GRACEFUL,
    standby_until: datetime | None = None, approvals: tuple[MaintenanceApproval, ...] = (),
) -> AssignedJob:
    """`job` as one host's assignment lists it: its workers there, its epoch and node count, plan and settings."""
    directives = None if job.directives is None else json.dumps(job.directives, sort_keys=True)
    return _assigned_job(
        job.tenant_id, job.id, workers, job.gpus_per_worker, job.parallel_plan, tuple(job.entrypoint or ()), epoch,
        nodes, restart, job_ranges(job), directives, approvals, standby_until,
    )


@functools.lru_cache(maxsize=4096)
def _assigned_job(
    tenant: str, job: str, workers: int, gpus_per_worker: int, plan: ParallelPlan, entrypoint: tuple[str, ...],
    epoch: int, nodes: int, restart: RestartMode, ranges: JobRanges, directives: str | None,
    approvals: tuple[MaintenanceApproval, ...], standby_until: datetime | None,
) -> AssignedJob:
    """Memoised by value, as `_ranges` (frozen models): a host's assignment is rewritten whenever one of its jobs
    changes, and the others' entries, unchanged, are the same objects again. `directives`: their canonical JSON."""
    return AssignedJob(
        tenant=tenant,
        job=job,
        workers=workers,
        gpus=workers * gpus_per_worker,
        parallel_plan=plan,
        entrypoint=entrypoint,
        epoch=epoch,
        nodes=nodes,
        restart=restart,
        ranges=ranges,
        directives=Directives() if directives is None else Directives.model_validate_json(directives),
        approvals=approvals,
        standby_until=standby_until,
    )


_BUMP_GENERATION = (
    update(cast("Table", Host.__table__))
    .where(_H.id == bindparam("host_id"))
    .values(generation=_H.generation + 1, assigned_at=bindparam("now", type_=_H.assigned_at.type))
    .returning(
        _H.generation, _H.locality_group, ANY_OPEN.label("approvals_open"),
        exists().where(_S.host_id == _H.id).label("standby_rows"),
    )
)
"""A host's next generation, and whether the assignment has approvals or standby nodes to read: both are rare,
and returning their existence here spares an accept two statements when there are none."""

_BUMPED, _PLACED = _BUMP_GENERATION.cte("bumped"), _PLACED_JOBS.subquery("placed")
_BUMP_WIDTH = len(_BUMPED.c)
_ONE_ROW = select(literal_column("1").label("one")).subquery("one")
_BUMP_AND_READ = (
    select(*_BUMPED.c, *_PLACED.c)
    .select_from(_ONE_ROW.outerjoin(_BUMPED, true()).outerjoin(_PLACED, true()))
    .order_by(_PLACED.c.host_id, _PLACED.c.tenant_id, _PLACED.c.id)
)
"""PostgreSQL: `_BUMP_GENERATION` of one host and `_PLACED_JOBS` of all, in one statement: a row per job placed
(the bump's columns on each), or one row of NULLs past the bump's if none is. The read sees the transaction's
writes before this statement, and it reads no host row, so the bump beside it changes nothing it reads."""


async def write_host_assignments(
    session: AsyncSession,
    host_ids: Iterable[str],
    *,
    now: datetime,
    restart: RestartMode = RestartMode.GRACEFUL,
    job: tuple[str, str] | None = None,
) -> list[HostAssignment]:
    """Bump each host's generation and queue its recomputed assignment; no commit (the caller's transaction).

    Jobs whose node set or plan changed get a new epoch first (`restart` says how their nodes move to it), and
    every host of such a job is rewritten too. `job` (tenant, id): the only job whose allocations or plan changed,
    when the caller knows it (`placement_epochs.renew_epochs`).
    """
    hosts = set(host_ids)
    hosts |= await renew_epochs(session, hosts, now=now, restart=restart, job=job)
    if not hosts:
        return []
    bumps: dict[str, Row[Any]] = {}
    ordered = sorted(hosts)
    params = {"now": now, "approvals_since": now - APPROVAL_TTL, "hosts": ordered}
    combined = session.get_bind().dialect.name == "postgresql"
    # one host at a time, in id order: the same lock order in every transaction; on PostgreSQL the last one's bump
    # goes with the read of every host's jobs
    for host_id in ordered[:-1] if combined else ordered:
        if (bump := (await execute_core(session, _BUMP_GENERATION, {**params, "host_id": host_id})).first()):
            bumps[host_id] = bump
    placed: Sequence[Sequence[Any]] = ()
    if combined:
        rows = (await execute_core(session, _BUMP_AND_READ, {**params, "host_id": ordered[-1]})).all()
        if rows[0].generation is not None:
            bumps[ordered[-1]] = rows[0]
        placed = [row[_BUMP_WIDTH:] for row in rows]
    if not bumps:
        return []
    if not combined:
        placed = (await execute_core(session, _PLACED_JOBS, {"hosts": list(bumps), "now": now})).all()
    assignments = await _compute(
        session,
        {host_id: (int(bump.generation), str(bump.locality_group)) for host_id, bump in bumps.items()},
        placed,
        now=now,
        approvals_open=any(bump.approvals_open for bump in bumps.values()),
        standby_rows=any(bump.standby_rows for bump in bumps.values()),
    )
    for assignment in assignments:
        enqueue_desired_state(session, assignment, now=now)
    return assignments


def placed_hosts(job: Job) -> set[str]:
    """The hosts the job's workers run on now (its stored placement; empty when it runs nowhere)."""
    return set(placement_hosts(job.placement))


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
