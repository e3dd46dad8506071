"""Named FastAPI dependencies: the session, the caller's identity, and what the app was built with.

Tenant scoping is enforced in exactly one place: `CurrentTenant` turns a bearer token into a tenant, and tenant routes
pass `tenant.id` into services that cannot query without it. No route repeats an ownership check, so none can forget
one.

Status codes: no token, an unknown token or a revoked tenant is 401 (not authenticated). A valid token on the wrong
kind of route (a tenant token on an admin route, the admin token on a tenant route) is 403 with the reason.

Every dependency is `async def`, even those that only read `app.state`: FastAPI runs a plain `def` dependency in a
worker thread, a thread hand-off (four per negotiation request) for what is an attribute read.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.ext.asyncio import AsyncSession
from starlette.datastructures import State

from api.db import close_session
from api.log_context import bind
from api.options import NegotiationRuntime
from api.services.negotiations import NegotiationContext
from api.services.tenants import TenantRegistry, TokenHolder, authenticate
from api.services.token_cache import TokenCache
from broker_config.accounts import TenantBroker
from harmonaize.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <token>`: the admin token or a tenant's")
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


async def _session(request: Request) -> AsyncIterator[AsyncSession]:
    session = request.app.state.sessionmaker()
    try:
        yield session
    finally:
        await close_session(session)


async def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def _registry(request: Request) -> TenantRegistry:
    registry: TenantRegistry = request.app.state.registry
    return registry


async def _broker(request: Request) -> TenantBroker:
    broker: TenantBroker = request.app.state.broker
    return broker


async def _pseudonym_secret(request: Request) -> bytes:
    pseudonym_secret: bytes = request.app.state.pseudonym_secret
    return pseudonym_secret


def _context_of(state: State) -> NegotiationContext:
    runtime: NegotiationRuntime = state.negotiation
    return runtime.context(pseudonym_secret=state.pseudonym_secret)


def _wake_of(state: State) -> Callable[[], None]:
    relay = state.relay
    return relay.wake if relay is not None else _no_wake


def _no_wake() -> None:
    """No relay in this app (a test's): nothing to wake."""


async def _negotiation_context(request: Request) -> NegotiationContext:
    return _context_of(request.app.state)


async def _now(request: Request) -> datetime:
    runtime: NegotiationRuntime = request.app.state.negotiation
    return runtime.clock()


async def _wake_relay(request: Request) -> Callable[[], None]:
    return _wake_of(request.app.state)


SessionDep = Annotated[AsyncSession, Depends(_session)]
NegotiationContextDep = Annotated[NegotiationContext, Depends(_negotiation_context)]
"""The time of this request and the policy's inputs (clock, forecast, regions, offer lifetime)."""
NowDep = Annotated[datetime, Depends(_now)]
"""The app's clock (the one negotiations use), for every ledger change: one time line for the whole ledger."""
WakeRelayDep = Annotated[Callable[[], None], Depends(_wake_relay)]
"""Call after committing outbox rows, so the relay publishes them now rather than at its next poll."""
SettingsDep = Annotated[Settings, Depends(_settings)]
RegistryDep = Annotated[TenantRegistry, Depends(_registry)]
PseudonymSecretDep = Annotated[bytes, Depends(_pseudonym_secret)]
BrokerDep = Annotated[TenantBroker, Depends(_broker)]


Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _token(credentials: HTTPAuthorizationCredentials | None) -> str:
    if credentials is None or not credentials.credentials:
        raise HTTPException(401, "missing bearer token (Authorization: Bearer <token>)", headers=_CHALLENGE)
    return credentials.credentials


async def _bearer_token(credentials: Credentials) -> str:
    return _token(credentials)


BearerToken = Annotated[str, Depends(_bearer_token)]


def is_admin_token(token: str, settings: Settings) -> bool:
    """Constant-time comparison with the configured admin token."""
    if settings.admin_token is None:
        return False
    return hmac.compare_digest(token.encode(), settings.admin_token.get_secret_value().encode())


async def current_tenant(request: Request, credentials: Credentials, session: SessionDep) -> TokenHolder:
    """The active tenant the token belongs to; every tenant route reads and writes through its id.

    Reads the token and the settings itself rather than through `BearerToken` and `SettingsDep`: every tenant
    request solves this, and solving dependencies is a sizeable part of FastAPI's own work per request. A token
    verified moments ago is not read again (`api.services.token_cache`)."""
    token, settings = _token(credentials), request.app.state.settings
    if is_admin_token(token, settings):
        raise HTTPException(403, "this route is for tenants: use a tenant's API token, not the admin token")
    cache: TokenCache = request.app.state.token_cache
    tenant = cache.get(token)
    if tenant is not None:
        bind(tenant=tenant.id)
        return tenant
    generation = cache.generation
    tenant = await authenticate(session, token)
    if tenant is None:
        raise HTTPException(401, "invalid tenant token", headers=_CHALLENGE)
    if tenant.revoked_at is not None:
        raise HTTPException(401, "this tenant has been revoked", headers=_CHALLENGE)
    cache.put(token, tenant, generation=generation)
    bind(tenant=tenant.id)
    return tenant


async def require_admin(token: BearerToken, session: SessionDep, settings: SettingsDep) -> None:
    """Let only the provider's admin token through; say so plainly when a tenant tries."""
    if is_admin_token(token, settings):
        return
    tenant = await authenticate(session, token)
    if tenant is not None and tenant.revoked_at is None:
        raise HTTPException(403, "this route is for the provider's admin: tenant tokens are not accepted")
    raise HTTPException(401, "invalid admin token", headers=_CHALLENGE)


CurrentTenant = Annotated[TokenHolder, Depends(current_tenant)]
AdminDep = Annotated[None, Depends(require_admin)]


@dataclass(frozen=True, slots=True)
class NegotiationCall:
    """What every negotiation route needs: the caller's tenant, a session, the negotiation context and the relay's
    wake-up."""

    tenant: TokenHolder
    session: AsyncSession
    ctx: NegotiationContext
    wake: Callable[[], None]


async def _negotiation_call(request: Request, credentials: Credentials) -> AsyncIterator[NegotiationCall]:
    """One dependency for `NegotiationCall` rather than four (tenant, session, context, wake-up), shared with the
    router's rate limit: FastAPI's solving of dependencies was about a fifth of an offer's CPU in the API, and
    negotiations are its busiest writes (bench/HISTORY.md, "One dependency per negotiation call")."""
    state = request.app.state
    session = state.sessionmaker()
    try:
        tenant = await current_tenant(request, credentials, session)
        yield NegotiationCall(tenant=tenant, session=session, ctx=_context_of(state), wake=_wake_of(state))
    finally:
        await close_session(session)


NegotiationCallDep = Annotated[NegotiationCall, Depends(_negotiation_call)]
