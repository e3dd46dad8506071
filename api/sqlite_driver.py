"""SQLite statements on the event loop's thread, with aiosqlite's thread only for what may wait or write the log.

aiosqlite runs every call on its connection's own thread, and SQLAlchemy's adapter makes four calls per statement:
open a cursor, execute, fetch all rows, close. Each is a hand-off from the event loop to that thread and back
(a queue put, a thread wake-up, a `call_soon_threadsafe`), and on these machines one hand-off costs ~0.2 ms of CPU
(bench/HISTORY.md), far more than SQLite's own work for the API's statements (a primary-key read or a one-row
write: microseconds). So `BufferedCursor.execute` runs the statement right here, reads every row, and keeps the rows,
`description`, `rowcount` and `lastrowid` for SQLAlchemy, which reads every row of a (non-streaming) result anyway.

COMMIT and ROLLBACK run here too. In WAL mode with `synchronous = NORMAL` (how `api.db` opens the database) a
commit appends the transaction's pages to the WAL without an fsync, and a rollback only drops what the transaction
wrote to memory. What can take milliseconds is the checkpoint, which copies the WAL into the database file and
fsyncs both; SQLite would run one inside the commit that fills the WAL to 1,000 pages, so this connection turns
that off (`wal_autocheckpoint = 0`) and hands a PASSIVE checkpoint to its thread after every
`CHECKPOINT_EVERY_COMMITS` commits, without waiting for it: the next call on the connection waits for it instead
(`settle`), so the two threads never use the connection at once. In another journal mode, or with
`synchronous = FULL`, a commit syncs the file itself and runs on the thread, as in aiosqlite.

What must not run on the event loop goes to the connection's thread:
* waiting for another process's lock. Statements and commits here run with SQLite's busy timeout at 0, so a lock
  held elsewhere (a CLI command, a backup) fails at once with SQLITE_BUSY, before anything changed; the call is then
  made again on the thread with the connection's configured timeout (`PRAGMA busy_timeout`, 5 s in `api.db`),
  where waiting blocks only that thread;
* the checkpoints above, and commits that sync the file.

Plugged in through the aiosqlite dialect's `async_creator_fn` connect argument (`api.db.make_engine`), so the
dialect, pool and events are SQLAlchemy's own. It reaches into three internals of aiosqlite (`_execute`, `_conn`,
`_thread`); `SUPPORTED` says whether the installed aiosqlite still has them, and where it does not the engine uses
aiosqlite's own cursor (slower, never wrong). The connection is opened with `check_same_thread=False`: calls from
the two threads never overlap, since a pooled connection serves one session at a time and this module awaits each
call on the thread before the next statement. The cursor buffers results, so it serves no streaming (server-side)
reads, which the API does not make.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sqlite3
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Iterable, Sequence
from typing import Any, cast

import aiosqlite

SUPPORTED: bool = (
    callable(getattr(aiosqlite.Connection, "_execute", None))
    and isinstance(getattr(aiosqlite.Connection, "_conn", None), property)
    and "_thread" in aiosqlite.Connection.__init__.__code__.co_names
)
"""The installed aiosqlite has the internals this module uses (checked on import, not at the first statement)."""

_Description = tuple[tuple[Any, ...], ...] | None
_Outcome = tuple[list[Any], _Description, int, int | None]


_LOG = logging.getLogger(__name__)

CHECKPOINT_EVERY_COMMITS = 100
"""Commits on the event loop between two checkpoints on the thread. A negotiation's commit writes a few pages, so
the WAL stays near the 1,000 pages at which SQLite itself would checkpoint."""

SQLITE_BUSY = 5
_BUSY_TIMEOUT = re.compile(r"\s*PRAGMA\s+busy_timeout\s*(?:=\s*(\d+)\s*)?;?\s*", re.IGNORECASE)
_BUSY_TIMEOUT_DESCRIPTION = (("busy_timeout", None, None, None, None, None, None),)


def _run(connection: sqlite3.Connection, sql: str, parameters: Any, many: bool) -> _Outcome:
    """Execute, read every row, close; what the cursor needs afterwards."""
    cursor = connection.cursor()
    try:
        if many:
            cursor.executemany(sql, parameters)
        else:
            cursor.execute(sql, parameters)
        rows = cursor.fetchall() if cursor.description else []
        return rows, cursor.description, cursor.rowcount, cursor.lastrowid
    finally:
        cursor.close()


def _run_waiting(connection: sqlite3.Connection, wait_ms: int, sql: str, parameters: Any, many: bool) -> _Outcome:
    """On the connection's thread: `_run` with the busy timeout at `wait_ms` (back to 0 afterwards)."""
    connection.execute(f"PRAGMA busy_timeout = {int(wait_ms)}")
    try:
        return _run(connection, sql, parameters, many)
    finally:
        connection.execute("PRAGMA busy_timeout = 0")


def _commit_waiting(connection: sqlite3.Connection, wait_ms: int) -> None:
    """On the connection's thread: COMMIT with the busy timeout at `wait_ms` (back to 0 afterwards)."""
    connection.execute(f"PRAGMA busy_timeout = {int(wait_ms)}")
    try:
        connection.commit()
    finally:
        connection.execute("PRAGMA busy_timeout = 0")


def _checkpoint(connection: sqlite3.Connection) -> tuple[int, int, int]:
    """On the connection's thread: copy what the WAL holds into the database file, waiting for nobody (PASSIVE);
    (busy, frames in the WAL, frames copied), as SQLite reports them."""
    busy, frames, copied = connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    return int(busy), int(frames), int(copied)


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) == SQLITE_BUSY


class BufferedCursor:
    """The part of `aiosqlite.Cursor` SQLAlchemy uses, with each statement's results fetched with it."""

    arraysize = 1

    def __init__(self, connection: OneHopConnection) -> None:
        self._connection = connection
        self._rows: deque[Any] = deque()
        self.description: _Description = None
        self.rowcount = -1
        self.lastrowid: int | None = None

    def __await__(self) -> Generator[Any, None, BufferedCursor]:
        return self.__aenter__().__await__()

    async def __aenter__(self) -> BufferedCursor:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def _call(self, sql: str, parameters: Any, *, many: bool) -> BufferedCursor:
        connection = self._connection
        await connection.settle()
        db = connection._conn
        connection.take_busy_timeout(db)
        busy_timeout = _BUSY_TIMEOUT.fullmatch(sql)
        if busy_timeout is not None:  # the thread's wait, set or read here; SQLite's own timeout stays 0
            if busy_timeout.group(1) is None:
                self._rows, self.description = deque([(connection.wait_ms,)]), _BUSY_TIMEOUT_DESCRIPTION
            else:
                connection.wait_ms = int(busy_timeout.group(1))
                self._rows, self.description = deque(), None
            self.rowcount, self.lastrowid = -1, None
            return self
        try:
            outcome = _run(db, sql, parameters, many)
        except sqlite3.OperationalError as exc:
            if not _is_busy(exc):
                raise
            on_thread = cast("Callable[..., Awaitable[_Outcome]]", connection._execute)  # untyped in aiosqlite
            outcome = await on_thread(_run_waiting, db, connection.wait_ms, sql, parameters, many)
        rows, self.description, self.rowcount, self.lastrowid = outcome
        self._rows = deque(rows)
        return self

    async def execute(self, sql: str, parameters: Iterable[Any] | None = None) -> BufferedCursor:
        return await self._call(sql, () if parameters is None else parameters, many=False)

    async def executemany(self, sql: str, parameters: Iterable[Iterable[Any]]) -> BufferedCursor:
        return await self._call(sql, parameters, many=True)

    async def fetchone(self) -> Any:
        return self._rows.popleft() if self._rows else None

    async def fetchmany(self, size: int | None = None) -> Sequence[Any]:
        count = min(len(self._rows), self.arraysize if size is None else size)
        return [self._rows.popleft() for _ in range(count)]

    async def fetchall(self) -> Sequence[Any]:
        rows = list(self._rows)
        self._rows.clear()
        return rows

    async def close(self) -> None:
        self._rows.clear()


class OneHopConnection(aiosqlite.Connection):
    """`aiosqlite.Connection` whose cursors are `BufferedCursor`s and whose commit and rollback run on the caller's
    thread (see the module docstring for when a commit does not)."""

    wait_ms: int = 0
    """The busy timeout the connection was configured with, used on its thread; statements here run with 0."""
    _timeout_taken = False
    _commits_here: bool | None = None
    """Whether commits run on the event loop (WAL, no fsync at commit); decided at the first commit."""
    _commits_since_checkpoint = 0
    _checkpointing: asyncio.Future[tuple[int, int, int]] | None = None
    checkpoints = 0
    """Checkpoints this connection has finished on its thread."""

    def cursor(self) -> BufferedCursor:  # type: ignore[override]
        return BufferedCursor(self)

    def take_busy_timeout(self, db: sqlite3.Connection) -> None:
        """Before the first statement here: remember the configured busy timeout and set SQLite's to 0.

        `PRAGMA busy_timeout = N` through a cursor (the app's connect event sends one) sets this wait, and
        `PRAGMA busy_timeout` reads it.
        """
        if not self._timeout_taken:
            (self.wait_ms,) = db.execute("PRAGMA busy_timeout").fetchone()
            db.execute("PRAGMA busy_timeout = 0")
            self._timeout_taken = True

    async def settle(self) -> None:
        """Wait for the checkpoint the connection's thread may be running; every call on the connection comes here
        first. Shielded: a caller cancelled meanwhile leaves it to finish, and the next call waits for it."""
        pending = self._checkpointing
        if pending is None:
            return
        try:
            await asyncio.shield(pending)
        except sqlite3.Error as exc:  # a failed PASSIVE checkpoint loses nothing: the WAL keeps the pages
            _LOG.warning("SQLite checkpoint failed (the next one will retry): %s", exc)
        else:
            self.checkpoints += 1
        finally:
            if pending.done():
                self._checkpointing = None

    def _decide_commits_here(self, db: sqlite3.Connection) -> bool:
        if self._commits_here is None:
            (mode,) = db.execute("PRAGMA journal_mode").fetchone()
            (synchronous,) = db.execute("PRAGMA synchronous").fetchone()
            self._commits_here = str(mode).lower() == "wal" and int(synchronous) <= 1  # OFF or NORMAL
            if self._commits_here:
                db.execute("PRAGMA wal_autocheckpoint = 0")  # checkpoints go to the thread (settle)
        return self._commits_here

    async def commit(self) -> None:
        await self.settle()
        db = self._conn
        if not self._decide_commits_here(db):
            await super().commit()
            return
        try:
            db.commit()
        except sqlite3.OperationalError as exc:
            if not _is_busy(exc):
                raise
            await cast("Callable[..., Awaitable[None]]", self._execute)(_commit_waiting, db, self.wait_ms)
        self._commits_since_checkpoint += 1
        if self._commits_since_checkpoint >= CHECKPOINT_EVERY_COMMITS:
            self._commits_since_checkpoint = 0
            on_thread = cast("Callable[..., Awaitable[tuple[int, int, int]]]", self._execute)
            self._checkpointing = asyncio.ensure_future(on_thread(_checkpoint, db))

    async def rollback(self) -> None:
        await self.settle()
        self._conn.rollback()

    async def close(self) -> None:
        await self.settle()
        await super().close()


def connect(database: str, **kwargs: Any) -> OneHopConnection:
    """`aiosqlite.connect` returning a `OneHopConnection` (the dialect's `async_creator_fn`; it awaits the result)."""

    def connector() -> sqlite3.Connection:
        db: sqlite3.Connection = sqlite3.connect(database, **{**kwargs, "check_same_thread": False})
        return db

    connection = OneHopConnection(connector, 64)
    connection._thread.daemon = True  # as the dialect does for its own connections: never keeps a process alive
    return connection
