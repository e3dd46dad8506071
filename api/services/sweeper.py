"""The background sweeper: time-driven changes nobody asks for, applied by the control plane itself.

Things happen because time passes, not because of a request: an offer's expiry passes (the negotiation becomes
expired and the tenant's feed says so), capacity reserved for a later start reaches its start (the hosts' desired
state must now include those workers), an accepted maintenance approval outlives `APPROVAL_TTL` without an outcome
(it is recorded as failed, and leaves its hosts' desired state), and what a job could grow into changes (its tenant
gets a capacity event: `capacity_events`). All are level-triggered queries over the database, so a sweeper that was
down simply catches up; all are also safe alongside lazy expiry on reads and other API processes (guarded updates
decide races).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from api.services.capacity_events import publish_capacity_changes
from api.services.host_assignments import announce_due_reservations
from api.services.maintenance_approvals import expire_approvals
from api.services.negotiation_history import SWEEP_BATCH, expire_due

_log = logging.getLogger(__name__)


async def sweep_once(sessionmaker: async_sessionmaker[AsyncSession], *, now: datetime) -> int:
    """Expire due offers and announce started reservations; how many changes were made."""
    changes = 0
    while True:
        async with sessionmaker() as session:
            expired = await expire_due(session, now=now)
        changes += expired
        if expired < SWEEP_BATCH:
            break
    async with sessionmaker() as session:
        changes += len(await announce_due_reservations(session, now=now))
    return changes


async def run_sweeper(
    sessionmaker: async_sessionmaker[AsyncSession],
    *,
    clock: Callable[[], datetime],
    interval: float,
    secret: bytes,
    on_change: Callable[[], None] = lambda: None,
) -> None:
    """Sweep every `interval` seconds until cancelled; `on_change` (e.g. waking the outbox relay) after changes."""
    while True:
        try:
            changes = await sweep_once(sessionmaker, now=clock())
            async with sessionmaker() as session:
                changes += await publish_capacity_changes(session, secret=secret, now=clock())
            async with sessionmaker() as session:
                changes += await expire_approvals(session, now=clock())
            if changes:
                on_change()
        except Exception as exc:  # a database hiccup must not end the loop
            _log.warning("negotiation sweep failed: %r", exc)
        await asyncio.sleep(interval)
