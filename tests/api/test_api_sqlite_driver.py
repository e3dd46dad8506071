"""The SQLite driver (`api.sqlite_driver`) and `api.db.execute_core`.

What SQLAlchemy reads from a cursor must be what aiosqlite's own cursor gives (rows, rowcount, lastrowid, errors); a
statement, a rollback or a commit (WAL, no fsync at commit) must cost no hand-off to the connection's thread, a
checkpoint must run there every `CHECKPOINT_EVERY_COMMITS` commits while the next call waits for it, and a commit
that syncs the file (another journal mode) must run there too; a lock held by another connection must be waited for
on that thread, never on the event loop; and a Core statement must see the session's pending objects as an ORM one
would (autoflush).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from typing import Any

import pytest
from sqlalchemy import Table, func, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from api import sqlite_driver
from api.db import execute_core, make_sessionmaker, rows_matched
from api.models import Host, utcnow
from harmonaize.settings import Settings


@pytest.fixture
def backend() -> str:
    """SQLite only: the driver is SQLite's (`execute_core` runs on PostgreSQL in every negotiation test)."""
    return "sqlite"


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


async def test_statements_rollbacks_and_commits_run_without_a_hand_off(
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
        assert calls == [], "the commit (a WAL append, no fsync) ran on the event loop's thread"
    async with make_sessionmaker(engine)() as session:
        assert (await session.execute(select(func.count()).select_from(Host))).scalar_one() == 1


def _frames_in_the_wal(database: str) -> int:
    """Frames the database's WAL holds that are not yet in the database file (another connection asks SQLite)."""
    other = sqlite3.connect(database, isolation_level=None)
    try:
        other.execute("PRAGMA wal_autocheckpoint = 0")
        _busy, frames, copied = other.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        return int(frames) - int(copied)  # after this PASSIVE checkpoint: what it could not copy
    finally:
        other.close()


async def test_a_checkpoint_goes_to_the_thread_every_so_many_commits_and_the_next_call_waits_for_it(
    engine: AsyncEngine, migrated_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_driver, "CHECKPOINT_EVERY_COMMITS", 5)
    calls = _count_hand_offs(monkeypatch)
    entered, release = threading.Event(), threading.Event()
    original = sqlite_driver._checkpoint

    def held_checkpoint(connection: sqlite3.Connection) -> tuple[int, int, int]:
        entered.set()
        assert release.wait(10), "the test never released the checkpoint"
        return original(connection)

    monkeypatch.setattr(sqlite_driver, "_checkpoint", held_checkpoint)
    async with engine.connect() as connection:
        raw = (await connection.get_raw_connection()).driver_connection
        assert isinstance(raw, sqlite_driver.OneHopConnection)
        calls.clear()  # connecting hands work to the thread; counted from here
        for i in range(4):
            await connection.execute(update(Host).where(Host.id == f"none-{i}").values(gpus=1))
            await connection.commit()
        assert calls == [] and raw.checkpoints == 0
        autocheckpoint = await connection.exec_driver_sql("PRAGMA wal_autocheckpoint")
        assert autocheckpoint.scalar_one() == 0, "SQLite itself would checkpoint inside a commit on the event loop"
        await connection.execute(update(Host).where(Host.id == "none-4").values(gpus=1))
        await connection.commit()  # the fifth: hands a checkpoint to the thread and returns at once
        assert raw.checkpoints == 0
        ticks = 0
        while not entered.is_set():
            await asyncio.sleep(0.01)
            ticks += 1
            assert ticks < 500, "no checkpoint reached the connection's thread"
        assert calls == [sqlite_driver._checkpoint]
        reading = asyncio.create_task(connection.execute(select(func.count()).select_from(Host)))
        for _ in range(5):  # the event loop runs on; the read waits for the checkpoint, not beside it
            await asyncio.sleep(0.01)
        assert not reading.done()
        release.set()
        assert (await asyncio.wait_for(reading, timeout=10)).scalar_one() == 0
        assert raw.checkpoints == 1
        await connection.rollback()
    database = make_url(migrated_settings.resolved_database_url).database
    assert database
    assert _frames_in_the_wal(database) == 0


async def test_without_the_wal_a_commit_syncs_the_file_on_the_thread(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    connection = sqlite_driver.connect(str(tmp_path / "rollback-journal.db"), isolation_level=None)
    await connection  # opens it on its thread (and returns the same object, typed as aiosqlite's)
    try:
        await (await connection.cursor().execute("PRAGMA journal_mode = DELETE")).close()
        calls = _count_hand_offs(monkeypatch)
        cursor = connection.cursor()
        await cursor.execute("BEGIN")
        await cursor.execute("CREATE TABLE t (id INTEGER PRIMARY KEY)")
        await cursor.execute("INSERT INTO t DEFAULT VALUES")
        await connection.commit()
        assert len(calls) == 1, "the commit (with its fsync) ran on the connection's thread"
        await cursor.execute("SELECT count(*) FROM t")
        assert await cursor.fetchall() == [(1,)]
    finally:
        await connection.close()


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
