"""What the control plane's database says now, for the metrics endpoint: a handful of aggregate queries per scrape.

Read at scrape time rather than counted at transitions, so every API process reports the same truth (counters in
one process would miss what another did, and restart at zero), and a value can never drift from the ledger's own
totals. No tenant or host ids appear: the numbers are fleet-wide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from api.models import Host, Negotiation, OutboxMessage, Tenant


@dataclass(frozen=True)
class FleetStats:
    negotiations_by_state: dict[str, int] = field(default_factory=dict)
    outbox_pending: dict[str, int] = field(default_factory=dict)
    """Undelivered outbox rows by topic (tenant_event, desired_state)."""
    outbox_delivered: dict[str, int] = field(default_factory=dict)
    outbox_oldest_pending_s: float = 0.0
    """Age of the oldest undelivered row: grows without bound when the relay is stuck."""
    hosts_up: int = 0
    hosts_down: int = 0
    gpus_total: int = 0
    gpus_allocated: int = 0
    gpus_down: int = 0
    tenants_active: int = 0
    tenants_revoked: int = 0

    @property
    def ledger_utilisation(self) -> float:
        """Allocated GPUs over the GPUs of hosts that are up (0 with no capacity)."""
        usable = self.gpus_total - self.gpus_down
        return self.gpus_allocated / usable if usable > 0 else 0.0


async def fleet_stats(session: AsyncSession, *, now: datetime) -> FleetStats:
    """Aggregate the negotiations, outbox, hosts and tenants tables."""
    negotiations = {
        str(state): int(count)
        for state, count in await session.execute(
            select(Negotiation.state, func.count()).group_by(Negotiation.state)
        )
    }
    pending: dict[str, int] = {}
    delivered: dict[str, int] = {}
    rows = await session.execute(
        select(OutboxMessage.topic, OutboxMessage.delivered_at.is_(None), func.count()).group_by(
            OutboxMessage.topic, OutboxMessage.delivered_at.is_(None)
        )
    )
    for topic, undelivered, count in rows:
        (pending if undelivered else delivered)[str(topic)] = int(count)
    oldest = await session.scalar(
        select(func.min(OutboxMessage.created_at)).where(OutboxMessage.delivered_at.is_(None))
    )
    hosts = (
        await session.execute(
            select(
                func.count(Host.id),
                func.count(Host.down_at),
                func.coalesce(func.sum(Host.gpus), 0),
                func.coalesce(func.sum(Host.allocated_gpus), 0),
            )
        )
    ).one()
    gpus_down = await session.scalar(select(func.coalesce(func.sum(Host.gpus), 0)).where(Host.down_at.is_not(None)))
    tenants = (await session.execute(select(func.count(Tenant.id), func.count(Tenant.revoked_at)))).one()
    return FleetStats(
        negotiations_by_state=negotiations,
        outbox_pending=pending,
        outbox_delivered=delivered,
        outbox_oldest_pending_s=max(0.0, (now - oldest).total_seconds()) if oldest is not None else 0.0,
        hosts_up=int(hosts[0]) - int(hosts[1]),
        hosts_down=int(hosts[1]),
        gpus_total=int(hosts[2]),
        gpus_allocated=int(hosts[3]),
        gpus_down=int(gpus_down or 0),
        tenants_active=int(tenants[0]) - int(tenants[1]),
        tenants_revoked=int(tenants[1]),
    )
