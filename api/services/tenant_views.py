"""What a tenant may see of the provider's fleet: projections that hide provider-internal names and detail.

Host ids and locality groups become per-tenant pseudonyms (`harmonaize.pseudonyms`), so a tenant can tell its hosts
and groups apart but cannot learn the provider's names, nor match them with another tenant's view. Free capacity is
reported per pseudonymous group in power-of-two buckets: precise enough to decide whether asking for more workers is
worth it, too coarse to count hosts or to watch other tenants' allocations come and go GPU by GPU.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from api.models import Host
from api.schemas import GroupCapacityPublic, TenantAllocationPublic
from api.services.ledger import Placement
from harmonaize.pseudonyms import host_pseudonym, locality_pseudonym


def free_gpus_bucket(free: int) -> tuple[str, int]:
    """(label, lower bound) of the bucket `free` falls in: 0, 1, 2-3, 4-7, 8-15, ..."""
    if free <= 0:
        return "0", 0
    low = 1 << (free.bit_length() - 1)
    high = (low << 1) - 1
    return (str(low) if low == high else f"{low}-{high}"), low


def tenant_allocation(placement: Placement, *, secret: bytes) -> TenantAllocationPublic:
    """An allocation as its own tenant sees it."""
    allocation = placement.allocation
    return TenantAllocationPublic(
        id=allocation.id,
        job_id=allocation.job_id,
        host=host_pseudonym(secret, allocation.tenant_id, allocation.host_id),
        locality_group=locality_pseudonym(secret, allocation.tenant_id, placement.locality_group),
        gpus=allocation.gpus,
        created_at=allocation.created_at,
        released_at=allocation.released_at,
    )


async def tenant_capacity(session: AsyncSession, *, tenant_id: str, secret: bytes) -> list[GroupCapacityPublic]:
    """Bucketed free GPUs per locality group, named by this tenant's pseudonyms and sorted by them (so the order
    says nothing about the provider's own names)."""
    rows = await session.execute(
        select(Host.locality_group, func.sum(Host.gpus - Host.allocated_gpus))
        .where(Host.down_at.is_(None))
        .group_by(Host.locality_group)
    )
    groups = []
    for group, free in rows:
        label, at_least = free_gpus_bucket(int(free or 0))
        groups.append(
            GroupCapacityPublic(
                locality_group=locality_pseudonym(secret, tenant_id, group),
                free_gpus=label,
                free_gpus_at_least=at_least,
            )
        )
    return sorted(groups, key=lambda entry: entry.locality_group)
