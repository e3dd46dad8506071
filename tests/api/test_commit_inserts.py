"""Rows queued for the commit (`api.commit_inserts`): written together as it begins, in order, or not at all.

On SQLite and PostgreSQL, through the app's own engine and sessions: what a use case queues (`enqueue_tenant_event`,
`enqueue_desired_state`, any `queue_insert`) is written at commit, the outbox's ids in the order queued (the order
the relay publishes); rows of several tables are one statement on PostgreSQL (a row may refer to one queued before
it), one per run of a table on SQLite; a queued row that breaks a constraint fails the commit and takes the whole
transaction along; `write_queued` writes them early, readable inside the transaction; a transaction rolled back, or
whose commit fails, leaves no row, and the session's next transaction does not inherit the queue.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

import pytest
from sqlalchemy import Table, event, select, text
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from api import commit_inserts
from api.commit_inserts import queue_insert, queued_rows, write_queued
from api.db import make_sessionmaker
from api.models import IdempotencyKey, OutboxMessage, OutboxTopic, Tenant
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
        if "INSERT INTO OUTBOX" in statement.upper():
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


_TENANTS, _KEYS = cast("Table", Tenant.__table__), cast("Table", IdempotencyKey.__table__)


def _tenant(tenant: str) -> dict[str, Any]:
    return {"id": tenant, "display_name": tenant, "token_id": f"tok-{tenant}", "token_hash": "0" * 64,
            "nats_user_public_key": f"U{tenant}", "created_at": NOW, "revoked_at": None}


def _key(tenant: str, key: str) -> dict[str, Any]:
    return {"tenant_id": tenant, "key": key, "fingerprint": "f" * 64, "response_status": 201,
            "response_body": {"key": key}, "created_at": NOW}


def _inserts(engine: AsyncEngine) -> tuple[list[str], Any]:
    seen: list[str] = []

    def on_execute(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if " ".join(statement.split()).upper().startswith(("INSERT", "WITH")):
            seen.append(" ".join(statement.split()))

    event.listen(engine.sync_engine, "before_cursor_execute", on_execute)
    return seen, on_execute


async def test_rows_of_several_tables_are_one_statement_on_postgresql_and_a_row_may_refer_to_an_earlier_one(
    engine: AsyncEngine, sessions: async_sessionmaker[AsyncSession]
) -> None:
    seen, listener = _inserts(engine)
    try:
        async with sessions() as session:
            queue_insert(session, _TENANTS, _tenant("t1"))
            queue_insert(session, _KEYS, _key("t1", "k1"))  # refers to the tenant queued just before
            enqueue_tenant_event(session, **_event("j1"))
            queue_insert(session, _KEYS, _key("t1", "k2"))
            enqueue_tenant_event(session, **_event("j2"))
            assert len(queued_rows(session, _KEYS)) == 2
            await session.commit()
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", listener)
    if engine.dialect.name == "postgresql":  # one statement, the outbox's second row inserted from the first's CTE
        assert len(seen) == 1 and seen[0].startswith("WITH"), seen
        assert seen[0].count("INSERT INTO outbox") == 2 and "INSERT INTO outbox" in seen[0].split(" FROM w")[0], seen
    else:  # a statement per table, each after the tables it refers to
        tables = [statement.split()[2].strip('"') for statement in seen]
        assert tables.index("tenants") < tables.index("idempotency_keys") and len(tables) == 3, seen
    async with sessions() as session:
        keys = list(await session.scalars(select(IdempotencyKey.key).order_by(IdempotencyKey.key)))
        assert keys == ["k1", "k2"]
    assert [subject.rsplit(".", 1)[-1] for subject in await _subjects(sessions)] == ["j1", "j2"]


async def test_a_queued_row_that_breaks_a_constraint_fails_the_commit_and_nothing_of_it_stays(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions() as session:
        queue_insert(session, _TENANTS, _tenant("t1"))
        queue_insert(session, _KEYS, _key("t1", "k1"))
        await session.commit()
    async with sessions() as session:
        enqueue_tenant_event(session, **_event("lost"))
        queue_insert(session, _KEYS, _key("t1", "k1"))  # the same key again: the primary key refuses it
        with pytest.raises(IntegrityError):
            await session.commit()
        await session.rollback()
        assert queued_rows(session, _KEYS) == []
    assert await _subjects(sessions) == []


async def test_write_queued_writes_now_inside_the_transaction(sessions: async_sessionmaker[AsyncSession]) -> None:
    async with sessions() as session:
        queue_insert(session, _TENANTS, _tenant("t1"))
        enqueue_tenant_event(session, **_event("early"))
        await write_queued(session)
        assert queued_rows(session, _TENANTS) == []
        assert await session.scalar(select(Tenant.id)) == "t1"  # read back before the commit
        await session.rollback()
    assert await _subjects(sessions) == []
    async with sessions() as session:
        assert await session.scalar(select(Tenant.id)) is None, "written early, still only if it commits"


def test_postgresql_writes_one_cached_statement_and_generated_keys_in_queued_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    outbox = cast("Table", OutboxMessage.__table__)
    queued = [(_KEYS, _key("t", "a")), (_TENANTS, _tenant("t")), (_KEYS, _key("t", "b"))]
    [(combined, params)] = commit_inserts.statements([*queued, (outbox, {"subject": "one"})], "postgresql")
    assert params == {"p0_id": "t", **{f"p0_{name}": value for name, value in _tenant("t").items()},
                      **{f"p1_{name}": value for name, value in _key("t", "a").items()},
                      **{f"p2_{name}": value for name, value in _key("t", "b").items()}, "p3_subject": "one",
                      "p3_attempts": 0}
    assert combined._generate_cache_key() is not None, "SQLAlchemy caches its compiled form"
    again, _ = commit_inserts.statements([*queued, (outbox, {"subject": "two"})], "postgresql")[0]
    assert again is combined, "built once per shape"
    sql = " ".join(str(combined.compile(dialect=PGDialect_asyncpg())).split())  # type: ignore[no-untyped-call]
    assert sql.startswith("WITH w0 AS (INSERT INTO tenants") and sql.count("INSERT INTO") == 4, sql
    assert sql.index("INSERT INTO idempotency_keys") > sql.index("INSERT INTO tenants")
    assert sql.index("INSERT INTO outbox") > sql.index("INSERT INTO idempotency_keys")
    events = [(outbox, {"subject": f"e{index}"}) for index in range(3)]
    [(chained, chained_params)] = commit_inserts.statements([*queued, *events], "postgresql")
    sql = " ".join(str(chained.compile(dialect=PGDialect_asyncpg())).split())  # type: ignore[no-untyped-call]
    assert sql.count("INSERT INTO outbox") == 3, sql
    first, second, third = sql.split("INSERT INTO outbox (subject, attempts) ")[1:]  # attempts: its default, in each
    assert first.startswith("VALUES (") and first.endswith("RETURNING outbox.id), w4 AS ("), sql
    assert second.startswith("SELECT ") and second.endswith(" FROM w3 RETURNING outbox.id) "), sql
    assert third.startswith("SELECT ") and third.endswith(" FROM w4"), "each inserted after the one before"
    assert isinstance(chained_params, dict)
    assert [chained_params[f"p{index}_subject"] for index in (3, 4, 5)] == ["e0", "e1", "e2"]
    many = [(outbox, {"subject": f"m{index}"}) for index in range(commit_inserts.MAX_CHAIN + 1)]
    [_, (separate, event_rows)] = commit_inserts.statements([*queued, *many], "postgresql")
    assert separate.table is outbox and event_rows == [row for _, row in many], "past the chain: one executemany"
    per_table = [(statement.table.name, [row.get("key") for row in rows])
                 for statement, rows in commit_inserts.statements(queued, "sqlite") if isinstance(rows, list)]
    assert per_table == [("tenants", [None]), ("idempotency_keys", ["a", "b"])]  # the referred-to table first
    monkeypatch.setattr(commit_inserts, "MAX_PARAMETERS", 10)
    split = commit_inserts.statements(queued, "postgresql")
    assert [(statement.table.name, [row.get("key") for row in rows]) for statement, rows in split
            if isinstance(rows, list)] == per_table
