"""The outbox relay: delivers committed outbox rows, in order, through a `ProviderBus`, at least once.

Rows are read in id order and delivered one by one; a row is marked delivered only after the bus confirmed it (the
PubAck, or the KV write). A failure stops the pass at that row (later rows wait, so a host's desired state never
overtakes an older one), records the attempt and error on the row, and the relay retries with exponential backoff.
A crash between publishing and marking means the row is published again by the next relay, which is why messages
carry ids consumers dedup on (JetStream drops the repeat inside its duplicate window).

The relay holds no database connection while it talks to the broker, so a slow or absent broker never blocks the
API's writers (SQLite has one pooled connection). Rows left undelivered by an earlier process are simply the first
rows the next relay finds. With several API replicas on one database, only the replica holding the relay's lock
delivers (`relay_leadership`, which also wakes it when another replica commits rows); the others wait their turn,
and take over within a poll when it dies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from api.log_context import log_context
from api.models import OutboxMessage, OutboxTopic, utcnow
from api.services.relay_leadership import RelayLeadership
from broker_config.provider_bus import ProviderBus
from harmonaize.waits import wait_set

_log = logging.getLogger(__name__)


class OutboxRelay:
    """Deliver outbox rows through `bus`; `run()` forever (a lifespan task), or `deliver_pending()` once."""

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        bus: ProviderBus,
        *,
        batch_size: int = 100,
        poll_interval: float = 0.25,
        backoff_initial: float = 0.05,
        backoff_max: float = 5.0,
        clock: Callable[[], datetime] = utcnow,
        leadership: RelayLeadership | None = None,
    ) -> None:
        self._sessions = sessionmaker
        self.leadership = leadership
        """None: this relay is the only one (tests, tools); else `run` delivers only while it leads."""
        self._bus = bus
        self._batch_size = batch_size
        self._poll_interval = poll_interval
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._clock = clock
        self._wake = asyncio.Event()
        if leadership is not None:
            leadership.on_new_rows(self.wake)  # rows committed by other replicas (PostgreSQL's NOTIFY)
        self.delivered = 0
        self.failures = 0

    def wake(self) -> None:
        """Look for new rows now instead of at the next poll (call after committing outbox rows)."""
        self._wake.set()

    async def deliver_pending(self) -> int:
        """Deliver every undelivered row in order; how many. Raises the first delivery failure (after recording it)."""
        delivered = 0
        while True:
            if delivered and self.leadership is not None and not await self.leadership.held():
                return delivered  # another replica delivers the rest
            async with self._sessions() as session:
                rows = (
                    await session.execute(
                        select(OutboxMessage.id, OutboxMessage.topic, OutboxMessage.subject, OutboxMessage.payload,
                               OutboxMessage.msg_id)
                        .where(OutboxMessage.delivered_at.is_(None))
                        .order_by(OutboxMessage.id)
                        .limit(self._batch_size)
                    )
                ).all()
            if not rows:
                return delivered
            for row_id, topic, subject, payload, msg_id in rows:
                try:
                    with log_context(event=msg_id):
                        if topic is OutboxTopic.TENANT_EVENT:
                            await self._bus.publish_event(subject, bytes(payload), msg_id)
                        else:
                            await self._bus.put_desired(subject, bytes(payload))
                except Exception as exc:
                    self.failures += 1
                    await self._mark(row_id, error=f"{type(exc).__name__}: {exc}"[:500])
                    raise
                await self._mark(row_id, error=None)
                delivered += 1
                self.delivered += 1

    async def _mark(self, row_id: int, *, error: str | None) -> None:
        values: dict[str, object] = {"attempts": OutboxMessage.attempts + 1}
        if error is None:
            values["delivered_at"] = self._clock()
        else:
            values["last_error"] = error
        async with self._sessions() as session:
            await session.execute(update(OutboxMessage).where(OutboxMessage.id == row_id).values(**values))
            await session.commit()

    async def run(self) -> None:
        """Deliver until cancelled: after each pass wait for a wake-up or the poll interval; back off on failure."""
        try:
            await self._run()
        finally:
            if self.leadership is not None:
                await asyncio.shield(self.leadership.release())

    async def _run(self) -> None:
        backoff = self._backoff_initial
        while True:
            self._wake.clear()
            if self.leadership is not None and not await self.leadership.held():
                await wait_set(self._wake, self._poll_interval)  # another replica delivers; ask again after a poll
                continue
            try:
                await self.deliver_pending()
            except Exception as exc:  # the broker or the database; both are retried
                _log.warning("outbox delivery failed, retrying in %.2f s: %r", backoff, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._backoff_max)
                continue
            backoff = self._backoff_initial
            await wait_set(self._wake, self._poll_interval)
