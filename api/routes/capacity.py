"""Coarse free capacity for tenants, per pseudonymous locality group."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import CurrentTenant, PseudonymSecretDep, SessionDep
from api.schemas import CapacityPublic
from api.services.tenant_views import tenant_capacity

router = APIRouter(tags=["capacity"])


@router.get("/capacity")
async def capacity(tenant: CurrentTenant, session: SessionDep, secret: PseudonymSecretDep) -> CapacityPublic:
    return CapacityPublic(groups=await tenant_capacity(session, tenant_id=tenant.id, secret=secret))
