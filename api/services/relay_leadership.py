"""One outbox relay per database at a time, however many API replicas run.

Every replica runs a relay, but the outbox must go out once and in order: two relays reading the same undelivered
rows would publish each of them twice and could interleave a host's desired states. On PostgreSQL the relay holding
a session-level advisory lock is the one that delivers. The lock lives on a connection of its own (autocommit: no
transaction is held open), so when its replica dies, or loses the database, the server ends that session, the lock
goes with it, and another replica's next attempt (one poll interval) takes over. A leader checks its lock's
session before each batch of rows, so a replica cut off from the database stops within a batch; rows it was
publishing when the new leader started may go out twice, like a crash between a publish and its mark did with one
process (consumers dedup on the message id, JetStream inside its duplicate window). SQLite has one API process per
database file (one writer), so no lock is taken there.

A replica that commits outbox rows wakes its own relay directly; the leader hears of rows committed by the others
through PostgreSQL's NOTIFY (a trigger on `outbox` raises `OUTBOX_CHANNEL` at commit, migration 0015), which its lock
session LISTENs to, so it delivers them at once rather than at its next poll (`relay_poll_interval_s`, 0.25 s by
default); the poll stays as the fallback, and as the followers' way to notice a free lock.

Advisory locks are scoped to the database, so two clouds on one PostgreSQL server never share a leader.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

__all__ = ["OUTBOX_CHANNEL", "RELAY_LOCK_KEY", "RelayLeadership"]

_log = logging.getLogger(__name__)

RELAY_LOCK_KEY = int.from_bytes(hashlib.sha256(b"harmonaize.outbox-relay").digest()[:8], "big", signed=True)
"""The advisory lock's key: a fixed 64-bit number, the same in every replica."""

OUTBOX_CHANNEL = "hz_outbox"
"""The channel the outbox's trigger notifies at every commit that inserted rows (migration 0015)."""


class RelayLeadership:
    """Whether this process's relay may deliver now (`held`), and giving that up (`release`)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._locking = engine.dialect.name == "postgresql"
        self._connection: AsyncConnection | None = None
        self.leader = not self._locking
        """The last answer of `held` (always True without a lock to take)."""
        self._on_new_rows: Callable[[], None] = lambda: None

    def on_new_rows(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever another process commits outbox rows, while this one leads (PostgreSQL)."""
        self._on_new_rows = callback

    async def held(self) -> bool:
        """Take the lock if it is free; for a leader, check that its lock's connection still answers."""
        if not self._locking:
            return True
        try:
            if self._connection is None:
                connection = await self._engine.connect()
                self._connection = await connection.execution_options(isolation_level="AUTOCOMMIT")
            if self.leader:
                await self._connection.execute(text("SELECT 1"))
            else:
                taken = await self._connection.scalar(text("SELECT pg_try_advisory_lock(:key)"),
                                                      {"key": RELAY_LOCK_KEY})
                if taken:
                    _log.info("this replica's outbox relay now delivers (advisory lock %d taken)", RELAY_LOCK_KEY)
                    await self._listen(self._connection)
                self.leader = bool(taken)
        except Exception as exc:  # the database went away: whatever this session held is gone with it
            if self.leader:
                _log.warning("outbox relay: lost the database while delivering, standing down: %r", exc)
            await self._drop()
        return self.leader

    async def _listen(self, connection: AsyncConnection) -> None:
        """LISTEN on the lock's own session: it lives exactly as long as the leadership, so no notification is
        missed while leading and none arrives after (asyncpg's listener; another driver keeps to polling)."""
        driver = (await connection.get_raw_connection()).driver_connection
        add_listener = getattr(driver, "add_listener", None)
        if add_listener is not None:
            await add_listener(OUTBOX_CHANNEL, self._notified)
        else:
            _log.info("outbox relay: %s cannot LISTEN; rows of other replicas are found by polling",
                      type(driver).__name__)

    def _notified(self, *_notification: Any) -> None:
        self._on_new_rows()

    async def release(self) -> None:
        """Stop delivering and let another replica take over at once (closing the session frees the lock)."""
        await self._drop()

    async def _drop(self) -> None:
        self.leader = not self._locking
        connection, self._connection = self._connection, None
        if connection is not None:
            try:  # discarded, not returned to the pool: only the end of its session frees a session-level lock
                await connection.invalidate()
                await connection.close()
            except Exception as exc:  # already dead: its session, and the lock, are gone
                _log.debug("closing the relay's lock connection: %r", exc)
