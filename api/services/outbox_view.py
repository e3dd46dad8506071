"""The outbox as the provider's operator reads it (admin only): the newest messages first, or only the undelivered.

Delivered rows stay as an audit trail (`api.models.OutboxMessage`), so the list is bounded by `limit`, never the
table. Payloads are not included: the console shows what is moving and what is stuck, not the event bodies.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from api.models import OutboxMessage


async def recent_outbox(session: AsyncSession, *, pending_only: bool, limit: int) -> list[OutboxMessage]:
    """The newest `limit` outbox rows (only the undelivered with `pending_only`), newest first."""
    query = select(OutboxMessage).order_by(OutboxMessage.id.desc()).limit(limit)
    if pending_only:
        query = query.where(OutboxMessage.delivered_at.is_(None))
    return list(await session.scalars(query))
