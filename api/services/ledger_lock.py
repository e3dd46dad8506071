"""One capacity-ledger writer at a time on PostgreSQL, as SQLite's single writer already guarantees.

Correctness never depends on this lock: every grant is a conditional UPDATE whose rowcount is checked, backed by
CHECK constraints. The lock prevents deadlocks. A negotiated change touches a negotiation, a job and several hosts,
in an order set by placement preferences; two such transactions locking the same hosts in different orders would
deadlock, and PostgreSQL would abort one after a second. Taking a transaction-scoped advisory lock first orders them.
Ledger changes are rare control-plane operations, so serialising them costs nothing that matters.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

LEDGER_ADVISORY_LOCK = 0x487A_4C65_6467  # "HzLedg": any constant shared by all API processes


async def lock_ledger(session: AsyncSession) -> None:
    """Wait for the ledger lock; it is released when the session's transaction ends (commit or rollback)."""
    if session.get_bind().dialect.name == "postgresql":
        await session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": LEDGER_ADVISORY_LOCK})
