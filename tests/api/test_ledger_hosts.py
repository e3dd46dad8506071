"""The hosts as one job sees them, on SQLite and PostgreSQL: read by their own statement (`host_snapshot`) and as
one JSON column beside other rows (`snapshot_column`, a new request's read), both equal to what the ledger holds:
the healthy hosts with a free GPU in code-point order of their ids (whatever the database's collation), and the
job's GPUs on each of its hosts, full or down ones included.
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime

import httpx
from fastapi import FastAPI
from sqlalchemy import select, update

from api.models import Allocation, Host, Job
from api.services.ledger_hosts import HostSnapshot, host_snapshot, snapshot_column, snapshot_from_column
from tests.api.api_testkit import TenantHandle, create_host, create_job

HOSTS = {"a-2": ("rack-a", 2), "a1": ("rack-a", 1), "a_3": ("rack-b", 4), "b0": ("rack-b", 1), "down": ("rack-b", 2)}


async def _expected(app: FastAPI, job_id: str) -> HostSnapshot:
    """From the tables themselves, computed here."""
    async with app.state.sessionmaker() as session:
        hosts = list(await session.scalars(select(Host)))
        allocations = list(await session.scalars(
            select(Allocation).where(Allocation.job_id == job_id, Allocation.released_at.is_(None))
        ))
    groups = {host.id: host.locality_group for host in hosts}
    used = Counter[str]()
    for allocation in allocations:
        used[allocation.host_id] += allocation.gpus
    rooms = sorted(
        (host.id, host.locality_group, host.gpus - host.allocated_gpus)
        for host in hosts if host.gpus > host.allocated_gpus and host.down_at is None
    )
    return HostSnapshot(rooms=tuple(rooms), usage={host: (groups[host], gpus) for host, gpus in used.items()})


async def _both(app: FastAPI, job_id: str) -> tuple[HostSnapshot, HostSnapshot]:
    async with app.state.sessionmaker() as session:
        job = await session.scalar(select(Job).where(Job.id == job_id))
        assert job is not None
        own = await host_snapshot(session, job)
        column = snapshot_column(session.get_bind().dialect.name)
        entries = await session.scalar(select(column), {"tenant_id": job.tenant_id, "job_id": job.id})
        return own, snapshot_from_column(entries)


async def test_both_reads_of_the_hosts_equal_the_ledger(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    async with app.state.sessionmaker() as session:
        assert snapshot_from_column(
            await session.scalar(select(snapshot_column(session.get_bind().dialect.name)),
                                 {"tenant_id": "acme", "job_id": "none"})
        ) == HostSnapshot(rooms=(), usage={}), "no host at all"
    for host, (group, gpus) in HOSTS.items():
        await create_host(client, host, gpus=gpus, group=group)
    await create_job(client, acme, "train", max_workers=6, initial_workers=5, entrypoint=["-m", "x"])
    await create_job(client, acme, "other", max_workers=2, initial_workers=1, entrypoint=["-m", "x"])
    async with app.state.sessionmaker() as session:
        await session.execute(update(Host).where(Host.id == "down").values(down_at=datetime.now(UTC)))
        await session.commit()

    expected = await _expected(app, "train")
    assert sum(gpus for _, gpus in expected.usage.values()) == 5
    assert any(host not in {room[0] for room in expected.rooms} for host in expected.usage), "a full host of its own"
    own, column = await _both(app, "train")
    assert own == column == expected
    assert [room[0] for room in own.rooms] == sorted(room[0] for room in own.rooms)
    assert "down" not in {room[0] for room in own.rooms}
    assert await _both(app, "other") == (await _expected(app, "other"),) * 2
