"""One thread hand-off per SQLite statement: an aiosqlite connection whose cursor runs a statement in a single call.

aiosqlite runs every call on its connection's own thread, and SQLAlchemy's adapter makes four calls per statement:
open a cursor, execute, fetch all rows, close. Each is a hand-off from the event loop to that thread and back
(a queue put, a thread wake-up, a `call_soon_threadsafe`), which on a busy two-core machine cost more CPU than
SQLite's own work: a negotiation's ten statements meant ~35 hand-offs. `BufferedCursor.execute` does the four steps
in one call on the connection's thread and keeps the rows, `description`, `rowcount` and `lastrowid` for SQLAlchemy,
which reads every row of a (non-streaming) result at once anyway. Nothing runs on the event loop's thread: a
statement that waits for another process's lock (`busy_timeout`) still blocks only its connection's thread.

Plugged in through the aiosqlite dialect's `async_creator_fn` connect argument (`api.db.make_engine`), so the
dialect, pool and events are SQLAlchemy's own. It reaches into three internals of aiosqlite (`_execute`, `_conn`,
`_thread`); `SUPPORTED` says whether the installed aiosqlite still has them, and where it does not the engine uses
aiosqlite's own cursor (slower, never wrong). The cursor buffers results, so it serves no streaming
(server-side) reads, which the API does not make.
"""

from __future__ import annotations

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


def _run(connection: sqlite3.Connection, sql: str, parameters: Any, many: bool) -> _Outcome:
    """On the connection's thread: execute, read every row, close; what the cursor needs afterwards."""
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
        on_thread = cast("Callable[..., Awaitable[_Outcome]]", connection._execute)  # untyped in aiosqlite
        rows, self.description, self.rowcount, self.lastrowid = await on_thread(
            _run, connection._conn, sql, parameters, many
        )
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
    """`aiosqlite.Connection` whose cursors are `BufferedCursor`s (opening one costs no hand-off)."""

    def cursor(self) -> BufferedCursor:  # type: ignore[override]
        return BufferedCursor(self)


def connect(database: str, **kwargs: Any) -> OneHopConnection:
    """`aiosqlite.connect` returning a `OneHopConnection` (the dialect's `async_creator_fn`; it awaits the result)."""

    def connector() -> sqlite3.Connection:
        db: sqlite3.Connection = sqlite3.connect(database, **kwargs)
        return db

    connection = OneHopConnection(connector, 64)
    connection._thread.daemon = True  # as the dialect does for its own connections: never keeps a process alive
    return connection
