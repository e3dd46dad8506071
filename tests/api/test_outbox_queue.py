"""The outbox's queue: rows a transaction announces are written together at its commit, in order, or not at all.

On SQLite and PostgreSQL, through the app's own engine and sessions: what a use case queues (`enqueue_tenant_event`,
`enqueue_desired_state`) is one INSERT at commit, with ids in the order queued (the order the relay publishes);
a transaction rolled back, or whose commit fails, leaves no row, and the session's next transaction does not
inherit the queue.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import event, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from api.db import make_sessionmaker
from api.models import OutboxMessage, OutboxTopic
from api.services.outbox import enqueue_desired_state, enqueue_tenant_event
from harmonaize.desired_state import HostAssignment
from harmonaize.events.carbon import CarbonIntensity

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


@pytest.fixture
def sessions(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return make_sessionmaker(engine)


def _event(job: str) -> dict[str, Any]:
    data = CarbonIntensity(region="US-CAL", g_per_kwh=100.0, observed_at=NOW)
    return {"tenant_id": "acme", "job_id": job, "data": data, "now": NOW}


def _assignment(host: str) -> HostAssignment:
    return HostAssignment(host=host, locality_group="rack-a", generation=1, jobs=(), updated_at=NOW)


async def _subjects(sessions: async_sessionmaker[AsyncSession]) -> list[str]:
    async with sessions() as session:
        return list(await session.scalars(select(OutboxMessage.subject).order_by(OutboxMessage.id)))


async def test_queued_rows_are_one_insert_at_commit_in_queued_order(
    engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession]
) -> None:
    inserts: list[str] = []

    def on_execute(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO OUTBOX"):
            inserts.append(statement)

    event.listen(engine.sync_engine, "before_cursor_execute", on_execute)
    async with sessions() as session:
        try:
            enqueue_tenant_event(session, **_event("j1"))
            enqueue_desired_state(session, _assignment("h2"), now=NOW)
            enqueue_tenant_event(session, **_event("j3"))
            await session.flush()
            assert inserts == [], "nothing is written before the commit"
            assert await _subjects(sessions) == []
            await session.commit()
        finally:
            event.remove(engine.sync_engine, "before_cursor_execute", on_execute)
    assert len(inserts) == 1, inserts
    subjects = await _subjects(sessions)
    assert [subject.rsplit(".", 1)[-1] for subject in subjects] == ["j1", "h2", "j3"], subjects
    async with sessions() as session:
        topics = list(await session.scalars(select(OutboxMessage.topic).order_by(OutboxMessage.id)))
    assert topics == [OutboxTopic.TENANT_EVENT, OutboxTopic.DESIRED_STATE, OutboxTopic.TENANT_EVENT]


async def test_a_rolled_back_transaction_writes_nothing_and_leaves_nothing_queued(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions() as session:
        enqueue_tenant_event(session, **_event("gone"))
        await session.rollback()
        enqueue_tenant_event(session, **_event("kept"))
        await session.commit()
    assert [subject.rsplit(".", 1)[-1] for subject in await _subjects(sessions)] == ["kept"]


async def test_a_failed_commit_writes_nothing_and_the_next_transaction_starts_clean(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions() as session:
        enqueue_tenant_event(session, **_event("doomed"))
        # a statement of the same transaction breaks a constraint at the commit's flush
        session.add(OutboxMessage(topic=OutboxTopic.TENANT_EVENT, subject=None, payload=b"", msg_id="x",
                                  created_at=NOW, attempts=0))
        with pytest.raises(Exception, match="(?i)null|not-null|not null"):
            await session.commit()
        await session.rollback()
        await session.execute(text("SELECT 1"))
        await session.commit()
    assert await _subjects(sessions) == []
