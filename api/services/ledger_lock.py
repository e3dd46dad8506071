"""Who may write the capacity ledger at once on PostgreSQL: the whole ledger, or one job and the hosts it touches.

Correctness never depends on these locks: every grant is a conditional UPDATE whose rowcount is checked, backed by
CHECK constraints. They prevent deadlocks. A change touches a job and several hosts, in an order set by placement
preferences; two transactions locking the same rows in different orders would deadlock, and PostgreSQL would abort
one after a second. So every writer takes a transaction-scoped advisory lock on the ledger first, in one of two modes:

- **The whole ledger** (`lock_ledger`, exclusive): node failures, outages, replacements, maintenance, job creation,
  the sweeper's due reservations: rare changes that may touch any job and host, in any order.
- **One job and its hosts** (`share_ledger`, shared with other such writers): an accepted resize or plan change.
  After the shared lock it writes its own job's row first, then locks the hosts it will write (`hold_hosts`) in one
  statement, in id order, before writing any of them (a shrink, whose hosts are its job's own, in the update of the
  job's row: `locked_hosts_of_job`; a grow whose only host is the one it grows on, by the grant's update of that
  host: `lock_left_to_update`); it writes no other job's row (`hold_job`). Two such accepts on
  different hosts run side by side; on a common host the later one waits for the earlier one's commit, holding no
  row the earlier one needs, so no cycle can form. A writer that finds it needs a host below one it holds (a
  placement raced and lost its planned host), or another job's row, raises `LedgerOrderError`: the caller rolls back
  and redoes the change holding the whole ledger, where any order is safe.

How long changes wait for these locks and hold them is in `/v1/metrics` (`LOCK_METRICS`): when accepts queue, the
wait grows long before the database looks busy.

Before either lock a transaction may write only rows that no holder writes on another's behalf: its own negotiation
(an accept changes it and queues its round first, then locks; `lock_ledger` and `share_ledger` say whether there was
a lock to wait for, during which the job may have changed). Held until the transaction ends, so the shorter the work
after it, the more changes per second (`bench/bench_negotiations.py`). SQLite has one writer at a time: both are
no-ops there.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Histogram
from sqlalchemy import ColumnElement, ScalarSelect, TextClause, bindparam, event, func, literal_column, select, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, SessionTransaction

from api.models import Allocation, Host
from api.single_statement import refuse_in_single_statement

__all__ = [
    "LOCK_METRICS", "REDONE", "LedgerOrderError", "StatementLock", "held_already", "held_by_update", "hold_hosts",
    "hold_job", "lock_in_next_statement", "lock_left_to_update", "lock_ledger", "locked_hosts_of_job", "share_ledger",
]

LEDGER_ADVISORY_LOCK = 0x487A_4C65_6467  # "HzLedg": any constant shared by all API processes

_EXCLUSIVE = text("SELECT pg_advisory_xact_lock(:key)")
_SHARED = text("SELECT pg_advisory_xact_lock_shared(:key)")
_HOSTS = text(
    'SELECT id FROM hosts WHERE id IN :hosts ORDER BY id COLLATE "C" FOR NO KEY UPDATE'
).bindparams(bindparam("hosts", expanding=True))
"""The hosts' rows locked in code-point order (Python's `sorted`, which `hold_hosts` checks against), as strongly as
the UPDATEs that follow will: a stronger lock would also hold up inserts of rows that merely refer to a host."""

_SHARE = "hz_ledger_share"
_SINCE = "hz_ledger_since"

LOCK_METRICS = CollectorRegistry(auto_describe=True)
"""This process's waits for the ledger's locks and their holds (PostgreSQL), exported by `/v1/metrics`."""
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_WAITED = Histogram(
    "hz_ledger_lock_wait_seconds", "Time to get the capacity ledger's lock, by mode: whole (exclusive) or shared "
    "(one job and its hosts).", ("mode",), buckets=_BUCKETS, registry=LOCK_METRICS,
)
_HELD = Histogram(
    "hz_ledger_lock_held_seconds", "Time from getting the capacity ledger's lock to the end of its transaction, by "
    "mode.", ("mode",), buckets=_BUCKETS, registry=LOCK_METRICS,
)
_HOSTS_WAITED = Histogram(
    "hz_ledger_hosts_wait_seconds", "Time to lock the rows of the hosts a change holding the ledger shared writes "
    "(one statement, or the grant that locks a grow's one host; an accept on a host another holds waits here).",
    buckets=_BUCKETS, registry=LOCK_METRICS,
)

REDONE = Counter(
    "hz_accepts_redone_whole_ledger", "Accepts of this process redone holding the whole capacity ledger, having "
    "needed a row out of the shared mode's order: how often the shared mode falls short.", registry=LOCK_METRICS,
)


class LedgerOrderError(Exception):
    """The change needs a row out of the order `share_ledger` allows: redo it holding the whole ledger."""


@dataclass
class _Share:
    """What a transaction holding the ledger shared may write: its job, and the hosts locked so far."""

    job: tuple[str, str]
    hosts: set[str] = field(default_factory=set)


def _is_postgresql(session: AsyncSession) -> bool:
    return session.get_bind().dialect.name == "postgresql"


async def lock_ledger(session: AsyncSession) -> bool:
    """Wait for the whole ledger; it is released when the session's transaction ends (commit or rollback).

    True if it waited for one (PostgreSQL): rows read before may have changed meanwhile. False on SQLite, whose
    single pooled connection (`api.db`) already let no other transaction of this process run since the read.
    """
    refuse_in_single_statement(session, "the ledger's lock")
    if not _is_postgresql(session):
        return False
    await _timed(session, _EXCLUSIVE, "whole")
    return True


async def _timed(session: AsyncSession, statement: TextClause, mode: str) -> None:
    started = time.perf_counter()
    await session.execute(statement, {"key": LEDGER_ADVISORY_LOCK})
    _record_lock(session, mode, started)


def _record_lock(session: AsyncSession, mode: str, started: float) -> None:
    locked = time.perf_counter()
    _WAITED.labels(mode=mode).observe(locked - started)
    session.info.setdefault(_SINCE, (mode, locked))  # a second lock in one transaction: the hold runs from the first


@dataclass(frozen=True)
class StatementLock:
    """The ledger's lock in a mode, as a column for the RETURNING of the caller's next statement
    (`lock_in_next_statement`)."""

    mode: Literal["whole", "shared"]

    @property
    def column(self) -> ColumnElement[Any]:
        """`pg_advisory_xact_lock[_shared]` of the ledger's key, evaluated once the statement's row is written."""
        function = func.pg_advisory_xact_lock if self.mode == "whole" else func.pg_advisory_xact_lock_shared
        return function(literal_column(str(LEDGER_ADVISORY_LOCK))).label("ledger_locked")


@asynccontextmanager
async def lock_in_next_statement(
    session: AsyncSession, *, share_for: tuple[str, str] | None
) -> AsyncIterator[StatementLock | None]:
    """The ledger's lock taken by the statement the block sends (on PostgreSQL; None on SQLite, nothing to take),
    rather than by one of its own: a round trip fewer for a change whose last write before the lock is an UPDATE
    of a row only it writes (an accept's guarded state change). Shared for `share_for` (tenant, job), as
    `share_ledger`, or the whole ledger, as `lock_ledger`. The block must put `column` in that statement's
    RETURNING, which runs only if the update matched; on leaving the block without an error the lock is recorded as
    held, and timed, as theirs is (the wait includes the update's own time)."""
    refuse_in_single_statement(session, "the ledger's lock")
    if not _is_postgresql(session):
        yield None
        return
    lock = StatementLock("shared" if share_for is not None else "whole")
    started = time.perf_counter()
    yield lock
    _record_lock(session, lock.mode, started)
    if share_for is not None:
        session.info[_SHARE] = _Share(job=share_for)


async def share_ledger(session: AsyncSession, job: tuple[str, str]) -> bool:
    """Wait for the ledger in shared mode, to change `job` (tenant, id) and the hosts `hold_hosts` then locks.

    As `lock_ledger`: True on PostgreSQL (rows read before may have changed), False on SQLite (nothing to share).
    """
    refuse_in_single_statement(session, "the ledger's lock")
    if not _is_postgresql(session):
        return False
    await _timed(session, _SHARED, "shared")
    session.info[_SHARE] = _Share(job=job)
    return True


async def hold_hosts(session: AsyncSession, hosts: Collection[str]) -> None:
    """Lock the rows of `hosts` not yet locked, before writing them; a no-op unless the ledger is held shared.

    LedgerOrderError when one of them sorts before a host already locked: taking it now could close a cycle with a
    transaction that holds it and waits for ours.
    """
    share: _Share | None = session.info.get(_SHARE)
    if share is None:
        return
    missing = sorted(set(hosts) - share.hosts)
    if not missing:
        return
    if share.hosts and missing[0] < max(share.hosts):
        raise LedgerOrderError(f"host {missing[0]!r} sorts before a host this change already holds")
    started = time.perf_counter()
    await session.execute(_HOSTS, {"hosts": missing})
    _HOSTS_WAITED.observe(time.perf_counter() - started)
    share.hosts.update(missing)


def lock_left_to_update(session: AsyncSession, hosts: Collection[str], written_first: str) -> bool:
    """Whether `hold_hosts(session, hosts)` may be left to the conditional UPDATE of `written_first` that the caller
    sends next: when the ledger is held shared, no host is locked yet and `hosts` is that one host. The UPDATE takes
    the row lock `hold_hosts` would (FOR NO KEY UPDATE) before writing anything, so the order is the same and the
    round trip is saved (a grow on the one host its job runs on: most grows). If it matched, the caller records the
    host with `held_by_update`; if not, it locked nothing, and the caller locks the host with `hold_hosts` before
    going on to another."""
    share: _Share | None = session.info.get(_SHARE)
    return share is not None and not share.hosts and set(hosts) == {written_first}


def held_by_update(session: AsyncSession, host: str, *, sent_at: float) -> None:
    """Record `host` as locked by the matched update `lock_left_to_update` allowed, sent at `sent_at`
    (`time.perf_counter()`): its time is the wait for the host's row, as `hold_hosts`' statement's would be."""
    _HOSTS_WAITED.observe(time.perf_counter() - sent_at)
    held_already(session, (host,))


def held_already(session: AsyncSession, hosts: Collection[str]) -> None:
    """Record `hosts` as locked by a statement of the caller's (in `locked_hosts_of_job`'s order, all at once, or
    the one host of `lock_left_to_update`)."""
    share: _Share | None = session.info.get(_SHARE)
    if share is not None and hosts:
        assert not share.hosts, "a job's hosts are locked before any other host"
        share.hosts.update(hosts)


def locked_hosts_of_job() -> ScalarSelect[list[str] | None]:
    """The hosts of the job `:tenant`/`:job` (its live allocations), locked as `hold_hosts` locks them, as an array:
    for the update of the job's row to lock them in the same statement, after the row (`ledger`)."""
    allocation, host = Allocation.__table__.c, Host.__table__.c
    locked = (
        select(host.id)
        .where(host.id.in_(
            select(allocation.host_id).where(
                allocation.tenant_id == bindparam("tenant"), allocation.job_id == bindparam("job"),
                allocation.released_at.is_(None),
            )
        ))
        .order_by(host.id.collate("C"))
        .with_for_update(key_share=True)
        .subquery("locked")
    )
    return select(func.array_agg(locked.c.id)).scalar_subquery()


def hold_job(session: AsyncSession, job: tuple[str, str]) -> None:
    """Check that this transaction may write `job`'s row: any job under the whole ledger, only its own when shared
    (another job's row may be held by a change that waits for one of our hosts)."""
    share: _Share | None = session.info.get(_SHARE)
    if share is not None and share.job != job:
        raise LedgerOrderError(f"job {job[1]!r} is not the job this change holds")


@event.listens_for(Session, "after_transaction_end")
def _forget_share(session: Session, transaction: SessionTransaction) -> None:
    """The locks end with the transaction; so does the record of them (a session outlives its transactions), and
    the hold is timed."""
    if transaction.parent is None:
        session.info.pop(_SHARE, None)
        if (since := session.info.pop(_SINCE, None)) is not None:
            mode, locked = since
            _HELD.labels(mode=mode).observe(time.perf_counter() - locked)
