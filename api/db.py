"""Engine and session factories for SQLite (the local default) and PostgreSQL.

SQLite is configured for one process serving concurrent requests:
- WAL, so readers (other processes, a backup, `sqlite3` on the command line) do not block the writer;
- `busy_timeout` on *every* connection (a connect event), so a lock held by another process is waited for instead of
  failing at once with "database is locked";
- foreign keys on (SQLite leaves them off by default, per connection);
- a single pooled connection: as much throughput as a wider pool and a far lower p99, because requests queue for
  the one writer in the pool instead of fighting over SQLite's file lock;
- real transactions: Python's sqlite3 driver opens a transaction only before INSERT/UPDATE/DELETE, which would leave
  DDL (every migration step) and the reads before a conditional write outside any transaction (a failed
  multi-revision downgrade would leave tables dropped). The driver's own handling is switched off and SQLAlchemy
  emits `BEGIN` itself (the documented recipe), so a migration or a use case is all or nothing on SQLite too;
- statements on the event loop's thread, only commits and waits for another process's lock on the driver's
  thread (`api.sqlite_driver`): a hand-off there costs more CPU than the statements themselves.

PostgreSQL (`postgresql+asyncpg://...` in HZ_DATABASE_URL) gets an ordinary connection pool, whose connections are
pinged before use when they sat idle, so one that died with a database restart is replaced instead of failing a
request. The ping is one `SELECT 1` (`ping_postgresql`): SQLAlchemy's own for asyncpg wraps its query in BEGIN and
ROLLBACK, three round trips. A connection back in the pool for less than `ping_after_idle_s` is handed out unpinged
(`_ping_when_idle`): under load every connection is reused within milliseconds and a ping per request was a tenth of
a negotiation's round trips; a server that died in that window fails the requests then in flight, which a ping
could not have saved either, and the pool replaces the connection on that failure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from sqlalchemy import Executable, event
from sqlalchemy.engine import URL, CursorResult, Result, make_url
from sqlalchemy.exc import DBAPIError, InvalidatePoolError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.pool import NullPool
from sqlalchemy.util import await_

from api import sqlite_driver

_log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 5_000
POSTGRES_POOL_SIZE = 16
PING_AFTER_IDLE_S = 0.5
"""A pooled PostgreSQL connection idle for at least this long is pinged before it is handed out."""


def is_sqlite(url: str | URL) -> bool:
    """True for any SQLite URL (the capacity ledger and migrations adapt a few details to it)."""
    return make_url(url).get_backend_name() == "sqlite"


def _ensure_sqlite_directory(url: URL) -> None:
    database = url.database
    if database and database != ":memory:" and not database.startswith("file:"):
        Path(database).parent.mkdir(parents=True, exist_ok=True)


def _install_sqlite_pragmas(engine: AsyncEngine, *, foreign_keys: bool) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.execute(f"PRAGMA foreign_keys = {'ON' if foreign_keys else 'OFF'}")
        finally:
            cursor.close()
        dbapi_connection.isolation_level = None

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN")


def make_engine(
    url: str | URL, *, single_use: bool = False, foreign_keys: bool = True,
    ping_after_idle_s: float = PING_AFTER_IDLE_S,
) -> AsyncEngine:
    """An async engine for `url`, tuned for its backend.

    `single_use` (migrations, one-shot CLI commands) skips pooling so nothing stays connected afterwards: PostgreSQL
    refuses to drop or copy a database that still has connections. `foreign_keys=False` is for SQLite batch
    migrations, which recreate tables and would otherwise trip (or cascade through) foreign keys mid-migration.
    `ping_after_idle_s` (PostgreSQL's pool): how long a connection may sit idle and still be handed out unpinged;
    0 pings at every checkout.
    """
    parsed = make_url(url)
    options: dict[str, Any] = {}
    if single_use:
        options["poolclass"] = NullPool
    if is_sqlite(parsed):
        _ensure_sqlite_directory(parsed)
        if not single_use:
            options.update(pool_size=1, max_overflow=0, pool_timeout=60)
        if parsed.get_driver_name() == "aiosqlite" and sqlite_driver.SUPPORTED:
            options["connect_args"] = {"async_creator_fn": sqlite_driver.connect}
        engine = create_async_engine(parsed, **options)
        _install_sqlite_pragmas(engine, foreign_keys=foreign_keys)
        return engine
    if not single_use:
        options.update(pool_size=POSTGRES_POOL_SIZE, max_overflow=0)
    engine = create_async_engine(parsed, **options)
    if parsed.get_driver_name() == "asyncpg":
        engine.sync_engine.dialect.do_ping = ping_postgresql  # type: ignore[method-assign]
    if not single_use:
        _ping_when_idle(engine, after_s=ping_after_idle_s)
    return engine


_LAST_USED = "hz_last_used"


def _ping_when_idle(engine: AsyncEngine, *, after_s: float) -> None:
    """The pool's pre-ping, skipped for a connection used less than `after_s` seconds ago.

    What SQLAlchemy's `pool_pre_ping` does, but only where a dead connection is plausible: a failed ping raises
    `InvalidatePoolError`, upon which the pool discards this connection and every one older than it, and checks out
    again (a freshly made connection is not pinged).
    """
    dialect = engine.sync_engine.dialect

    @event.listens_for(engine.sync_engine, "connect")
    def _made(_dbapi_connection: Any, record: Any) -> None:
        record.info[_LAST_USED] = time.monotonic()

    @event.listens_for(engine.sync_engine, "checkin")
    def _returned(_dbapi_connection: Any, record: Any) -> None:
        record.info[_LAST_USED] = time.monotonic()

    @event.listens_for(engine.sync_engine, "checkout")
    def _handed_out(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        if time.monotonic() - record.info.get(_LAST_USED, 0.0) < after_s:
            return
        if not dialect.do_ping(dbapi_connection):
            raise InvalidatePoolError("a pooled connection failed its ping")


def ping_postgresql(dbapi_connection: Any) -> bool:
    """The pool's pre-ping for asyncpg: `SELECT 1` over the simple protocol, one round trip.

    False (the connection is unusable) on any error: the pool then discards it and the connections older than it,
    and connects afresh, which is what a database restart calls for. SQLAlchemy's ping wraps the query in a
    transaction for PgBouncer's transaction pooling, where a statement prepared outside one may reach another
    server connection; a query over the simple protocol prepares nothing. (Not the empty query, as SQLAlchemy's:
    asyncpg 0.32 fails to read the server's answer to it over the simple protocol.)
    """
    try:
        await_(dbapi_connection.driver_connection.execute("SELECT 1"))
    except Exception:  # noqa: BLE001 -- any failure means: do not hand this connection out
        _log.info("a pooled PostgreSQL connection failed its ping; reconnecting", exc_info=True)
        return False
    return True


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """Sessions whose objects stay readable after commit (responses are built after the service commits)."""
    return async_sessionmaker(engine, expire_on_commit=False)


async def close_session(session: AsyncSession) -> None:
    """Close a request's session, returning its connection to the pool.

    A request's session closes after its response has gone out. If the database went away meanwhile, the rollback
    that closing does fails on a dead connection, which the pool has then already discarded: nothing is left to undo,
    so that failure is logged here rather than raised into the server, which would drop the client's connection.
    """
    try:
        async with session:  # closing on exit runs to completion even if the request is cancelled meanwhile
            pass
    except (DBAPIError, OSError) as exc:
        if isinstance(exc, DBAPIError) and not exc.connection_invalidated:
            raise
        _log.warning("closing a session on a lost database connection: %r", exc)


def rows_matched(result: Result[*tuple[Any, ...]]) -> int:
    """How many rows an UPDATE or DELETE run through `session.execute` matched.

    The session types its result as a plain `Result`; for DML it is a `CursorResult`, the only kind with `rowcount`,
    which the conditional updates (reserve capacity only if it is still free) depend on.
    """
    return cast("CursorResult[*tuple[Any, ...]]", result).rowcount


async def execute_core(
    session: AsyncSession, statement: Executable, params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None
) -> Result[*tuple[Any, ...]]:
    """Run a Core statement (built on tables, not mapped classes) in the session's transaction.

    Such a statement skips the ORM's per-statement work (compile state, entity loading setup), about half of what
    SQLAlchemy spends on a statement that SQLite then runs in microseconds; the hot paths of a negotiation use them
    for their column reads and guarded updates. The ORM would flush pending objects before an ORM statement
    (autoflush); so does this, so a statement's result never depends on which kind it is.
    """
    if session.new or session.dirty or session.deleted:
        await session.flush()
    return await session.execute(statement, params)
