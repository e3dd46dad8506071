"""Where new workers of a job would go: the hosts with room, ranked (shared by `ledger.place_workers` and its preview).

A ranking only, from one snapshot: the conditional updates in `ledger` decide what is actually granted.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ColumnElement, Select, bindparam, func, or_, select, type_coerce
from sqlalchemy.ext.asyncio import AsyncSession

from api.db import execute_core
from api.models import Allocation, Host, Job

__all__ = ["HostRoom", "HostSnapshot", "host_preference", "host_snapshot", "snapshot_column", "snapshot_from_column"]

HostRoom = tuple[str, str, int]
"""(host, locality group, free GPUs) of a healthy host."""


@dataclass(frozen=True)
class HostSnapshot:
    """One read of the hosts as one job sees them: where there is room, and where the job already is."""

    rooms: tuple[HostRoom, ...]
    """Every healthy (not down) host with a free GPU, in id order."""
    usage: dict[str, tuple[str, int]]
    """The job's live GPUs (effective or reserved) per host, with the host's locality group."""


def _snapshot_statement(
    tenant_param: str = "tenant_id", job_param: str = "job_id"
) -> Select[str, str, int, datetime | None, int | None]:
    allocation, host = Allocation.__table__.c, Host.__table__.c
    used = (
        select(allocation.host_id, func.sum(allocation.gpus).label("gpus"))
        .where(
            allocation.tenant_id == bindparam(tenant_param),
            allocation.job_id == bindparam(job_param),
            allocation.released_at.is_(None),
        )
        .group_by(allocation.host_id)
        .subquery()
    )
    free = (host.gpus - host.allocated_gpus).label("free")
    return (
        select(host.id, host.locality_group, free, host.down_at, used.c.gpus)
        .outerjoin(used, used.c.host_id == host.id)
        .where(or_((free > 0) & host.down_at.is_(None), used.c.gpus.is_not(None)))
    )


_SNAPSHOT = _snapshot_statement()
"""Built once, on the tables (`api.db.execute_core`): an offer, its warm joiners and a placement all read it, and
building it (a subquery) cost more CPU than SQLite takes to run it."""


async def host_snapshot(session: AsyncSession, job: Job) -> HostSnapshot:
    """The hosts with room and the job's own hosts, in one statement (an offer, its warm joiners, a placement)."""
    rows = await execute_core(session, _SNAPSHOT, {"tenant_id": job.tenant_id, "job_id": job.id})
    return _snapshot(sorted((host, group, free, down_at is None, gpus) for host, group, free, down_at, gpus in rows))


def snapshot_column(
    dialect: str, *, tenant_param: str = "tenant_id", job_param: str = "job_id"
) -> ColumnElement[Any]:
    """`host_snapshot` of the job named by the parameters `tenant_param` and `job_param`, as one JSON array column
    (one `[host, group, free GPUs, up, the job's GPUs]` per host, in no order), for a statement that reads it beside
    other rows: a new request reads it with its key and job (`negotiation_store.load_for_open`), an accepted grow
    with the update of its job's counters (`ledger.change_job_workers_reading`), one round trip each."""
    rows = _snapshot_statement(tenant_param, job_param).subquery()
    up = rows.c.down_at.is_(None)
    if dialect == "postgresql":
        entries = func.json_agg(func.json_build_array(rows.c.id, rows.c.locality_group, rows.c.free, up, rows.c.gpus))
    else:
        entries = func.json_group_array(func.json_array(rows.c.id, rows.c.locality_group, rows.c.free, up, rows.c.gpus))
    return type_coerce(select(entries).scalar_subquery(), JSON).label("host_snapshot")


def snapshot_from_column(entries: list[list[Any]] | None) -> HostSnapshot:
    """The `HostSnapshot` a `snapshot_column` read holds (None: no host at all)."""
    return _snapshot(sorted((str(e[0]), str(e[1]), e[2], bool(e[3]), e[4]) for e in entries or ()))


def _snapshot(rows: Iterable[tuple[str, str, int, bool, int | None]]) -> HostSnapshot:
    """From (host, group, free GPUs, up, the job's GPUs there), sorted here by id in code-point order (as the ledger
    locks hosts; a database's collation may sort otherwise), whichever statement read them."""
    rooms: list[HostRoom] = []
    usage: dict[str, tuple[str, int]] = {}
    for host_id, group, host_free, up, gpus in rows:
        if int(host_free) > 0 and up:
            rooms.append((host_id, group, int(host_free)))
        if gpus is not None:
            usage[host_id] = (group, int(gpus))
    return HostSnapshot(rooms=tuple(rooms), usage=usage)


async def host_preference(
    session: AsyncSession, job: Job, exclude: Collection[str] = (), *, snapshot: HostSnapshot | None = None
) -> list[HostRoom]:
    """(host, group, free GPUs) of hosts with room for a worker, best first: hosts the job already uses, then its
    locality groups, then the group with most room (so new workers stay together), then the roomiest host. Hosts in
    `exclude` are never candidates. `snapshot`: `host_snapshot` if already read in this transaction (a hint)."""
    snapshot = await host_snapshot(session, job) if snapshot is None else snapshot
    used_hosts: dict[str, int] = {}
    used_groups: dict[str, int] = {}
    for host_id, (group, gpus) in snapshot.usage.items():
        used_hosts[host_id] = gpus
        used_groups[group] = used_groups.get(group, 0) + gpus
    rows = [row for row in snapshot.rooms if row[2] >= job.gpus_per_worker and row[0] not in exclude]
    group_room: dict[str, int] = {}
    for _, group, host_free in rows:
        group_room[group] = group_room.get(group, 0) + host_free // job.gpus_per_worker
    return sorted(
        rows,
        key=lambda row: (
            -used_hosts.get(row[0], 0), -used_groups.get(row[1], 0), -group_room[row[1]], row[1], -row[2], row[0],
        ),
    )
