"""The SQLite driver's one-hand-off cursor (`api.sqlite_driver`) and `api.db.execute_core`.

What SQLAlchemy reads from a cursor must be what aiosqlite's own cursor gives (rows, rowcount, lastrowid, errors), a
statement must cost one call on the connection's thread, and a Core statement must see the session's pending objects
as an ORM one would (autoflush).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import Table, func, select, text, update
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


async def test_a_statement_is_one_call_on_the_connections_thread(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Any] = []
    original: Any = sqlite_driver.OneHopConnection._execute  # untyped in aiosqlite

    async def counting(self: sqlite_driver.OneHopConnection, fn: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(fn)
        return await original(self, fn, *args, **kwargs)

    async with engine.connect() as connection:
        await connection.execute(text("SELECT 1"))  # connected and begun before counting
        monkeypatch.setattr(sqlite_driver.OneHopConnection, "_execute", counting)
        assert (await connection.execute(select(func.count()).select_from(Host))).scalar_one() == 0
    assert calls[0] is sqlite_driver._run and len([fn for fn in calls if fn is sqlite_driver._run]) == 1


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
