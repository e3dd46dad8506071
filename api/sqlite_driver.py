"""SQLite statements on the event loop's thread, with aiosqlite's thread only for what may wait or write the log.

aiosqlite runs every call on its connection's own thread, and SQLAlchemy's adapter makes four calls per statement:
open a cursor, execute, fetch all rows, close. Each is a hand-off from the event loop to that thread and back
(a queue put, a thread wake-up, a `call_soon_threadsafe`), and on these machines one hand-off costs ~0.2 ms of CPU
(bench/HISTORY.md), far more than SQLite's own work for the API's statements (a primary-key read or a one-row
write: microseconds). So `BufferedCursor.execute` runs the statement right here, reads every row, and keeps the rows,
`description`, `rowcount` and `lastrowid` for SQLAlchemy, which reads every row of a (non-streaming) result anyway.

What must not run on the event loop goes to the connection's thread as before:
* waiting for another process's lock. Statements here run with SQLite's busy timeout at 0, so a lock held elsewhere
  (a CLI command, a backup) fails at once with SQLITE_BUSY, before the statement changed anything; it is then run
  again on the thread with the connection's configured timeout (`PRAGMA busy_timeout`, 5 s in `api.db`), where
  waiting blocks only that thread;
* COMMIT, through aiosqlite's own `commit`: it writes the transaction to the WAL and may run an automatic
  checkpoint, i.e. file I/O that can take milliseconds.
ROLLBACK runs here (it only drops what the transaction wrote to memory, and every read-only request ends with one).

Plugged in through the aiosqlite dialect's `async_creator_fn` connect argument (`api.db.make_engine`), so the
dialect, pool and events are SQLAlchemy's own. It reaches into three internals of aiosqlite (`_execute`, `_conn`,
`_thread`); `SUPPORTED` says whether the installed aiosqlite still has them, and where it does not the engine uses
aiosqlite's own cursor (slower, never wrong). The connection is opened with `check_same_thread=False`: calls from
the two threads never overlap, since a pooled connection serves one session at a time and this module awaits each
call on the thread before the next statement. The cursor buffers results, so it serves no streaming (server-side)
reads, which the API does not make.
"""

from __future__ import annotations

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
    """`aiosqlite.Connection` whose cursors are `BufferedCursor`s and whose rollback runs on the caller's thread."""

    wait_ms: int = 0
    """The busy timeout the connection was configured with, used on its thread; statements here run with 0."""
    _timeout_taken = False

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

    async def rollback(self) -> None:
        self._conn.rollback()


def connect(database: str, **kwargs: Any) -> OneHopConnection:
    """`aiosqlite.connect` returning a `OneHopConnection` (the dialect's `async_creator_fn`; it awaits the result)."""

    def connector() -> sqlite3.Connection:
        db: sqlite3.Connection = sqlite3.connect(database, **{**kwargs, "check_same_thread": False})
        return db

    connection = OneHopConnection(connector, 64)
    connection._thread.daemon = True  # as the dialect does for its own connections: never keeps a process alive
    return connection
