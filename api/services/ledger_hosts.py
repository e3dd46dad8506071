"""Where new workers of a job would go: the hosts with room, ranked (shared by `ledger.place_workers` and its preview).

A ranking only, from one snapshot: the conditional updates in `ledger` decide what is actually granted.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Select, bindparam, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from api.db import execute_core
from api.models import Allocation, Host, Job

__all__ = ["HostRoom", "HostSnapshot", "host_preference", "host_snapshot"]

HostRoom = tuple[str, str, int]
"""(host, locality group, free GPUs) of a healthy host."""


@dataclass(frozen=True)
class HostSnapshot:
    """One read of the hosts as one job sees them: where there is room, and where the job already is."""

    rooms: tuple[HostRoom, ...]
    """Every healthy (not down) host with a free GPU, in id order."""
    usage: dict[str, tuple[str, int]]
    """The job's live GPUs (effective or reserved) per host, with the host's locality group."""


def _snapshot_statement() -> Select[str, str, int, datetime | None, int | None]:
    allocation, host = Allocation.__table__.c, Host.__table__.c
    used = (
        select(allocation.host_id, func.sum(allocation.gpus).label("gpus"))
        .where(
            allocation.tenant_id == bindparam("tenant_id"),
            allocation.job_id == bindparam("job_id"),
            allocation.released_at.is_(None),
        )
        .group_by(allocation.host_id)
        .subquery()
    )
    free = host.gpus - host.allocated_gpus
    return (
        select(host.id, host.locality_group, free, host.down_at, used.c.gpus)
        .outerjoin(used, used.c.host_id == host.id)
        .where(or_((free > 0) & host.down_at.is_(None), used.c.gpus.is_not(None)))
        .order_by(host.id)
    )


_SNAPSHOT = _snapshot_statement()
"""Built once, on the tables (`api.db.execute_core`): an offer, its warm joiners and a placement all read it, and
building it (a subquery) cost more CPU than SQLite takes to run it."""


async def host_snapshot(session: AsyncSession, job: Job) -> HostSnapshot:
    """The hosts with room and the job's own hosts, in one statement (an offer, its warm joiners, a placement)."""
    rows = await execute_core(session, _SNAPSHOT, {"tenant_id": job.tenant_id, "job_id": job.id})
    rooms: list[HostRoom] = []
    usage: dict[str, tuple[str, int]] = {}
    for host_id, group, host_free, down_at, gpus in rows:
        if int(host_free) > 0 and down_at is None:
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
