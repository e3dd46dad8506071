"""The provider's hosts (admin only)."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import AdminDep, SessionDep
from api.host_schemas import HostCreate, HostPublic
from api.services import hosts as service

router = APIRouter(tags=["hosts"])


@router.post("/hosts", status_code=201)
async def create_host(body: HostCreate, _admin: AdminDep, session: SessionDep) -> HostPublic:
    host = await service.create_host(session, body.id, gpus=body.gpus, locality_group=body.locality_group)
    return HostPublic.from_model(host)


@router.get("/hosts")
async def list_hosts(_admin: AdminDep, session: SessionDep) -> list[HostPublic]:
    return [HostPublic.from_model(host) for host in await service.list_hosts(session)]
