"""`ledger_rows`: a host's counter and an allocation's row move together or not at all, on SQLite and PostgreSQL
(where each pair is one statement)."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from api.models import Allocation, Host
from api.services import ledger_rows
from api.services.errors import ConflictError
from api.services.ledger import new_allocation_id
from tests.api.api_testkit import TenantHandle, create_host, create_job

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


def _allocation(host: str, gpus: int) -> Allocation:
    return Allocation(
        id=new_allocation_id(), tenant_id="acme", job_id="train", host_id=host, gpus=gpus, created_at=NOW,
        starts_at=None,
    )


async def _state(session: AsyncSession, host: str) -> tuple[int, int]:
    """The host's allocated GPUs and its live allocation rows."""
    allocated = await session.scalar(select(Host.allocated_gpus).where(Host.id == host))
    live = await session.scalar(
        select(func.count()).select_from(Allocation).where(Allocation.host_id == host, Allocation.released_at.is_(None))
    )
    return int(allocated or 0), int(live or 0)


@pytest.fixture
async def ready(app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle) -> FastAPI:
    await create_host(client, "h0", gpus=1, group="rack-a")
    await create_job(client, acme, "train", max_workers=4, initial_workers=1)  # its worker takes h0
    await create_host(client, "h1", gpus=4, group="rack-a")
    return app


async def test_a_grant_takes_the_gpus_and_writes_the_row_or_does_neither(ready: FastAPI) -> None:
    async with ready.state.sessionmaker() as session:
        first, second = _allocation("h1", 3), _allocation("h1", 2)
        assert await ledger_rows.grant(session, first)
        assert await _state(session, "h1") == (3, 1)
        assert not await ledger_rows.grant(session, second), "only 1 GPU is left"
        assert await _state(session, "h1") == (3, 1), "no row without the GPUs"
        assert await session.get(Allocation, second.id) is None
        await session.commit()
    async with ready.state.sessionmaker() as session:
        stored = await session.get(Allocation, first.id)
        assert stored is not None and (stored.gpus, stored.host_id, stored.released_at) == (3, "h1", None)
        assert stored.created_at == NOW


async def test_a_grant_on_a_host_that_is_down_takes_nothing(ready: FastAPI) -> None:
    async with ready.state.sessionmaker() as session:
        await session.execute(update(Host).where(Host.id == "h1").values(down_at=NOW))
        assert not await ledger_rows.grant(session, _allocation("h1", 1))
        assert await _state(session, "h1") == (0, 0)


async def test_a_release_gives_back_once_and_refuses_the_second(ready: FastAPI) -> None:
    async with ready.state.sessionmaker() as session:
        allocation = _allocation("h1", 2)
        assert await ledger_rows.grant(session, allocation)
        await ledger_rows.release(session, allocation, give=2, now=NOW)
        assert allocation.released_at == NOW
        assert await _state(session, "h1") == (0, 0)
        with pytest.raises(ConflictError, match="already released"):
            await ledger_rows.release(session, allocation, give=2, now=NOW)
        assert await _state(session, "h1") == (0, 0), "the second release gave nothing back"


async def test_a_release_the_host_cannot_cover_is_an_inconsistency(ready: FastAPI) -> None:
    async with ready.state.sessionmaker() as session:
        allocation = _allocation("h1", 2)
        assert await ledger_rows.grant(session, allocation)
        await session.execute(update(Host).where(Host.id == "h1").values(allocated_gpus=1))
        with pytest.raises(RuntimeError, match="ledger inconsistent"):
            await ledger_rows.release(session, allocation, give=2, now=NOW)
        await session.rollback()
        assert await _state(session, "h1") == (0, 0), "the rollback undid the grant and the half-done release"
