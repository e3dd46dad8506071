"""One capacity-ledger writer at a time on PostgreSQL, as SQLite's single writer already guarantees.

Correctness never depends on this lock: every grant is a conditional UPDATE whose rowcount is checked, backed by
CHECK constraints. The lock prevents deadlocks. A negotiated change touches a negotiation, a job and several hosts,
in an order set by placement preferences; two such transactions locking the same hosts in different orders would
deadlock, and PostgreSQL would abort one after a second. Taking a transaction-scoped advisory lock before the first
host or job row orders them. Before it, a transaction may write only rows that no holder of the lock writes on
another's behalf: its own negotiation (a counter or a reject changes it first, and takes the lock only if it then
rewrites hosts for warm joiners) and that negotiation's warm joiners. An accept changes its negotiation and
queues its round first too, then takes the lock and reads its job again (`lock_ledger` says whether there was a lock
to wait for, during which the job may have changed). Held until the transaction ends, so the shorter the work after
it, the more changes per second (`bench/bench_negotiations.py`).
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

LEDGER_ADVISORY_LOCK = 0x487A_4C65_6467  # "HzLedg": any constant shared by all API processes


async def lock_ledger(session: AsyncSession) -> bool:
    """Wait for the ledger lock; it is released when the session's transaction ends (commit or rollback).

    True if it waited for one (PostgreSQL): rows read before may have changed meanwhile. False on SQLite, whose
    single pooled connection (`api.db`) already let no other transaction of this process run since the read.
    """
    if session.get_bind().dialect.name != "postgresql":
        return False
    await session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": LEDGER_ADVISORY_LOCK})
    return True
