"""Placing jobs on hosts through the capacity ledger (admin only; tenants see theirs under /jobs/{id}/allocations)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import AdminDep, NowDep, SessionDep, WakeRelayDep
from api.schemas import AllocationCreate, AllocationId, AllocationPublic
from api.services import allocations, ledger
from harmonaize.ids import JobId, TenantId

router = APIRouter(tags=["allocations"])


def _public(placement: ledger.Placement) -> AllocationPublic:
    allocation = placement.allocation
    return AllocationPublic(
        id=allocation.id,
        tenant_id=allocation.tenant_id,
        job_id=allocation.job_id,
        host_id=allocation.host_id,
        locality_group=placement.locality_group,
        gpus=allocation.gpus,
        created_at=allocation.created_at,
        released_at=allocation.released_at,
    )


@router.post("/allocations", status_code=201)
async def allocate(
    body: AllocationCreate, _admin: AdminDep, session: SessionDep, now: NowDep, wake: WakeRelayDep
) -> AllocationPublic:
    """Grant GPUs (whole workers) to a job; 409 when no host in scope has room or the job is at its max_workers."""
    placement = await allocations.allocate(
        session,
        tenant_id=body.tenant_id,
        job_id=body.job_id,
        gpus=body.gpus,
        host_id=body.host_id,
        locality_group=body.locality_group,
        now=now,
    )
    wake()
    return _public(placement)


@router.get("/allocations")
async def list_allocations(
    _admin: AdminDep,
    session: SessionDep,
    tenant_id: Annotated[TenantId | None, Query()] = None,
    job_id: Annotated[JobId | None, Query()] = None,
    include_released: bool = False,
) -> list[AllocationPublic]:
    placements = await allocations.list_placements(
        session, tenant_id=tenant_id, job_id=job_id, include_released=include_released
    )
    return [_public(placement) for placement in placements]


@router.delete("/allocations/{allocation_id}")
async def release(
    allocation_id: AllocationId, _admin: AdminDep, session: SessionDep, now: NowDep, wake: WakeRelayDep
) -> AllocationPublic:
    """Return an allocation's GPUs to its host and job; 409 if it was already released."""
    placement = await allocations.release(session, allocation_id, now=now)
    wake()
    return _public(placement)
