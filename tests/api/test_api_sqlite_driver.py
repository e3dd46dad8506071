"""The SQLite driver (`api.sqlite_driver`) and `api.db.execute_core`.

What SQLAlchemy reads from a cursor must be what aiosqlite's own cursor gives (rows, rowcount, lastrowid, errors); a
statement or a rollback must cost no hand-off to the connection's thread and a commit one; a lock held by another
connection must be waited for on that thread, never on the event loop; and a Core statement must see the session's
pending objects as an ORM one would (autoflush).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import Table, func, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from api import sqlite_driver
from api.db import execute_core, make_engine, make_sessionmaker, rows_matched
from api.models import Host, utcnow
from harmonaize.settings import Settings


@pytest.fixture
def backend() -> str:
    """SQLite only: the driver is SQLite's (`execute_core` runs on PostgreSQL in every negotiation test)."""
    return "sqlite"


@pytest.fixture
async def engine(migrated_settings: Settings) -> AsyncIterator[AsyncEngine]:
    engine = make_engine(migrated_settings.resolved_database_url)
    try:
        yield engine
    finally:
        await engine.dispose()


async def test_the_apps_sqlite_connections_use_the_buffered_cursor(engine: AsyncEngine) -> None:
    async with engine.connect() as connection:
        raw = await connection.get_raw_connection()
        assert isinstance(raw.driver_connection, sqlite_driver.OneHopConnection)


async def test_rows_rowcount_lastrowid_and_errors_are_the_drivers(engine: AsyncEngine) -> None:
    async with engine.begin() as connection:
        await connection.exec_driver_sql("CREATE TEMP TABLE t (id INTEGER PRIMARY KEY, name TEXT UNIQUE)")
        inserted = await connection.exec_driver_sql("INSERT INTO t (name) VALUES ('a')")
        assert inserted.lastrowid == 1
        await connection.exec_driver_sql("INSERT INTO t (name) VALUES (?)", [("b",), ("c",)])  # executemany
        rows = (await connection.exec_driver_sql("SELECT id, name FROM t ORDER BY id")).all()
        assert [tuple(row) for row in rows] == [(1, "a"), (2, "b"), (3, "c")]
        streamed = await connection.exec_driver_sql("SELECT name FROM t ORDER BY id")
        assert streamed.fetchone() == ("a",) and streamed.fetchmany(5) == [("b",), ("c",)]
        updated = await connection.exec_driver_sql("UPDATE t SET name = name || '!' WHERE id >= 2")
        assert rows_matched(updated) == 2
        with pytest.raises(IntegrityError):
            await connection.exec_driver_sql("INSERT INTO t (name) VALUES ('a')")
    async with engine.connect() as connection:
        with pytest.raises(OperationalError):
            await connection.execute(text("SELECT * FROM no_such_table"))


def _count_hand_offs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every function handed to a connection's thread from now on."""
    calls: list[Any] = []
    original: Any = sqlite_driver.OneHopConnection._execute  # untyped in aiosqlite

    async def counting(self: sqlite_driver.OneHopConnection, fn: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(fn)
        return await original(self, fn, *args, **kwargs)

    monkeypatch.setattr(sqlite_driver.OneHopConnection, "_execute", counting)
    return calls


async def test_statements_and_rollbacks_run_without_a_hand_off_and_a_commit_with_one(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with make_sessionmaker(engine)() as session:
        await session.execute(text("SELECT 1"))  # connected before counting
        await session.rollback()
        calls = _count_hand_offs(monkeypatch)
        assert (await session.execute(select(func.count()).select_from(Host))).scalar_one() == 0
        session.add(Host(id="h1", gpus=8, locality_group="rack-a", created_at=utcnow()))
        await session.flush()
        await session.rollback()
        assert calls == [], "BEGIN, a read, an insert and the rollback all ran on the event loop's thread"
        session.add(Host(id="h1", gpus=8, locality_group="rack-a", created_at=utcnow()))
        await session.commit()
        assert len(calls) == 1, "the commit (the WAL write) ran on the connection's thread"
    async with make_sessionmaker(engine)() as session:
        assert (await session.execute(select(func.count()).select_from(Host))).scalar_one() == 1


async def test_a_lock_held_by_another_connection_is_waited_for_on_the_thread_not_the_event_loop(
    engine: AsyncEngine, migrated_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    database = make_url(migrated_settings.resolved_database_url).database
    assert database
    other = sqlite3.connect(database, isolation_level=None, timeout=0)
    try:
        async with make_sessionmaker(engine)() as session:
            await session.execute(text("SELECT 1"))
            await session.rollback()
            other.execute("BEGIN IMMEDIATE")  # another process takes the write lock
            calls = _count_hand_offs(monkeypatch)
            session.add(Host(id="h1", gpus=8, locality_group="rack-a", created_at=utcnow()))
            writing = asyncio.create_task(session.flush())
            ticks = 0
            while sqlite_driver._run_waiting not in calls:  # the insert met the lock and went to the thread
                assert not writing.done(), "the insert finished although another connection holds the write lock"
                await asyncio.sleep(0.01)
                ticks += 1
                assert ticks < 500, "the insert never went to the connection's thread"
            for _ in range(5):  # the event loop runs on while the thread waits
                await asyncio.sleep(0.01)
            assert not writing.done()
            other.execute("COMMIT")
            await asyncio.wait_for(writing, timeout=10)
            await session.commit()
        async with make_sessionmaker(engine)() as session:
            assert list(await session.scalars(select(Host.id))) == ["h1"]
    finally:
        other.close()


async def test_a_core_statement_sees_pending_objects_as_an_orm_one_would(engine: AsyncEngine) -> None:
    hosts = Host.__table__
    assert isinstance(hosts, Table)
    async with make_sessionmaker(engine)() as session:
        session.add(Host(id="h1", gpus=8, locality_group="rack-a", created_at=utcnow()))
        counted = await execute_core(session, select(func.count()).select_from(hosts))
        assert counted.scalar_one() == 1  # flushed first
        changed = await execute_core(session, update(hosts).where(hosts.c.id == "h1").values(allocated_gpus=2))
        assert rows_matched(changed) == 1
        await session.rollback()
