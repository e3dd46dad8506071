"""Rows a transaction only ever inserts, queued on the session and written together as its commit begins.

A negotiation's request writes its row, its first rounds, the idempotency key with the response and the tenant's
event; an accept writes a round, the tenant's event and a desired state per host. None of these rows is read back
before the commit, so they need not be written one statement at a time while the transaction runs: queued here,
they are written by as few statements as the database allows, at the end.

Each table's rows are one multi-row insert, in queued order (the outbox's ids, which the relay publishes in, follow
it); the tables go in the order of their foreign keys (a negotiation before its rounds), as the unit of work's
flush would write them.
- PostgreSQL: one statement, whatever the tables: all but the last table's insert go in data-modifying CTEs
  (`WITH w0 AS (INSERT ...) INSERT ...`), whose foreign keys are checked when the statement ends.
- SQLite: one statement per table (it has no data-modifying CTEs; its statements run on the caller's thread,
  `api.sqlite_driver`, so each costs only SQLAlchemy's own work).

A transaction that does not commit writes none of them. A caller that is about to read what it queued (or write a
row that refers to it by a foreign key, outside this queue) writes the queue first: `write_queued`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Table, event, insert
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
    sync = session.sync_session if isinstance(session, AsyncSession) else session
    if not sync.in_transaction():
        sync.begin()
    sync.info.setdefault(_QUEUED, []).append((table, row))


def queued_rows(session: AsyncSession | Session, table: Table) -> list[Row]:
    """The rows queued for `table` and not yet written (for tests and diagnostics)."""
    sync = session.sync_session if isinstance(session, AsyncSession) else session
    return [row for queued_table, row in sync.info.get(_QUEUED, ()) if queued_table is table]


async def write_queued(session: AsyncSession) -> None:
    """Write the queue now, inside the transaction (before reading those rows, or referring to them), ahead of any
    object pending in the session (as at commit)."""
    await session.run_sync(_write)


def statements(queued: Sequence[tuple[Table, Row]], dialect: str) -> list[tuple[Insert, list[Row] | None]]:
    """The statements (with their executemany rows, or None: the values are in the statement) that write `queued`
    on `dialect`, in the order to run them (see the module docstring)."""
    per_table: dict[Table, list[Row]] = {}
    for table, row in queued:
        per_table.setdefault(table, []).append(row)
    tables = _foreign_keys_first(frozenset(per_table))
    if dialect != "postgresql" or len(tables) == 1 or sum(len(row) for _, row in queued) > MAX_PARAMETERS:
        return [(insert(table), per_table[table]) for table in tables]
    *first, last = tables
    ctes = [insert(table).values(per_table[table]).cte(f"w{index}") for index, table in enumerate(first)]
    return [(insert(last).values(per_table[last]).add_cte(*ctes), None)]


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
        for statement, rows in statements(queued, dialect):
            session.execute(statement, rows) if rows is not None else session.execute(statement)


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
