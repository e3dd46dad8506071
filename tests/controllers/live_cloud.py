"""The real tier's world: a real nats-server with our broker config, the real API served by uvicorn on a free port
(so a controller in another process can reach it), one tenant created over REST, and the provider's connection to
publish that tenant's events the way provider agents do (`js.publish` with `Nats-Msg-Id` = CloudEvent id).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from nats.aio.client import Client
from nats.js.api import ConsumerInfo

from api.app import create_app
from api.migrate import upgrade_async
from api.serving import serve_api
from broker_config.provider_bus import NatsProviderBus
from broker_config.provisioner import NatsTenantBroker
from broker_config.render import tenant_stream_name
from broker_config.server import NatsServer
from harmonaize.events import CloudEvent
from harmonaize.settings import Settings
from harmonaize.subjects import tenant_event_subject

ADMIN_TOKEN = "controllers-admin-token-0123456789"
TENANT = "acme"
JOB = "llm-finetune"


@dataclass
class LiveCloud:
    api_url: str
    nats_url: str
    nats_server: NatsServer
    admin: httpx.AsyncClient
    tenant_client: httpx.AsyncClient
    provider: Client
    token: str
    seed: str
    tenant: str = TENANT
    published: list[str] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment a controller process gets: the tenant's credentials and nothing of the developer's."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("HZ_")}
        return {
            **base,
            "HZ_TENANT": self.tenant,
            "HZ_TENANT_TOKEN": self.token,
            "HZ_TENANT_NATS_SEED": self.seed,
            "HZ_NATS_URL": self.nats_url,
            "HZ_API_URL": self.api_url,
            **extra,
        }

    async def publish(self, event: CloudEvent[Any], *, msg_id: str | None = None) -> None:
        """Publish as the provider; retried until the stream acknowledges it (core publishes can be lost:
        docs/building-blocks.md)."""
        subject = tenant_event_subject(self.tenant, event.data.KIND, event.subject)
        headers = {"Nats-Msg-Id": msg_id or event.id, "Content-Type": "application/cloudevents+json"}
        for _ in range(200):
            try:
                await self.provider.jetstream().publish(subject, event.to_json_bytes(), headers=headers, timeout=1.0)
                self.published.append(event.id)
                return
            except Exception:  # reconnecting after a broker restart
                await asyncio.sleep(0.05)
        raise AssertionError(f"could not publish {event.id} within 10 s")

    async def consumer_info(self, name: str) -> ConsumerInfo:
        return await self.provider.jetstream().consumer_info(tenant_stream_name(self.tenant), name)

    async def create_job(
        self, job_id: str = JOB, *, min_workers: int = 1, max_workers: int = 4, initial_workers: int | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"id": job_id, "min_workers": min_workers, "max_workers": max_workers}
        if initial_workers is not None:
            body["initial_workers"] = initial_workers
        reply = await self.tenant_client.post("/v1/jobs", json=body)
        assert reply.status_code == 201, reply.text
        return dict(reply.json())

    async def add_host(self, host_id: str, *, gpus: int, group: str) -> None:
        reply = await self.admin.post("/v1/hosts", json={"id": host_id, "gpus": gpus, "locality_group": group})
        assert reply.status_code == 201, reply.text

    async def negotiations(self, **params: str) -> list[dict[str, Any]]:
        reply = await self.tenant_client.get("/v1/negotiations", params=params)
        assert reply.status_code == 200, reply.text
        return list(reply.json()["items"])


@asynccontextmanager
async def live_cloud(
    data_dir: Path,
    *,
    nats_server: NatsServer,
    tenant_broker: NatsTenantBroker,
    provider_secret: bytes,
    relay: bool = False,
    **app_options: Any,
) -> AsyncIterator[LiveCloud]:
    """`app_options` go to `create_app` (e.g. the negotiation options of the provider under test). `relay`: the API
    publishes its outbox to the broker (its own events, such as capacity, reach the tenant); otherwise only what a
    test publishes does."""
    settings = Settings(
        _env_file=None,
        data_dir=data_dir,
        admin_token=ADMIN_TOKEN,
        provider_secret=provider_secret.decode(),
        nats_url=nats_server.url,
    )
    await upgrade_async(settings)
    bus = NatsProviderBus([nats_server.url], provider_secret=provider_secret) if relay else None
    app = create_app(settings, broker=tenant_broker, bus=bus, **app_options)
    serving = await serve_api(app, host="127.0.0.1", port=0)
    try:
        api_url = f"http://127.0.0.1:{serving.port}"
        async with httpx.AsyncClient(
            base_url=api_url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
        ) as admin:
            created = await admin.post("/v1/tenants", json={"id": TENANT, "display_name": "Acme"})
            assert created.status_code == 201, created.text
            body = created.json()
            async with httpx.AsyncClient(
                base_url=api_url, headers={"Authorization": f"Bearer {body['api_token']}"}, timeout=30
            ) as tenant_client:
                provider = await tenant_broker.provider_connection(max_reconnect_attempts=-1, reconnect_time_wait=0.2)
                try:
                    yield LiveCloud(
                        api_url=api_url,
                        nats_url=nats_server.url,
                        nats_server=nats_server,
                        admin=admin,
                        tenant_client=tenant_client,
                        provider=provider,
                        token=body["api_token"],
                        seed=body["nats"]["seed"],
                    )
                finally:
                    await provider.close()
    finally:
        await serving.stop()
        if bus is not None:
            await bus.close()
