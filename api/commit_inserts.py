"""Rows a transaction only ever inserts, queued on the session and written together as its commit begins.

A negotiation's request writes its row, its first rounds, the idempotency key with the response and the tenant's
event; an accept writes a round, the tenant's event and a desired state per host. None of these rows is read back
before the commit, so they need not be written one statement at a time while the transaction runs: queued here,
they are written by as few statements as the database allows, at the end.

The tables go in the order of their foreign keys (a negotiation before its rounds), as the unit of work's flush
would write them.
- SQLite: one executemany insert per table (it has no data-modifying CTEs; its statements run on the caller's
  thread, `api.sqlite_driver`, so each costs only SQLAlchemy's own work).
- PostgreSQL: one statement for every row of a table whose keys the rows carry (negotiations, rounds, idempotency
  keys): a one-row insert each, all but one in data-modifying CTEs (`WITH w0 AS (INSERT ...) INSERT ...`), whose
  foreign keys are checked when the statement ends. One-row inserts, since SQLAlchemy caches the compiled form of
  those and compiles a multi-row VALUES afresh each time, which cost more CPU than the round trips saved. The rows of
  a table whose keys the database generates (the outbox) must get them in the queued order, which the relay
  publishes in, and the CTEs of one statement run in no set order: so each of its rows after the first is inserted
  *from* the previous one's CTE (`INSERT ... SELECT <values> FROM <previous>`), which makes the database insert it
  second. Up to `MAX_CHAIN` rows; more go in one executemany insert after the statement. (No queued row can refer
  to such a table: it cannot know the key.)

A use case in single-statement mode (`api.single_statement`) commits its queue only if it is one statement.
A transaction that does not commit writes none of them. A caller that is about to read what it queued (or write a
row that refers to it by a foreign key, outside this queue) writes the queue first: `write_queued`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Table, bindparam, event, insert, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, SessionTransaction
from sqlalchemy.sql.ddl import sort_tables
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.selectable import CTE

from api.single_statement import (
    NeedsTransaction,
    end_single_statement,
    in_single_statement,
    refuse_in_single_statement,
)

Row = dict[str, Any]

MAX_PARAMETERS = 30_000
"""Bound parameters per PostgreSQL statement, at most (its protocol allows 32,767): a larger queue is written by one
statement per table instead."""

MAX_CHAIN = 8
"""Rows of a table with generated keys that join the one statement, chained (see the module docstring), at most:
a transaction with more (an outage rewriting many hosts) writes them by an executemany insert after it."""

_QUEUED = "hz_commit_inserts"
"""The `session.info` key of the (table, row) pairs queued in the session's current transaction, in queued order."""


def queue_insert(session: AsyncSession | Session, table: Table, row: Row) -> None:
    """Queue `row` for `table` in the session's transaction, begun here if nothing has begun it yet (so that its
    end, commit or rollback, writes or drops the queue)."""
    sync = _sync(session)
    if not sync.in_transaction():
        sync.begin()
    sync.info.setdefault(_QUEUED, []).append((table, row))


def queued_rows(session: AsyncSession | Session, table: Table) -> list[Row]:
    """The rows queued for `table` and not yet written (for tests and diagnostics)."""
    return [row for queued_table, row in _sync(session).info.get(_QUEUED, ()) if queued_table is table]


def _sync(session: AsyncSession | Session) -> Session:
    return session.sync_session if isinstance(session, AsyncSession) else session


async def write_queued(session: AsyncSession) -> None:
    """Write the queue now, inside the transaction (before reading those rows, or referring to them), ahead of any
    object pending in the session (as at commit). Not in single-statement mode: the commit's is its one write."""
    refuse_in_single_statement(session, "rows written before the commit")
    await session.run_sync(_write)


Params = Row | list[Row]


def statements(queued: Sequence[tuple[Table, Row]], dialect: str) -> list[tuple[Insert, Params]]:
    """The statements with their parameters (a list: executemany) that write `queued` on `dialect`, in the order to
    run them (see the module docstring)."""
    per_table: dict[Table, list[Row]] = {}
    for table, row in queued:
        per_table.setdefault(table, []).append(row)
    tables = _foreign_keys_first(frozenset(per_table))
    if dialect != "postgresql" or sum(len(row) for _, row in queued) > MAX_PARAMETERS:
        return [(insert(table), per_table[table]) for table in tables]
    generated = [table for table in tables if table.autoincrement_column is not None]
    single = [(table, row, False) for table in tables if table not in generated for row in per_table[table]]
    separate: list[tuple[Insert, Params]] = []
    for table in generated:
        rows = [_with_defaults(table, row) for row in per_table[table]]
        if len(rows) > MAX_CHAIN or None in rows:
            separate.append((insert(table), per_table[table]))
        else:
            single += [(table, row, index > 0) for index, row in enumerate(rows) if row is not None]
    if len(single) < 2:
        return [(insert(table), [row]) for table, row, _ in single] + separate
    shape = tuple((table, tuple(row), after) for table, row, after in single)
    params = {f"p{index}_{name}": value for index, (_, row, _) in enumerate(single) for name, value in row.items()}
    return [(_one_statement(shape), params), *separate]


def _with_defaults(table: Table, row: Row) -> Row | None:
    """`row` with the Python-side defaults of the columns it omits, as an insert's VALUES would get them (a row
    inserted from a SELECT gets none); None if one of them is computed (then the row is not chained)."""
    missing = [column for column in table.c if column.name not in row and column.default is not None]
    if any(not column.default.is_scalar for column in missing):  # type: ignore[union-attr]
        return None
    defaults = {column.name: column.default.arg for column in missing}  # type: ignore[union-attr]
    return {**row, **{name: value for name, value in defaults.items() if value is not None}}


@functools.lru_cache(maxsize=256)
def _one_statement(shape: tuple[tuple[Table, tuple[str, ...], bool], ...]) -> Insert:
    """One-row inserts of `shape`'s tables and columns, all but the last in CTEs, with parameters `p<i>_<column>`;
    an entry marked `after` is inserted from the previous entry's CTE, so after it. Built once per shape (a handful
    occur), so neither the statement nor its cache key is made per transaction."""
    ctes: list[CTE] = []
    *earlier, (last_table, last_names, last_after) = shape
    for index, (table, names, after) in enumerate(earlier):
        statement = _one_insert(index, table, names, ctes[-1] if after else None)
        if shape[index + 1][2]:  # the next row is inserted from this one's CTE: it must return a row
            assert table.autoincrement_column is not None, "only rows of a table with generated keys are chained"
            statement = statement.returning(table.autoincrement_column)
        ctes.append(statement.cte(f"w{index}"))
    return _one_insert(len(earlier), last_table, last_names, ctes[-1] if last_after else None).add_cte(*ctes)


def _one_insert(index: int, table: Table, names: tuple[str, ...], after: CTE | None) -> Insert:
    """Entry `index`'s one-row insert, parameters `p<index>_<column>`; from `after`'s CTE if given (so after it)."""
    values = {name: bindparam(f"p{index}_{name}", type_=table.c[name].type) for name in names}
    if after is None:
        return insert(table).values(values)
    return insert(table).from_select(list(names), select(*values.values()).select_from(after), include_defaults=False)


@functools.cache
def _foreign_keys_first(tables: frozenset[Table]) -> tuple[Table, ...]:
    """`tables`, each after the tables it refers to (memoised: a handful of combinations ever occur)."""
    return tuple(sort_tables(tables))


def _write(session: Session) -> None:
    queued = session.info.get(_QUEUED)
    if not queued:
        return
    writes = statements(queued, session.get_bind().dialect.name)
    if in_single_statement(session):  # `api.single_statement`: this must be its one write, and the last
        one = len(writes) == 1 and (isinstance(writes[0][1], dict) or len(writes[0][1]) == 1)
        if not one or session.new or session.dirty or session.deleted:
            raise NeedsTransaction("a commit of more than one statement (an executemany may be several)")
        end_single_statement(session)
    del session.info[_QUEUED]
    with session.no_autoflush:  # the queue goes first: pending objects may refer to its rows
        for statement, params in writes:
            session.execute(statement, params)


@event.listens_for(Session, "before_commit")
def _write_at_commit(session: Session) -> None:
    """As the commit begins, inside the transaction, before the unit of work's final flush: an object added to the
    session may refer to a queued row (a warm joiner to the negotiation just opened), never the other way round."""
    _write(session)


@event.listens_for(Session, "after_transaction_end")
def _drop_queued(session: Session, transaction: SessionTransaction) -> None:
    """A transaction that ends without its commit (rolled back, or its commit failed) takes its queue along."""
    if transaction.parent is None:
        session.info.pop(_QUEUED, None)
