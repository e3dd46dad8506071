"""The app factory: `create_app(settings, broker=...)` builds one control-plane API, with no import-time state.

Everything an app needs is passed in (settings, the broker port) or made in its lifespan (engine, sessionmaker), and
kept on `app.state`, so any number of differently-configured apps can live in one process (tests do exactly that).

Start-up order matters:
1. refuse to start unless the schema is at the Alembic head (the schema comes only from migrations; the message
   names `harmonaize db upgrade`);
2. reconcile the broker with the registry (`broker.apply(all active tenants)`), so a broker that restarted empty, or
   missed an apply, serves exactly the tenants the database knows before the first request arrives;
3. start the background tasks: the negotiation sweeper (expiry, reservations that start) and, given a `bus`, the
   outbox relay, which first delivers whatever a previous process committed but did not publish. Without a bus the
   outbox only accumulates (tests of the API alone, tools that must not publish).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api.console import install_console
from api.db import make_engine, make_sessionmaker
from api.errors import install_error_handlers
from api.limits import ApiLimits, install_limits
from api.migrate import check_schema_current
from api.observability import install_observability
from api.options import NegotiationOptions, NegotiationRuntime
from api.routes import build_router
from api.services.event_feed import TenantEventFeed
from api.services.outbox_relay import OutboxRelay
from api.services.relay_leadership import RelayLeadership
from api.services.sweeper import run_sweeper
from api.services.tenants import TenantRegistry
from api.services.token_cache import TokenCache
from api.shared_buckets import SharedBuckets
from broker_config.accounts import TenantBroker
from broker_config.provider_bus import ProviderBus
from harmonaize import __version__
from harmonaize.settings import Settings
from harmonaize.waits import cancel_and_wait


class ConfigurationError(ValueError):
    """The settings lack something the API cannot run without."""


def _pseudonym_secret(settings: Settings) -> bytes:
    if settings.admin_token is None or not settings.admin_token.get_secret_value():
        raise ConfigurationError("HZ_ADMIN_TOKEN is not set: the API needs it to authenticate the provider's admin")
    if settings.provider_secret is None or not settings.provider_secret.get_secret_value():
        raise ConfigurationError(
            "HZ_PROVIDER_SECRET is not set: the API derives per-tenant host pseudonyms from it "
            "(keep it stable across restarts, or tenants see their hosts renamed)"
        )
    return settings.provider_secret.get_secret_value().encode()


def create_app(
    settings: Settings,
    *,
    broker: TenantBroker,
    bus: ProviderBus | None = None,
    negotiation: NegotiationOptions | None = None,
) -> FastAPI:
    """Build the control-plane API; the database, broker and bus are touched only when its lifespan starts.

    The bus belongs to the caller (who closes it); the app only publishes through it while running.
    """
    secret = _pseudonym_secret(settings)
    token_cache = TokenCache(settings.api_token_cache_s)
    registry = TenantRegistry(broker, on_revoked=token_cache.forget_tenant)
    runtime = NegotiationRuntime.resolve(negotiation or NegotiationOptions())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_engine(settings.resolved_database_url, ping_after_idle_s=settings.database_ping_after_idle_s)
        tasks: list[asyncio.Task[None]] = []
        app.state.event_feed = TenantEventFeed(settings.nats_url.split(","), provider_secret=secret)
        try:
            await check_schema_current(engine)
            sessionmaker = make_sessionmaker(engine)
            async with sessionmaker() as session:
                await registry.reconcile(session)
            app.state.engine = engine
            app.state.sessionmaker = sessionmaker
            app.state.shared_buckets = SharedBuckets(engine.url) if engine.dialect.name == "postgresql" else None
            relay = None if bus is None else OutboxRelay(
                sessionmaker,
                bus,
                poll_interval=runtime.relay_poll_interval_s,
                backoff_max=runtime.relay_backoff_max_s,
                clock=runtime.clock,
                leadership=RelayLeadership(engine),
            )
            app.state.relay = relay
            wake = relay.wake if relay is not None else (lambda: None)
            if relay is not None:
                tasks.append(asyncio.create_task(relay.run(), name="hz-outbox-relay"))
            tasks.append(
                asyncio.create_task(
                    run_sweeper(sessionmaker, clock=runtime.clock, interval=runtime.sweep_interval_s,
                                secret=secret, on_change=wake),
                    name="hz-negotiation-sweeper",
                )
            )
            yield
        finally:
            await app.state.event_feed.close()  # ends every open event stream
            await cancel_and_wait(tasks)
            if getattr(app.state, "shared_buckets", None) is not None:
                await app.state.shared_buckets.aclose()
            await engine.dispose()

    app = FastAPI(title="HarmonAIze control plane", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.registry = registry
    app.state.broker = broker
    app.state.pseudonym_secret = secret
    app.state.token_cache = token_cache
    app.state.negotiation = runtime
    app.state.relay = None
    install_error_handlers(app)
    install_limits(app, ApiLimits.from_settings(settings))
    install_observability(app)
    app.include_router(build_router())
    install_console(app)
    return app
