"""Ack after commit, for many events at once: the runtime's group commit of handled records.

An event is acked only once the store has committed that its handlers finished (`tenant_controllers.store`). Done
per event, that is one SQLite commit and one ack written to the socket each: at a thousand events a second, a fifth
of a controller's CPU (bench/HISTORY.md, 'The event path's tail, 5 rounds'). Lanes instead stage their records and
hand the delivery here; one task commits whatever was staged by every event finished in the same turn of the event
loop, then acks all of them, which nats-py then writes to the socket together. The order is the one that matters:
nothing is acked before the commit that covers it, so a controller killed in between only sees those events again,
and skips the handlers recorded.

A commit that fails (a full disk, a locked file) hands every waiting event back with a delay, as a failed `record`
did for its one event: their handlers run again on redelivery.
"""

from __future__ import annotations

import asyncio
import logging

from tenant_controllers.sources import Delivery
from tenant_controllers.store import HandledStore

__all__ = ["CommitThenAck"]

RETRY_DELAY_S = 1.0
"""How long a broker waits before redelivering an event whose records could not be committed."""


class CommitThenAck:
    """Acks deliveries once the store has committed what their handlers staged; one commit per batch."""

    def __init__(self, store: HandledStore, log: logging.Logger) -> None:
        self._store = store
        self._log = log
        self._waiting: list[Delivery] = []
        self._task: asyncio.Task[None] | None = None

    def ack_after_commit(self, delivery: Delivery) -> None:
        """Ack `delivery` after the next commit (which runs once the current turn of the event loop is over)."""
        self._waiting.append(delivery)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="hz-commit-then-ack")

    async def drain(self) -> None:
        """Return once every delivery handed over so far is committed and acked (or handed back)."""
        while self._task is not None:
            await asyncio.wait({self._task})

    async def _run(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, []
                try:
                    self._store.commit()
                except Exception:
                    self._log.exception("could not record %d handled event(s); handing them back", len(batch))
                    for delivery in batch:
                        await self._settle(delivery, ack=False)
                    continue
                for delivery in batch:
                    await self._settle(delivery, ack=True)
        finally:
            self._task = None

    async def _settle(self, delivery: Delivery, *, ack: bool) -> None:
        try:
            await (delivery.ack() if ack else delivery.nak(delay=RETRY_DELAY_S))
        except Exception:  # the broker will redeliver it; de-duplication absorbs that
            self._log.warning("could not settle a delivery on %s; it will be redelivered", delivery.subject,
                              exc_info=True)
