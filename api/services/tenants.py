"""The tenant registry, and keeping the broker in step with it.

The database is the source of truth; the broker is told the full list of active tenants after every change
(level-triggered, `TenantBroker.apply`). A change is committed only after the broker accepted the new list, so a
broker failure leaves no tenant the broker does not serve: the transaction rolls back and the caller gets a 503.
(The reverse window, broker applied but commit failed, leaves a broker account whose seed nobody ever saw; the next
apply, at the latest at the next start-up, removes it.)

Changes are serialised, since two concurrent creations would each apply a list without the other's tenant and the
later apply would drop the earlier tenant from the broker: an asyncio lock within this process, plus a
transaction-scoped advisory lock on PostgreSQL for several API processes (SQLite's single writer already serialises
them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import cast

from sqlalchemy import Table, bindparam, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from api.db import execute_core
from api.models import Tenant, utcnow
from api.services.errors import BrokerUnavailableError, ConflictError, NotFoundError
from api.services.tokens import issue_token, token_id_of, token_matches
from broker_config.accounts import TenantAccount, TenantBroker, TenantNatsCredentials

_REGISTRY_ADVISORY_LOCK = 0x487A_5465_6E61  # "HzTena": any constant shared by all API processes
_TENANTS = cast("Table", Tenant.__table__)
_BY_TOKEN_ID = select(_TENANTS.c.id, _TENANTS.c.token_hash, _TENANTS.c.revoked_at).where(
    _TENANTS.c.token_id == bindparam("token_id")
)
"""Built once: every authenticated request runs it, and building a statement costs more than executing it. Core
columns, not the mapped class: a caller needs three of them, not an object in the session."""


@dataclass(frozen=True)
class TokenHolder:
    """Whom a token authenticates: a tenant's id, and since when it is revoked (None: active)."""

    id: str
    revoked_at: datetime | None


@dataclass(frozen=True)
class NewTenant:
    """A created tenant with the secrets that are shown exactly once."""

    tenant: Tenant
    api_token: str
    nats: TenantNatsCredentials


async def active_accounts(session: AsyncSession) -> list[TenantAccount]:
    """What the broker must serve: every tenant not revoked, in a stable order."""
    rows = await session.execute(
        select(Tenant.id, Tenant.nats_user_public_key).where(Tenant.revoked_at.is_(None)).order_by(Tenant.id)
    )
    return [TenantAccount(tenant=tenant_id, user_public_key=key) for tenant_id, key in rows]


async def authenticate(session: AsyncSession, token: str) -> TokenHolder | None:
    """The tenant whose API token this is (revoked or not; the caller decides), or None."""
    token_id = token_id_of(token)
    if token_id is None:
        return None
    row = (await execute_core(session, _BY_TOKEN_ID, {"token_id": token_id})).first()
    if row is None or not token_matches(token, row.token_hash):
        return None
    return TokenHolder(id=row.id, revoked_at=row.revoked_at)


async def get_tenant(session: AsyncSession, tenant_id: str) -> Tenant:
    tenant = await session.get(Tenant, tenant_id)
    if tenant is None:
        raise NotFoundError(f"no tenant {tenant_id!r}")
    return tenant


async def list_tenants(session: AsyncSession) -> list[Tenant]:
    return list(await session.scalars(select(Tenant).order_by(Tenant.id)))


class TenantRegistry:
    """Creates and revokes tenants, and reconciles the broker with the registry."""

    def __init__(self, broker: TenantBroker, *, on_revoked: Callable[[str], None] = lambda _tenant_id: None) -> None:
        self._broker = broker
        self._on_revoked = on_revoked
        """Told a tenant's id once its revocation is committed (the API drops its cached tokens)."""
        self._lock = asyncio.Lock()

    async def reconcile(self, session: AsyncSession) -> list[TenantAccount]:
        """Apply the registry to the broker as it is now (start-up, or repair after a failure)."""
        async with self._lock:
            accounts = await active_accounts(session)
            await self._broker.apply(accounts)
            return accounts

    async def create(self, session: AsyncSession, *, tenant_id: str, display_name: str) -> NewTenant:
        """Register a tenant with a fresh API token and NATS user; committed only once the broker serves it."""
        async with self._lock:
            await self._serialise_across_processes(session)
            if await session.get(Tenant, tenant_id) is not None:
                raise ConflictError(f"tenant {tenant_id!r} already exists")
            keys = self._broker.new_user_keys()
            token = issue_token()
            tenant = Tenant(
                id=tenant_id,
                display_name=display_name,
                token_id=token.token_id,
                token_hash=token.token_hash,
                nats_user_public_key=keys.public_key,
                created_at=utcnow(),
            )
            session.add(tenant)
            try:
                await session.flush()
            except IntegrityError as exc:
                await session.rollback()
                raise ConflictError(f"tenant {tenant_id!r} already exists") from exc
            credentials = self._broker.credentials(tenant_id, keys)
            await self._apply_or_roll_back(session, action="the tenant was not created")
            return NewTenant(tenant=tenant, api_token=token.plaintext, nats=credentials)

    async def revoke(self, session: AsyncSession, tenant_id: str) -> Tenant:
        """Revoke a tenant: its API token stops working and the broker stops serving its user."""
        async with self._lock:
            await self._serialise_across_processes(session)
            tenant = await get_tenant(session, tenant_id)
            if tenant.revoked_at is not None:
                raise ConflictError(f"tenant {tenant_id!r} is already revoked")
            tenant.revoked_at = utcnow()
            await session.flush()
            try:
                await self._apply_or_roll_back(session, action="the tenant was not revoked")
            finally:
                self._on_revoked(tenant_id)  # even if it failed: an entry read meanwhile must not survive it
            return tenant

    async def _serialise_across_processes(self, session: AsyncSession) -> None:
        if session.get_bind().dialect.name == "postgresql":
            await session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _REGISTRY_ADVISORY_LOCK})

    async def _apply_or_roll_back(self, session: AsyncSession, *, action: str) -> None:
        accounts = await active_accounts(session)
        try:
            await self._broker.apply(accounts)
        except Exception as exc:
            await session.rollback()
            raise BrokerUnavailableError(
                f"the broker did not accept the tenant registry ({type(exc).__name__}: {exc}); {action}"
            ) from exc
        await session.commit()
