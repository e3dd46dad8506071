"""Serving the control plane for real: the app wired to the provider's broker (tenant accounts, the provider bus) and
served by uvicorn inside the caller's event loop.

One place for it, used by `harmonaize api serve` and by the local cloud, so both run the same assembly: the tenant
broker provisions accounts into the accounts file nats-server includes and reloads it (`reload`), the provider bus
carries the outbox to JetStream, and uvicorn serves in a task of the current loop, which is the one the process chose
(`harmonaize.event_loop`).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from api.app import create_app
from api.options import NegotiationOptions
from broker_config.provider_bus import NatsProviderBus
from broker_config.provisioner import NatsTenantBroker
from broker_config.reload import SystemAccountReload
from harmonaize.settings import Settings

__all__ = ["ApiStartError", "ProviderApi", "ServingApi", "provider_api", "serve_api"]


class ApiStartError(RuntimeError):
    """The API stopped while it was starting (uvicorn has already logged why)."""


@dataclass
class ProviderApi:
    """The app and the provider bus it publishes through; `aclose` after the server stopped."""

    app: FastAPI
    bus: NatsProviderBus

    async def aclose(self) -> None:
        await self.bus.close()


def provider_api(
    settings: Settings,
    *,
    servers: Sequence[str],
    secret: bytes,
    accounts_file: Path,
    reload: Callable[[], None] | SystemAccountReload,
    negotiation: NegotiationOptions,
    replicas: int = 1,
) -> ProviderApi:
    """The control plane of a provider whose broker is at `servers` (tenants provisioned into `accounts_file`)."""
    broker = NatsTenantBroker(
        servers=list(servers), provider_secret=secret, accounts_file=accounts_file, reload=reload, replicas=replicas,
        stream_max_bytes=settings.tenant_stream_max_bytes,
    )
    bus = NatsProviderBus(list(servers), provider_secret=secret, replicas=replicas)  # connects when the app starts
    return ProviderApi(app=create_app(settings, broker=broker, bus=bus, negotiation=negotiation), bus=bus)


GRACEFUL_SHUTDOWN_S = 10
"""How long a stop waits for requests in flight before cancelling them (uvicorn's default waits for ever, so one
request stuck on a peer that is gone would hold the stop, and the outbox relay with it)."""


@dataclass
class ServingApi:
    """An ASGI app served by uvicorn in a task of the current loop, on the port it actually bound."""

    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int

    async def stop(self) -> None:
        """End open event streams first (else the graceful shutdown waits its full window for them), then stop."""
        feed = getattr(getattr(self.server.config.app, "state", None), "event_feed", None)
        if feed is not None:
            await feed.close()
        self.server.should_exit = True
        await self.task


async def serve_api(
    app: FastAPI, *, host: str, port: int, log_level: str = "warning", listener: socket.socket | None = None
) -> ServingApi:
    """Start serving `app` (port 0: any free port; or on `listener`, a socket bound by a parent that several replicas
    accept on) and return once it accepts connections."""
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=host, port=port, log_level=log_level, lifespan="on",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    )
    sockets = None if listener is None else [listener]
    task = asyncio.create_task(server.serve(sockets=sockets), name="hz-api")
    while not server.started:
        if task.done():
            task.result()
            raise ApiStartError("the API stopped during start-up (see the messages above)")
        await asyncio.sleep(0.01)
    return ServingApi(server, task, server.servers[0].sockets[0].getsockname()[1])
