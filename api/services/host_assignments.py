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

import functools
import json
from collections.abc import Iterable
from datetime import datetime
from typing import Protocol, cast

from sqlalchemy import ColumnElement, Table, bindparam, func, or_, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncSession

from api.db import execute_core
from api.models import Allocation, Host, Job, Negotiation
from api.models_standby import StandbyNode
from api.services.approval_commands import open_approvals
from api.services.job_lifecycle import advance, epoch_event
from api.services.ledger_lock import lock_ledger
from api.services.outbox import enqueue_desired_state
from harmonaize.desired_state import AssignedJob, HostAssignment, MaintenanceApproval, RestartMode
from harmonaize.job_runtime import Directives, JobRanges
from harmonaize.jobs import Compression, ParallelPlan
from harmonaize.negotiation import NegotiationState
from harmonaize.ranges import IntRange

_A, _J, _H = Allocation.__table__.c, Job.__table__.c, Host.__table__.c
_EFFECTIVE: tuple[ColumnElement[bool], ColumnElement[bool]] = (
    _A.released_at.is_(None), or_(_A.starts_at.is_(None), _A.starts_at <= bindparam("now"))
)
"""Allocations that hold capacity at `now` (a parameter): not released, and started (a reservation counts from its
start). The statements below are built once, on the tables, with parameters (`api.db.execute_core`): an accept runs
all of them, and building them, or running them as ORM statements, cost more CPU than SQLite takes to run them."""


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
"""The columns `AssignableJob` names, in a statement's select list (each row is then read by attribute)."""


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


def _placement_hosts(placement: dict[str, object] | None) -> dict[str, int]:
    """Workers per host in a stored placement (as `_placement` writes it); empty for a job placed nowhere.

    The JSON column is typed loosely, so the shape written below is restated here, once.
    """
    return cast("dict[str, int]", (placement or {}).get("hosts") or {})


_CANDIDATES = (
    select(_A.tenant_id, _A.job_id)
    .where(
        _A.host_id.in_(bindparam("hosts", expanding=True)),
        or_(_A.released_at.is_(None), _A.released_at >= bindparam("now")),
    )
    .distinct()
)
"""`_renew_epochs`' candidates: the jobs with a live allocation on `hosts` or one released at `now` or later."""
_CANDIDATE_JOBS = (
    select(_J.tenant_id, _J.id, _J.gpus_per_worker, _J.parallel_plan, _J.placement)
    .where(tuple_(_J.tenant_id, _J.id).in_(_CANDIDATES))
    .order_by(_J.tenant_id, _J.id)
)
_CANDIDATE_PLACEMENTS = (
    select(_A.tenant_id, _A.job_id, _A.host_id, func.sum(_A.gpus))
    .where(tuple_(_A.tenant_id, _A.job_id).in_(_CANDIDATES), *_EFFECTIVE)
    .group_by(_A.tenant_id, _A.job_id, _A.host_id)
)
"""GPUs per host now of every candidate job."""


async def _placements(session: AsyncSession, params: dict[str, object]) -> dict[tuple[str, str], dict[str, int]]:
    """GPUs per host now of every candidate job (tenant, job), in one statement."""
    found: dict[tuple[str, str], dict[str, int]] = {}
    for tenant_id, job_id, host_id, gpus in await execute_core(session, _CANDIDATE_PLACEMENTS, params):
        found.setdefault((tenant_id, job_id), {})[host_id] = int(gpus)
    return found


def _placement(gpus_per_worker: int, plan: ParallelPlan, gpus_by_host: dict[str, int]) -> dict[str, object]:
    """A job's effective node set: workers per host (whole workers only), and the plan they run."""
    hosts = {host: gpus // gpus_per_worker for host, gpus in gpus_by_host.items() if gpus >= gpus_per_worker}
    return {"plan": plan.value, "hosts": dict(sorted(hosts.items()))}


_PLACED_JOBS = (
    select(_A.host_id, func.sum(_A.gpus), *_ASSIGNED_COLUMNS)
    .join(Job.__table__, (_J.tenant_id == _A.tenant_id) & (_J.id == _A.job_id))
    .where(_A.host_id.in_(bindparam("hosts", expanding=True)), *_EFFECTIVE)
    .group_by(_A.host_id, _J.tenant_id, _J.id)
    .order_by(_A.host_id, _J.tenant_id, _J.id)
)
"""The jobs with effective allocations on `hosts`, with their GPUs there."""


async def _compute(
    session: AsyncSession, hosts: dict[str, tuple[int, str]], *, now: datetime
) -> list[HostAssignment]:
    """The assignments of `hosts` (id -> its generation and group), in id order, read in three statements however
    many hosts: their jobs, those jobs' open approvals, and the standby nodes on them."""
    rows = await execute_core(session, _PLACED_JOBS, {"hosts": list(hosts), "now": now})
    placed: dict[str, list[tuple[AssignableJob, int]]] = {}
    for row in rows:
        placed.setdefault(row[0], []).append((cast("AssignableJob", row), int(row[1])))
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
        host_id, workers, expires_at, job = row[0], row[1], row[2], cast("AssignableJob", row)
        on_host = standby.setdefault(host_id, {})
        if (job.tenant_id, job.id) in on_host or not job.entrypoint:
            continue
        on_host[(job.tenant_id, job.id)] = _assigned(
            job, workers=workers, epoch=job.placement_epoch + 1, nodes=len(_placement_hosts(job.placement)) + 1,
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
    params: dict[str, object] = {"hosts": list(host_ids), "now": now}
    # the jobs' columns only: hydrating every job on the hosts as an object was about a quarter of an accept's CPU
    jobs = (await execute_core(session, _CANDIDATE_JOBS, params)).all()
    placements = await _placements(session, params)
    touched: set[str] = set()
    for tenant_id, job_id, gpus_per_worker, plan, stored in jobs:
        placement = _placement(gpus_per_worker, plan, placements.get((tenant_id, job_id), {}))
        if placement == stored:
            continue
        # the row is about to change: lock it now and read it afresh (the phase a concurrent progress report may
        # have moved); the session's object for the job, if it holds one, is the one refreshed and changed
        job = await session.get(Job, (tenant_id, job_id), with_for_update=True, populate_existing=True)
        if job is None:
            continue
        old_hosts = set(_placement_hosts(job.placement))
        job.placement = placement
        job.placement_epoch = job.placement_epoch + 1
        job.restart_mode = restart
        advance(job, epoch_event(workers_placed=bool(_placement_hosts(placement)), restart=restart))
        touched |= old_hosts | set(_placement_hosts(placement))
    await session.flush()
    return touched


_BUMP_GENERATION = (
    update(cast("Table", Host.__table__))
    .where(_H.id == bindparam("host_id"))
    .values(generation=_H.generation + 1, assigned_at=bindparam("now", type_=_H.assigned_at.type))
    .returning(_H.generation, _H.locality_group)
)


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
        row = (await execute_core(session, _BUMP_GENERATION, {"host_id": host_id, "now": now})).first()
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
