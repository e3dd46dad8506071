"""The provider's operational views (admin only): fleet and ledger utilisation, and the outbox.

What the web console's admin view shows beside the hosts and allocations; the same numbers `GET /v1/metrics` gives
Prometheus, as JSON.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Self

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from api.deps import AdminDep, NowDep, SessionDep
from api.models import OutboxMessage
from api.services.fleet_stats import fleet_stats
from api.services.outbox_view import recent_outbox

router = APIRouter(tags=["fleet"])


class FleetPublic(BaseModel):
    hosts_up: int
    hosts_down: int
    gpus_total: int
    gpus_allocated: int
    gpus_down: int
    ledger_utilisation: float = Field(description="Allocated GPUs over the GPUs of hosts that are up (0 to 1).")
    tenants_active: int
    tenants_revoked: int
    negotiations_by_state: dict[str, int]
    outbox_pending: dict[str, int] = Field(description="Undelivered outbox messages by topic.")
    outbox_delivered: dict[str, int]
    outbox_oldest_pending_s: float


class OutboxMessagePublic(BaseModel):
    id: int
    topic: str
    subject: str
    msg_id: str
    created_at: datetime
    delivered_at: datetime | None
    attempts: int
    last_error: str | None

    @classmethod
    def from_model(cls, message: OutboxMessage) -> Self:
        return cls(
            id=message.id,
            topic=message.topic.value,
            subject=message.subject,
            msg_id=message.msg_id,
            created_at=message.created_at,
            delivered_at=message.delivered_at,
            attempts=message.attempts,
            last_error=message.last_error,
        )


@router.get("/fleet")
async def get_fleet(_admin: AdminDep, session: SessionDep, now: NowDep) -> FleetPublic:
    """Hosts, GPUs and the ledger's utilisation, tenants, negotiations by state and the outbox's backlog."""
    stats = await fleet_stats(session, now=now)
    return FleetPublic(
        hosts_up=stats.hosts_up,
        hosts_down=stats.hosts_down,
        gpus_total=stats.gpus_total,
        gpus_allocated=stats.gpus_allocated,
        gpus_down=stats.gpus_down,
        ledger_utilisation=stats.ledger_utilisation,
        tenants_active=stats.tenants_active,
        tenants_revoked=stats.tenants_revoked,
        negotiations_by_state=stats.negotiations_by_state,
        outbox_pending=stats.outbox_pending,
        outbox_delivered=stats.outbox_delivered,
        outbox_oldest_pending_s=stats.outbox_oldest_pending_s,
    )


@router.get("/outbox")
async def list_outbox(
    _admin: AdminDep,
    session: SessionDep,
    pending: Annotated[bool, Query(description="Only the messages not delivered yet.")] = False,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> list[OutboxMessagePublic]:
    """The newest outbox messages first (without their payloads)."""
    messages = await recent_outbox(session, pending_only=pending, limit=limit)
    return [OutboxMessagePublic.from_model(message) for message in messages]
