"""Reading negotiations (one with its rounds, or a filtered page of the history) and expiring stale offers.

Expiry is applied wherever an offer could be observed: lazily before every read (so a tenant never sees an
"offered" negotiation whose offer has passed), before every action, and by the background sweeper (so the tenant's
event feed says "expired" even if nobody reads).

Pages are newest first by (created_at, id) with an opaque cursor (base64 of the last item's key): stable under
concurrent inserts, unlike offsets, and it says nothing a tenant could use beyond "where I was".
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from api.models import Negotiation
from api.services.errors import InvalidRequestError
from api.services.negotiation_store import expire, load, load_record
from api.services.negotiation_views import NegotiationRecord
from harmonaize.negotiation import NegotiationKind, NegotiationState

MAX_PAGE = 200
SWEEP_BATCH = 100


@dataclass(frozen=True)
class HistoryFilter:
    job: str | None = None
    state: NegotiationState | None = None
    kind: NegotiationKind | None = None
    since: datetime | None = None
    until: datetime | None = None


def encode_cursor(negotiation: Negotiation) -> str:
    key = json.dumps([negotiation.created_at.isoformat(), negotiation.id])
    return base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """(created_at, id) of the last item seen; InvalidRequestError for anything we did not issue."""
    try:
        created_at, negotiation_id = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        after = datetime.fromisoformat(created_at)
        if after.tzinfo is None or not isinstance(negotiation_id, str):
            raise ValueError("not one of our cursors")
        return after, negotiation_id
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        raise InvalidRequestError("invalid cursor: pass next_cursor from the previous page unchanged") from None


async def expire_due(
    session: AsyncSession, *, now: datetime, tenant_id: str | None = None, limit: int = SWEEP_BATCH
) -> int:
    """Expire up to `limit` offers whose expiry has passed (one tenant's, or everyone's) and commit; how many."""
    query = (
        select(Negotiation)
        .where(Negotiation.state == NegotiationState.OFFERED, Negotiation.expires_at <= now)
        .order_by(Negotiation.expires_at)
        .limit(limit)
    )
    if tenant_id is not None:
        query = query.where(Negotiation.tenant_id == tenant_id)
    expired = 0
    try:
        for negotiation in list(await session.scalars(query)):
            expired += await expire(session, negotiation, now=now)
        await session.commit()
    except BaseException:
        await session.rollback()
        raise
    return expired


async def get_negotiation(
    session: AsyncSession, *, tenant_id: str, negotiation_id: str, now: datetime
) -> NegotiationRecord:
    """The tenant's negotiation with every round; NotFoundError for anyone else's."""
    negotiation = await load(session, tenant_id=tenant_id, negotiation_id=negotiation_id)
    if await expire(session, negotiation, now=now):
        await session.commit()
    record = await load_record(session, negotiation)
    await session.commit()  # ends the read transaction; unlike a rollback, keeps the loaded objects readable
    return record


async def list_negotiations(
    session: AsyncSession,
    *,
    tenant_id: str,
    now: datetime,
    where: HistoryFilter = HistoryFilter(),
    cursor: str | None = None,
    limit: int = 50,
) -> tuple[list[Negotiation], str | None]:
    """A page of the tenant's negotiations, newest first, and the cursor of the next page (None: last page)."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidRequestError(f"limit must be 1..{MAX_PAGE}")
    while await expire_due(session, now=now, tenant_id=tenant_id) == SWEEP_BATCH:
        pass
    query = select(Negotiation).where(Negotiation.tenant_id == tenant_id)
    if where.job is not None:
        query = query.where(Negotiation.job_id == where.job)
    if where.state is not None:
        query = query.where(Negotiation.state == where.state)
    if where.kind is not None:
        query = query.where(Negotiation.kind == where.kind)
    if where.since is not None:
        query = query.where(Negotiation.created_at >= where.since)
    if where.until is not None:
        query = query.where(Negotiation.created_at < where.until)
    if cursor is not None:
        created_at, negotiation_id = decode_cursor(cursor)
        query = query.where(
            or_(
                Negotiation.created_at < created_at,
                and_(Negotiation.created_at == created_at, Negotiation.id < negotiation_id),
            )
        )
    query = query.order_by(Negotiation.created_at.desc(), Negotiation.id.desc()).limit(limit + 1)
    rows = list(await session.scalars(query))
    await session.commit()
    page = rows[:limit]
    return page, encode_cursor(page[-1]) if len(rows) > limit else None
