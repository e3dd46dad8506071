"""The provider's GPU hosts (admin only: host ids and locality groups never reach tenants as they are)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from api.models import Host, utcnow
from api.services.errors import ConflictError


async def create_host(session: AsyncSession, host_id: str, *, gpus: int, locality_group: str) -> Host:
    """Register a host with nothing allocated; ConflictError if the id is taken."""
    if await session.get(Host, host_id) is not None:
        raise ConflictError(f"host {host_id!r} already exists")
    host = Host(id=host_id, gpus=gpus, locality_group=locality_group, allocated_gpus=0, created_at=utcnow())
    session.add(host)
    try:
        await session.commit()
    except IntegrityError as exc:
        await session.rollback()
        raise ConflictError(f"host {host_id!r} already exists") from exc
    return host


async def list_hosts(session: AsyncSession) -> list[Host]:
    return list(await session.scalars(select(Host).order_by(Host.id)))
