"""Tenants: created and listed by the provider's admin; each tenant reads only itself (`GET /tenant`)."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter

from api.deps import AdminDep, CurrentTenant, RegistryDep, SessionDep
from api.schemas import NatsCredentialsPublic, TenantCreate, TenantCreated, TenantPublic
from api.services import tenants as service
from harmonaize.ids import TenantId

router = APIRouter(tags=["tenants"])


@router.post("/tenants", status_code=201)
async def create_tenant(
    body: TenantCreate, _admin: AdminDep, session: SessionDep, registry: RegistryDep
) -> TenantCreated:
    """Create a tenant; the response carries its API token and NATS seed, which are never shown again."""
    created = await registry.create(session, tenant_id=body.id, display_name=body.display_name)
    public = TenantPublic.model_validate(created.tenant)
    return TenantCreated(
        **public.model_dump(),
        api_token=created.api_token,
        nats=NatsCredentialsPublic(**asdict(created.nats)),
    )


@router.get("/tenants")
async def list_tenants(_admin: AdminDep, session: SessionDep) -> list[TenantPublic]:
    return [TenantPublic.model_validate(tenant) for tenant in await service.list_tenants(session)]


@router.get("/tenants/{tenant_id}")
async def get_tenant(tenant_id: TenantId, _admin: AdminDep, session: SessionDep) -> TenantPublic:
    return TenantPublic.model_validate(await service.get_tenant(session, tenant_id))


@router.delete("/tenants/{tenant_id}")
async def revoke_tenant(
    tenant_id: TenantId, _admin: AdminDep, session: SessionDep, registry: RegistryDep
) -> TenantPublic:
    """Revoke a tenant: its token stops working and the broker drops its user. The record is kept."""
    return TenantPublic.model_validate(await registry.revoke(session, tenant_id))


@router.get("/tenant")
async def get_own_tenant(tenant: CurrentTenant, session: SessionDep) -> TenantPublic:
    return TenantPublic.model_validate(await service.get_tenant(session, tenant.id))
