"""The capacity ledger never overcommits a host, under concurrency, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from sqlalchemy import func, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from api.db import make_engine, make_sessionmaker
from api.models import Allocation, Host, Job
from api.schemas import JobCreate
from api.services import allocations, hosts, jobs, ledger
from api.services.errors import ConflictError, InsufficientCapacityError, NotFoundError
from api.services.tenants import TenantRegistry
from harmonaize.settings import Settings
from tests.api.api_memory_broker import InMemoryBroker
from tests.api.api_testkit import ADMIN, TenantHandle, create_host, create_job

REQUESTS = 50
HOSTS = [("h-a1", 4, "rack-a"), ("h-a2", 4, "rack-a"), ("h-b1", 2, "rack-b")]
TOTAL_GPUS = sum(gpus for _, gpus, _ in HOSTS)


@pytest.fixture
async def sessions(migrated_settings: Settings) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    """Sessions on the app's own engine configuration, seeded with one tenant, one job and three hosts."""
    engine = make_engine(migrated_settings.resolved_database_url)
    maker = make_sessionmaker(engine)
    async with maker() as session:
        await TenantRegistry(InMemoryBroker()).create(session, tenant_id="acme", display_name="Acme")
    async with maker() as session:
        spec = JobCreate(id="train", min_workers=1, max_workers=64, batch_size={"min": 8, "max": 8})
        await jobs.create_job(session, tenant_id="acme", spec=spec)
    for host_id, gpus, group in HOSTS:
        async with maker() as session:
            await hosts.create_host(session, host_id, gpus=gpus, locality_group=group)
    try:
        yield maker
    finally:
        await engine.dispose()


async def _ledger_totals(maker: async_sessionmaker[AsyncSession]) -> tuple[int, int]:
    async with maker() as session:
        allocated = await session.scalar(select(func.sum(Host.allocated_gpus)))
        ledger_rows = await session.scalar(
            select(func.coalesce(func.sum(Allocation.gpus), 0)).where(Allocation.released_at.is_(None))
        )
    return int(allocated or 0), int(ledger_rows or 0)


async def test_concurrent_allocations_through_the_service(sessions: async_sessionmaker[AsyncSession]) -> None:
    async def one(index: int) -> bool:
        group = "rack-a" if index % 2 else None
        async with sessions() as session:
            try:
                await allocations.allocate(session, tenant_id="acme", job_id="train", gpus=1, locality_group=group)
            except InsufficientCapacityError:
                return False
            return True

    granted = await asyncio.gather(*(one(index) for index in range(REQUESTS)))
    assert sum(granted) == TOTAL_GPUS
    assert await _ledger_totals(sessions) == (TOTAL_GPUS, TOTAL_GPUS)
    async with sessions() as session:
        for host in await session.scalars(select(Host)):
            assert host.allocated_gpus == host.gpus


async def test_release_returns_gpus_exactly_once(sessions: async_sessionmaker[AsyncSession]) -> None:
    async with sessions() as session:
        placement = await allocations.allocate(session, tenant_id="acme", job_id="train", gpus=2, host_id="h-b1")
    allocation_id = placement.allocation.id

    async def release() -> bool:
        async with sessions() as session:
            try:
                await allocations.release(session, allocation_id)
            except ConflictError:
                return False
            return True

    outcomes = await asyncio.gather(release(), release(), release())
    assert sorted(outcomes) == [False, False, True]
    assert await _ledger_totals(sessions) == (0, 0)


async def test_allocation_scope_and_unknowns(sessions: async_sessionmaker[AsyncSession]) -> None:
    async with sessions() as session:
        placement = await allocations.allocate(
            session, tenant_id="acme", job_id="train", gpus=3, locality_group="rack-a"
        )
        assert placement.locality_group == "rack-a"
        assert placement.allocation.host_id in {"h-a1", "h-a2"}
    async with sessions() as session:
        with pytest.raises(InsufficientCapacityError):
            await allocations.allocate(session, tenant_id="acme", job_id="train", gpus=3, host_id="h-b1")
    for kwargs in ({"host_id": "nope"}, {"locality_group": "nope"}, {"job_id": "nope"}, {"tenant_id": "nope"}):
        arguments = {"tenant_id": "acme", "job_id": "train", "gpus": 1} | kwargs
        async with sessions() as session:
            with pytest.raises(NotFoundError):
                await allocations.allocate(session, **arguments)  # type: ignore[arg-type]
    assert await _ledger_totals(sessions) == (3, 3)


async def test_database_refuses_overcommit_even_without_the_ledger(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """The CHECK constraint is the backstop for any code path that bypasses the conditional update."""
    async with sessions() as session:
        with pytest.raises(IntegrityError):
            await session.execute(update(Host).where(Host.id == "h-b1").values(allocated_gpus=Host.gpus + 1))
            await session.commit()
    async with sessions() as session:
        with pytest.raises(IntegrityError):
            await session.execute(text("UPDATE hosts SET allocated_gpus = -1 WHERE id = 'h-b1'"))
            await session.commit()


async def test_concurrent_allocations_over_http(client: httpx.AsyncClient, acme: TenantHandle) -> None:
    await create_job(client, acme, "train", max_workers=64)
    for host_id, gpus, group in HOSTS:
        await create_host(client, host_id, gpus=gpus, group=group)

    async def one(index: int) -> httpx.Response:
        body: dict[str, object] = {"tenant_id": "acme", "job_id": "train", "gpus": 1}
        if index % 2:
            body["locality_group"] = "rack-b"
        return await client.post("/v1/allocations", json=body, headers=ADMIN)

    responses = await asyncio.gather(*(one(index) for index in range(REQUESTS)))
    statuses = [response.status_code for response in responses]
    assert statuses.count(201) == TOTAL_GPUS, statuses
    assert statuses.count(409) == REQUESTS - TOTAL_GPUS, statuses
    assert all("reason" in response.json() for response in responses if response.status_code == 409)

    listed = (await client.get("/v1/allocations", params={"tenant_id": "acme"}, headers=ADMIN)).json()
    assert sum(allocation["gpus"] for allocation in listed) == TOTAL_GPUS
    host_rows = (await client.get("/v1/hosts", headers=ADMIN)).json()
    assert sum(host["allocated_gpus"] for host in host_rows) == TOTAL_GPUS
    assert all(host["free_gpus"] == 0 for host in host_rows)


async def test_release_over_http(client: httpx.AsyncClient, acme: TenantHandle) -> None:
    await create_job(client, acme, "train")
    await create_host(client, "h-1", gpus=2, group="rack-a")
    granted = await client.post(
        "/v1/allocations", json={"tenant_id": "acme", "job_id": "train", "gpus": 2}, headers=ADMIN
    )
    assert granted.status_code == 201, granted.text
    allocation_id = granted.json()["id"]
    full = await client.post("/v1/allocations", json={"tenant_id": "acme", "job_id": "train", "gpus": 1}, headers=ADMIN)
    assert full.status_code == 409

    released = await client.delete(f"/v1/allocations/{allocation_id}", headers=ADMIN)
    assert released.status_code == 200, released.text
    assert released.json()["released_at"] is not None
    again = await client.delete(f"/v1/allocations/{allocation_id}", headers=ADMIN)
    assert again.status_code == 409 and "already released" in again.json()["reason"]
    unknown = await client.delete(f"/v1/allocations/{'0' * 32}", headers=ADMIN)
    assert unknown.status_code == 404 and unknown.json()["reason"]

    hosts_now = (await client.get("/v1/hosts", headers=ADMIN)).json()
    assert hosts_now[0]["allocated_gpus"] == 0


async def test_new_workers_join_the_jobs_hosts_then_its_group_and_shrinking_drops_the_newest(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """A job on h-b1 grows: h-b1 first (same host), then, rack-b being full, the roomiest other group's host."""
    async with sessions() as session:
        await allocations.allocate(session, tenant_id="acme", job_id="train", gpus=1, host_id="h-b1")
    start = datetime.now(UTC) + timedelta(hours=1)
    async with sessions() as session:
        job = await session.get(Job, ("acme", "train"))
        assert job is not None and job.desired_workers == 1
        await ledger.change_job_workers(session, job, 3, expected_workers=1)
        placed = []
        for step in range(3):
            placed += await ledger.place_workers(session, job, 1, now=start + timedelta(seconds=step))
        await session.commit()
    assert [p.allocation.host_id for p in placed] == ["h-b1", "h-a1", "h-a1"]

    async with sessions() as session:
        job = await session.get(Job, ("acme", "train"), populate_existing=True)
        assert job is not None and job.desired_workers == 4
        await ledger.change_job_workers(session, job, -2, expected_workers=4)
        touched = await ledger.release_workers(session, job, 2, now=start + timedelta(minutes=1))
        await session.commit()
    assert touched == {"h-a1"}, "the two newest workers"
    assert sorted((p.allocation.host_id, p.allocation.gpus) for p in await _placements(sessions)) == [
        ("h-b1", 1), ("h-b1", 1)
    ]
    assert await _ledger_totals(sessions) == (2, 2)
    async with sessions() as session:
        job = await session.get(Job, ("acme", "train"))
        with pytest.raises(ConflictError, match="changed meanwhile"):
            await ledger.change_job_workers(session, job, 1, expected_workers=3)  # type: ignore[arg-type]


async def test_workers_placed_at_one_time_are_released_newest_first_all_the_same(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """One transaction's placements share their time: a shrink still releases the ones placed last (by their
    time-ordered ids), not any of them at random. Repeated, since a random tie-break passes a third of the time."""
    async with sessions() as session:
        await allocations.allocate(session, tenant_id="acme", job_id="train", gpus=1, host_id="h-b1")
    for attempt in range(5):
        now = datetime.now(UTC) + timedelta(hours=1 + attempt)
        async with sessions() as session:
            job = await session.get(Job, ("acme", "train"), populate_existing=True)
            assert job is not None and job.desired_workers == 1
            await ledger.change_job_workers(session, job, 3, expected_workers=1)
            placed = await ledger.place_workers(session, job, 1, now=now)
            placed += await ledger.place_workers(session, job, 2, now=now)
            await session.commit()
        assert [p.allocation.host_id for p in placed] == ["h-b1", "h-a1", "h-a1"]
        async with sessions() as session:
            job = await session.get(Job, ("acme", "train"), populate_existing=True)
            assert job is not None
            await ledger.change_job_workers(session, job, -2, expected_workers=4)
            touched = await ledger.release_workers(session, job, 2, now=now)
            await session.commit()
        assert touched == {"h-a1"}, f"attempt {attempt}: the two placed last go, not the one placed with them"
        async with sessions() as session:  # back to the one first worker for the next attempt
            job = await session.get(Job, ("acme", "train"), populate_existing=True)
            assert job is not None
            await ledger.change_job_workers(session, job, -1, expected_workers=2)
            assert await ledger.release_workers(session, job, 1, now=now) == {"h-b1"}
            await session.commit()


async def _placements(maker: async_sessionmaker[AsyncSession]) -> list[ledger.Placement]:
    async with maker() as session:
        return await allocations.list_placements(session, tenant_id="acme", job_id="train")
