"""Use cases whose one write is their commit's single statement, run without BEGIN and COMMIT on PostgreSQL.

A new negotiation reads (its idempotency key and job, the hosts) and then writes every row it makes in one statement
at its commit (`api.commit_inserts`). Under READ COMMITTED, PostgreSQL's default, each statement of a transaction
sees the data as of its own start anyway, and one statement is atomic by itself: the transaction adds nothing but
its BEGIN and COMMIT, two of a request's five round trips. So such a use case may start in *single-statement mode*
(`begin_single_statement`): the session's connection in autocommit, each statement its own transaction.

The mode holds only while the use case reads. Anything that would need the transaction raises `NeedsTransaction`
before it reaches the database: a data-changing statement run through the session, a flush of ORM objects, a lock
(`api.services.ledger_lock`), or a commit whose queued rows take more than one statement. Nothing has been written
then, so the caller rolls back and runs the use case again in an ordinary transaction (`run_single_statement`).
SQLite gets no such mode: its commit writes one statement per table.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import ORMExecuteState, Session, SessionTransaction, UOWTransaction

__all__ = [
    "NeedsTransaction",
    "begin_single_statement",
    "end_single_statement",
    "in_single_statement",
    "refuse_in_single_statement",
    "run_single_statement",
]

T = TypeVar("T")

_MODE = "hz_single_statement"
"""The `session.info` key set while the session's current transaction runs in single-statement mode."""


class NeedsTransaction(Exception):  # noqa: N818 - a signal to redo, not an error anyone sees
    """The use case needs an ordinary transaction after all: roll back and run it again in one."""


async def begin_single_statement(session: AsyncSession) -> bool:
    """Put a session that has not begun anything into single-statement mode (PostgreSQL only); whether it did."""
    sync = session.sync_session
    if sync.in_transaction() or session.get_bind().dialect.name != "postgresql":
        return False
    await session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
    sync.info[_MODE] = True
    return True


def in_single_statement(session: AsyncSession | Session) -> bool:
    return bool(_sync(session).info.get(_MODE))


def refuse_in_single_statement(session: AsyncSession | Session, what: str) -> None:
    """Raise `NeedsTransaction` if the session is in single-statement mode: `what` needs the transaction."""
    if in_single_statement(session):
        raise NeedsTransaction(what)


def end_single_statement(session: AsyncSession | Session) -> None:
    """Leave the mode for the one statement that writes (the commit's, `api.commit_inserts`): it is the last."""
    _sync(session).info.pop(_MODE, None)


async def run_single_statement(session: AsyncSession, use_case: Callable[[], Awaitable[T]]) -> T:
    """Run `use_case()` on `session` in single-statement mode where the database has it, once more in an ordinary
    transaction if it raises `NeedsTransaction` (rolled back first: it wrote nothing)."""
    single = await begin_single_statement(session)
    try:
        return await use_case()
    except NeedsTransaction:
        if not single:
            raise
        await session.rollback()
        return await use_case()


def _sync(session: AsyncSession | Session) -> Session:
    return session.sync_session if isinstance(session, AsyncSession) else session


@event.listens_for(Session, "do_orm_execute")
def _reads_only(state: ORMExecuteState) -> None:
    if in_single_statement(state.session) and not state.is_select:
        raise NeedsTransaction(f"a {type(state.statement).__name__.lower()} statement")


@event.listens_for(Session, "before_flush")
def _no_flush(session: Session, _flush: UOWTransaction, _instances: Any) -> None:
    if in_single_statement(session) and (session.new or session.dirty or session.deleted):
        raise NeedsTransaction("a flush of ORM objects")


@event.listens_for(Session, "after_transaction_end")
def _forget(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:
        session.info.pop(_MODE, None)
