"""The capacity ledger: GPUs of a host granted to jobs, never more than the host has, never more than the job may use.

The guarantee comes from the database, not from a read-then-write in Python. Granting n GPUs is one conditional
statement per counter,

    UPDATE hosts SET allocated_gpus = allocated_gpus + :n WHERE id = :host AND allocated_gpus + :n <= gpus
    UPDATE jobs SET desired_workers = desired_workers + :w, allocated_gpus = allocated_gpus + :n
        WHERE <job> AND desired_workers + :w <= max_workers

and the rowcount says whether it happened. It is correct on PostgreSQL (the row lock makes a concurrent update
re-check the condition against the committed value) and on SQLite (one writer at a time), and CHECK constraints
refuse anything that slips past it. Allocation rows are inserted in the same transaction, so rows and totals move
together (`ledger_rows`: one statement for both on PostgreSQL). Allocations are whole workers: `gpus_per_worker`
GPUs on ONE host each (a worker cannot span hosts).

Placing reads candidate hosts and tries the conditional update on each; losing a race on one host only moves on to the
next, and a few re-reads pick up space freed meanwhile. A snapshot that says "room" is only ever a hint.

`place_workers` / `release_workers` / `release_workers_on` / `change_job_workers` work inside the caller's
transaction (a negotiation's acceptance, a job's creation); the admin's one-shot use cases that commit are in
`allocations`. Every change queues the new desired state of the hosts it touched (`host_assignments`).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Integer, ScalarSelect, Table, bindparam, func, select, update
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm.attributes import set_committed_value

from api.db import execute_core, rows_matched
from api.models import Allocation, Host, Job
from api.models_quarantines import left_recently
from api.services import ledger_rows
from api.services.errors import ConflictError, InsufficientCapacityError, JobLimitError
from api.services.ledger_hosts import (
    HostRoom,
    HostSnapshot,
    host_preference,
    host_snapshot,
    snapshot_column,
    snapshot_from_column,
)
from api.services.ledger_lock import (
    held_already,
    held_by_update,
    hold_hosts,
    lock_left_to_update,
    locked_hosts_of_job,
)
from harmonaize.timeids import uuid7
from harmonaize.times import parse_rfc3339

PLACEMENT_ROUNDS = 3
"""Re-reads of the candidate hosts before giving up: each round only starts if the previous one lost every race."""


@dataclass(frozen=True)
class Placement:
    """An allocation with its host's locality group (which the allocation row does not store)."""

    allocation: Allocation
    locality_group: str


_HOSTS, _JOBS, _ALLOCATIONS = (cast("Table", model.__table__) for model in (Host, Job, Allocation))
_H, _J, _A = _HOSTS.c, _JOBS.c, _ALLOCATIONS.c
_DELTA = bindparam("delta", type_=Integer())
_WORKERS_WITHIN_LIMITS = (
    _J.tenant_id == bindparam("tenant"),
    _J.id == bindparam("job"),
    _J.desired_workers + _DELTA <= _J.max_workers,
    _J.desired_workers + _DELTA >= 0,
)
_WORKERS_MOVED = {
    "desired_workers": _J.desired_workers + _DELTA, "allocated_gpus": _J.allocated_gpus + _DELTA * _J.gpus_per_worker,
}
_CHANGE_WORKERS = update(_JOBS).where(*_WORKERS_WITHIN_LIMITS).values(_WORKERS_MOVED)
_CHANGE_WORKERS_FROM = _CHANGE_WORKERS.where(_J.desired_workers == bindparam("expected"))
_CHANGE_WORKERS_READING = (  # the same update on the mapped class, so that it can return the job as an object
    update(Job)
    .where(*_WORKERS_WITHIN_LIMITS, _J.desired_workers == bindparam("expected"))
    .values(_WORKERS_MOVED)
    .returning(Job, left_recently().label("left_recently"))
    .execution_options(populate_existing=True, synchronize_session=False)
)
_MOST_RECENT_FIRST = (
    select(Allocation)
    .where(
        Allocation.tenant_id == bindparam("tenant"), Allocation.job_id == bindparam("job"),
        Allocation.released_at.is_(None),
    )
    .order_by(Allocation.created_at.desc(), Allocation.id.desc())
)
"""A job's live allocations, the most recent first (the ones a shrink releases); rows made at the same time (one
transaction's, or under a test's frozen clock) in the order they were made, by their time-ordered ids."""


def _most_recent_first_column() -> ScalarSelect[Any]:
    """`_MOST_RECENT_FIRST` as one JSON array (`[id, host, GPUs, created_at, starts_at]` each, in that order), for
    the update of the job's row to read beside it (PostgreSQL)."""
    columns = (_A.id, _A.host_id, _A.gpus, _A.created_at, _A.starts_at)
    live = _MOST_RECENT_FIRST.with_only_columns(*columns).order_by(None).subquery()  # ordered by the aggregate
    entry = func.json_build_array(live.c.id, live.c.host_id, live.c.gpus, live.c.created_at, live.c.starts_at)
    newest_first = aggregate_order_by(entry, live.c.created_at.desc(), live.c.id.desc())
    return select(func.json_agg(newest_first)).scalar_subquery()


_SHRINK_READING = _CHANGE_WORKERS_READING.returning(
    locked_hosts_of_job().label("locked_hosts"), _most_recent_first_column().label("most_recent_first")
)
"""For a shrink, whose hosts are the job's own: they are locked by the same statement, which reads the allocations
it releases too. Not for a grow, whose new hosts, chosen later, may sort before them (`ledger_lock.hold_hosts` then
locks all of them at once)."""
_GROW_READING = _CHANGE_WORKERS_READING.returning(snapshot_column("postgresql", tenant_param="tenant", job_param="job"))
"""For a grow: the hosts as its placement starts from (`host_snapshot`), read by the same statement. The update
writes no host or allocation row, so the read sees what a statement of its own after it would."""


@dataclass(frozen=True)
class CountersMoved:
    """What the counters' update of `change_job_workers_reading` read besides the job."""

    hosts: HostSnapshot | None = None
    """A grow's: the hosts with room and the job's own, for `place_workers`' first round."""
    most_recent_first: list[Allocation] | None = None
    """A shrink's: the job's live allocations, the most recent first, for `release_workers`."""


async def change_job_workers(
    session: AsyncSession, job: Job, workers: int, *, expected_workers: int | None = None
) -> None:
    """Move the job's counters by `workers` (negative: fewer), within 0..max_workers, or raise JobLimitError.

    `expected_workers` makes the update conditional on the size the caller read (a negotiated target is absolute:
    if the job changed meanwhile, the delta computed from the old size would be wrong).
    """
    params = {"tenant": job.tenant_id, "job": job.id, "delta": workers}
    if expected_workers is None:
        result = await execute_core(session, _CHANGE_WORKERS, params)
    else:
        result = await execute_core(session, _CHANGE_WORKERS_FROM, {**params, "expected": expected_workers})
    if rows_matched(result) != 1:
        if expected_workers is not None:
            current = await session.scalar(
                select(Job.desired_workers).where(Job.tenant_id == job.tenant_id, Job.id == job.id)
            )
            if current != expected_workers:
                raise ConflictError(f"job {job.id!r} changed meanwhile (now {current} workers): ask again")
        raise JobLimitError(f"job {job.id!r} may have at most {job.max_workers} workers")


async def change_job_workers_reading(
    session: AsyncSession, job: Job, workers: int, *, expected_workers: int, quarantine_since: datetime
) -> CountersMoved | None:
    """`change_job_workers` with `expected_workers`, for a `job` read before the caller waited for the ledger lock:
    the same statement returns the job's row as it is now, which refreshes `job` (whether it left a host since
    `quarantine_since` included), so the update doubles as the read again. A shrink's also locks the job's hosts,
    after its row, as `ledger_lock.hold_hosts` would in a statement of its own; a grow's reads the hosts its
    placement starts from (only PostgreSQL runs this). None, with nothing changed, when the update did not apply (the
    job changed meanwhile, or the limits refuse): read the job again and decide anew.
    """
    params = {
        "tenant": job.tenant_id, "job": job.id, "delta": workers, "expected": expected_workers,
        "quarantine_since": quarantine_since,
    }
    shrink = workers < 0
    row = (await session.execute(_SHRINK_READING if shrink else _GROW_READING, params)).first()
    if row is None:
        return None
    set_committed_value(job, "left_hosts_recently", bool(row[1]))
    if shrink:
        held_already(session, row[2] or ())
        return CountersMoved(most_recent_first=[_allocation_from_entry(job, entry) for entry in row[3] or ()])
    return CountersMoved(hosts=snapshot_from_column(row[2]))


def _allocation_from_entry(job: Job, entry: list[Any]) -> Allocation:
    """A live allocation of `job` as `_most_recent_first_column` holds it (timestamps in ISO 8601, with offset)."""
    allocation_id, host_id, gpus, created_at, starts_at = entry
    return Allocation(
        id=allocation_id, tenant_id=job.tenant_id, job_id=job.id, host_id=host_id, gpus=int(gpus),
        created_at=parse_rfc3339(created_at), starts_at=None if starts_at is None else parse_rfc3339(starts_at),
        released_at=None,
    )


async def place_workers(
    session: AsyncSession,
    job: Job,
    count: int,
    *,
    now: datetime,
    starts_at: datetime | None = None,
    exclude_hosts: Collection[str] = (),
    snapshot: HostSnapshot | None = None,
) -> list[Placement]:
    """Reserve `count` more workers for `job`, one allocation row per worker, inside the caller's transaction.

    The job's own counters are not touched (see `change_job_workers`). `exclude_hosts` are never used (the hosts a
    replacement moves workers off). `snapshot`: `host_snapshot` read already in this transaction, for the first
    round. Raises InsufficientCapacityError when not all fit; the caller must then roll back, which undoes the
    workers placed so far.
    """
    placed: list[Placement] = []
    per_worker = job.gpus_per_worker
    for _ in range(PLACEMENT_ROUNDS):
        if snapshot is None:
            snapshot = await host_snapshot(session, job)
        ranked = await host_preference(session, job, exclude_hosts, snapshot=snapshot)
        # the ledger held shared: the job's hosts and the ones the workers should go to, locked in one go before any
        # is written (`ledger_lock`), or by the first grant's own update when that is all of them; a host reached
        # only after losing a race is locked when it is reached
        planned = set(snapshot.usage) | set(_fill(ranked, count - len(placed), per_worker))
        by_update = bool(ranked) and lock_left_to_update(session, planned, ranked[0][0])
        if not by_update:
            await hold_hosts(session, planned)
        for host_id, group, _free in ranked:
            if not by_update:
                await hold_hosts(session, (host_id,))
            while len(placed) < count:
                allocation = Allocation(
                    id=new_allocation_id(),
                    tenant_id=job.tenant_id,
                    job_id=job.id,
                    host_id=host_id,
                    gpus=per_worker,
                    created_at=now,
                    starts_at=starts_at,
                )
                sent_at = time.perf_counter()
                granted = await ledger_rows.grant(session, allocation)
                if by_update:  # that grant's update locked the host if it matched; if not, lock it before the next
                    by_update = False
                    if granted:
                        held_by_update(session, host_id, sent_at=sent_at)
                    else:
                        await hold_hosts(session, (host_id,))
                if not granted:
                    break
                placed.append(Placement(allocation=allocation, locality_group=group))
            if len(placed) == count:
                return placed
        snapshot = None  # lost every race: the next round reads the hosts again
    raise InsufficientCapacityError(
        f"not enough free capacity: room for {len(placed)} of the {count} more workers "
        f"({per_worker} GPU(s) each, on one host)"
    )


def _fill(ranked: list[HostRoom], count: int, per_worker: int) -> dict[str, int]:
    """Workers per host if `count` of them took the hosts of `ranked` (`host_preference`) in turn, as far as they go."""
    plan: dict[str, int] = {}
    for host_id, _group, free in ranked:
        if take := min(count - sum(plan.values()), free // per_worker):
            plan[host_id] = take
    return plan


async def preview_placement(
    session: AsyncSession, job: Job, count: int, *, exclude_hosts: Collection[str] = (),
    snapshot: HostSnapshot | None = None,
) -> dict[str, int] | None:
    """Where `place_workers` would put `count` more workers now (workers per host), reserving nothing; None when
    they do not fit. A guess: the ledger may change before anything is placed."""
    plan = _fill(await host_preference(session, job, exclude_hosts, snapshot=snapshot), count, job.gpus_per_worker)
    return plan if sum(plan.values()) == count else None


def new_allocation_id() -> str:
    """A time-ordered id (a UUIDv7's 32 hex digits): among rows with one `created_at`, the larger id is the later row,
    so "the most recent workers" is exact, where random ids made a shrink release one of them at random."""
    return uuid7().replace("-", "")


async def release_workers(
    session: AsyncSession, job: Job, count: int, *, now: datetime, most_recent_first: Sequence[Allocation] | None = None
) -> set[str]:
    """Release the job's `count` most recent workers inside the caller's transaction; returns the hosts touched.

    A row holding several workers (an admin allocation) is released whole and its remainder re-inserted on the same
    host, so rows stay an exact record of what was granted when. `most_recent_first`: the job's live allocations,
    read already in this transaction (`change_job_workers_reading`).
    """
    rows = most_recent_first
    if rows is None:
        rows = (await session.scalars(_MOST_RECENT_FIRST, {"tenant": job.tenant_id, "job": job.id})).all()
    # the ledger held shared: every host of the job is rewritten (its epoch moves on), so all are locked first
    await hold_hosts(session, {allocation.host_id for allocation in rows})
    remaining = count * job.gpus_per_worker
    hosts: set[str] = set()
    for allocation in rows:
        if remaining <= 0:
            break
        take = min(allocation.gpus, remaining)
        await ledger_rows.release(session, allocation, give=take, now=now)
        if take < allocation.gpus:
            session.add(
                Allocation(
                    id=new_allocation_id(),
                    tenant_id=job.tenant_id,
                    job_id=job.id,
                    host_id=allocation.host_id,
                    gpus=allocation.gpus - take,
                    created_at=now,
                    starts_at=allocation.starts_at,
                )
            )
        remaining -= take
        hosts.add(allocation.host_id)
    if remaining > 0:
        raise RuntimeError(f"ledger inconsistent: job {job.id!r} holds fewer workers than its desired_workers")
    await session.flush()
    return hosts


async def release_workers_on(session: AsyncSession, job: Job, host_ids: Collection[str], *, now: datetime) -> int:
    """Release every live allocation of `job` on `host_ids` inside the caller's transaction; returns the workers
    released. The job's counters are not touched (see `change_job_workers`)."""
    rows = await session.scalars(
        select(Allocation)
        .where(
            Allocation.tenant_id == job.tenant_id,
            Allocation.job_id == job.id,
            Allocation.host_id.in_(list(host_ids)),
            Allocation.released_at.is_(None),
        )
        .order_by(Allocation.id)
    )
    gpus = 0
    for allocation in rows:
        await ledger_rows.release(session, allocation, give=allocation.gpus, now=now)
        gpus += allocation.gpus
    await session.flush()
    return gpus // job.gpus_per_worker
