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
  those and compiles a multi-row VALUES afresh each time, which cost more CPU than the round trips saved. A table
  whose keys the database generates (the outbox) keeps its rows in one executemany insert after that statement,
  so its ids follow the queued order, which the relay publishes in (the CTEs of one statement run in no set order);
  a lone row of it joins the statement. (No queued row can refer to such a table: it cannot know the key.)

A transaction that does not commit writes none of them. A caller that is about to read what it queued (or write a
row that refers to it by a foreign key, outside this queue) writes the queue first: `write_queued`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Table, bindparam, event, insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, SessionTransaction
from sqlalchemy.sql.ddl import sort_tables
from sqlalchemy.sql.dml import Insert

Row = dict[str, Any]

MAX_PARAMETERS = 30_000
"""Bound parameters per PostgreSQL statement, at most (its protocol allows 32,767): a larger queue is written by one
statement per table instead."""

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
    object pending in the session (as at commit)."""
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
    ordered = [table for table in tables if table.autoincrement_column is not None]
    single = [(table, row) for table in tables if table not in ordered for row in per_table[table]]
    single += [(table, per_table[table][0]) for table in ordered if len(per_table[table]) == 1]
    separate: list[tuple[Insert, Params]] = [
        (insert(table), per_table[table]) for table in ordered if len(per_table[table]) > 1
    ]
    if len(single) < 2:
        return [(insert(table), [row]) for table, row in single] + separate
    shape = tuple((table, tuple(row)) for table, row in single)
    params = {f"p{index}_{name}": value for index, (_, row) in enumerate(single) for name, value in row.items()}
    return [(_one_statement(shape), params), *separate]


@functools.lru_cache(maxsize=256)
def _one_statement(shape: tuple[tuple[Table, tuple[str, ...]], ...]) -> Insert:
    """One-row inserts of `shape`'s tables and columns, all but the last in CTEs, with parameters `p<i>_<column>`:
    built once per shape (a handful occur), so neither the statement nor its cache key is made per transaction."""
    inserts = [
        insert(table).values({name: bindparam(f"p{index}_{name}", type_=table.c[name].type) for name in names})
        for index, (table, names) in enumerate(shape)
    ]
    *in_ctes, last = inserts
    return last.add_cte(*(statement.cte(f"w{index}") for index, statement in enumerate(in_ctes)))


@functools.cache
def _foreign_keys_first(tables: frozenset[Table]) -> tuple[Table, ...]:
    """`tables`, each after the tables it refers to (memoised: a handful of combinations ever occur)."""
    return tuple(sort_tables(tables))


def _write(session: Session) -> None:
    queued = session.info.pop(_QUEUED, None)
    if not queued:
        return
    dialect = session.get_bind().dialect.name
    with session.no_autoflush:  # the queue goes first: pending objects may refer to its rows
        for statement, params in statements(queued, dialect):
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
