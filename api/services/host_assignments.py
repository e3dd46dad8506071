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

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, NamedTuple, cast

from sqlalchemy import Row, Table, bindparam, exists, func, literal_column, or_, select, true, update
from sqlalchemy.ext.asyncio import AsyncSession

from api.db import execute_core
from api.models import Allocation, Host, Job, Negotiation
from api.models_standby import StandbyNode
from api.services.approval_commands import ANY_OPEN, APPROVAL_TTL, open_approvals
from api.services.assigned_jobs import ASSIGNED_COLUMNS, assignment_payload, entry
from api.services.ledger_lock import hold_hosts, lock_ledger
from api.services.outbox import enqueue_desired_state
from api.services.placement_epochs import EFFECTIVE, placement_hosts, renew_epochs
from harmonaize.desired_state import AssignedJob, HostAssignment, RestartMode
from harmonaize.negotiation import NegotiationState

_A, _J, _H = Allocation.__table__.c, Job.__table__.c, Host.__table__.c


_PLACED_JOBS = (
    select(_A.host_id, func.sum(_A.gpus).label("gpus_here"), *ASSIGNED_COLUMNS)
    .join(Job.__table__, (_J.tenant_id == _A.tenant_id) & (_J.id == _A.job_id))
    .where(_A.host_id.in_(bindparam("hosts", expanding=True)), *EFFECTIVE)
    .group_by(_A.host_id, _J.tenant_id, _J.id)
    .order_by(_A.host_id, _J.tenant_id, _J.id)
)
"""The jobs with effective allocations on `hosts`, with their GPUs there."""


_GPUS_PER_WORKER = [column.name for column in ASSIGNED_COLUMNS].index("gpus_per_worker")


class _Computed(NamedTuple):
    assignment: HostAssignment
    payload: bytes


async def _compute(
    session: AsyncSession, hosts: dict[str, tuple[int, str]], rows: Iterable[Sequence[Any]], *, now: datetime,
    approvals_open: bool, standby_rows: bool,
) -> list[_Computed]:
    """The assignments of `hosts` (id -> its generation and group), in id order, with their payloads, from `rows`
    (`_PLACED_JOBS`'s columns: their jobs) and at most two more statements however many hosts: those jobs' open
    approvals (only if any is open), and the standby nodes on them (only if a host has any)."""
    placed: dict[str, list[tuple[tuple[Any, ...], int]]] = {}
    for row in rows:
        if (host_id := row[0]) is not None:
            job = tuple(row[2:])
            placed.setdefault(host_id, []).append((job, int(row[1]) // job[_GPUS_PER_WORKER]))
    approvals = await open_approvals(
        session, {(job[0], job[1]) for jobs in placed.values() for job, _ in jobs}, now=now
    ) if approvals_open else {}
    standby = await _standby_jobs(session, list(hosts), now=now) if standby_rows else {}
    computed = []
    for host_id, (generation, group) in sorted(hosts.items()):
        entries = [
            entry(job, workers=workers, approvals=approvals.get((job[0], job[1]), ()))
            for job, workers in placed.get(host_id, [])
        ]
        keys = {(e.job.tenant, e.job.job) for e in entries}
        warm = [job for job in standby.get(host_id, []) if (job.tenant, job.job) not in keys]
        assignment = HostAssignment(
            host=host_id, locality_group=group, generation=generation, jobs=tuple(e.job for e in entries),
            standby=tuple(warm), updated_at=now,
        )
        computed.append(_Computed(assignment, assignment_payload(assignment, entries)))
    return computed


_S, _N = StandbyNode.__table__.c, Negotiation.__table__.c
_STANDBY = (
    select(_S.host_id, _S.workers, _N.expires_at, *ASSIGNED_COLUMNS)
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
        host_id, workers, expires_at, job = row[0], row[1], row[2], tuple(row[3:])
        on_host = standby.setdefault(host_id, {})
        if (job[0], job[1]) not in on_host:  # the offer that stays open longest
            on_host[(job[0], job[1])] = entry(job, workers=workers, standby_until=expires_at).job
    return {
        host_id: [job for job in jobs.values() if job.entrypoint] for host_id, jobs in standby.items()
    }


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
    await hold_hosts(session, hosts)
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
    computed = await _compute(
        session,
        {host_id: (int(bump.generation), str(bump.locality_group)) for host_id, bump in bumps.items()},
        placed,
        now=now,
        approvals_open=any(bump.approvals_open for bump in bumps.values()),
        standby_rows=any(bump.standby_rows for bump in bumps.values()),
    )
    for assignment, payload in computed:
        enqueue_desired_state(session, assignment, now=now, payload=payload)
    return [assignment for assignment, _ in computed]


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
