"""The console tests' world: a real nats-server, the real API (SQLite, migrated; outbox relayed to the broker) served
by uvicorn on a free port, two tenants with a job each, and the provider's connection to publish tenant events the
way host agents do."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from nats.aio.client import Client

from api.app import create_app
from api.migrate import upgrade_async
from api.serving import serve_api
from broker_config.provider_bus import NatsProviderBus
from broker_config.provisioner import NatsTenantBroker
from harmonaize.events import CarbonIntensity, EventData, agent_source, make_event
from harmonaize.settings import Settings
from harmonaize.subjects import tenant_event_subject

ADMIN_TOKEN = "console-admin-token-0123456789abcdef"
TENANTS = {"acme": "acme-train", "globex": "globex-train"}
"""Each tenant and its job."""


@dataclass
class ConsoleCloud:
    app: FastAPI
    url: str
    admin: httpx.AsyncClient
    tokens: dict[str, str]
    provider: Client

    def headers(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[tenant]}"}

    async def publish(self, tenant: str, job: str, data: EventData) -> str:
        """Publish `data` about `job` into `tenant`'s stream as an agent does (acknowledged); the CloudEvent id."""
        event = make_event(data, source=agent_source("h-0123456789abcdef"), subject=job)
        subject = tenant_event_subject(tenant, data.KIND, job)
        headers = {"Nats-Msg-Id": event.id, "Content-Type": "application/cloudevents+json"}
        await self.provider.jetstream().publish(subject, event.to_json_bytes(), headers=headers, timeout=5.0)
        return event.id

    async def report_progress(self, tenant: str, job: str, *, epoch: int, step: int, world_size: int,
                              plan: str = "ddp", loss: float | None = None) -> None:
        """What a node launcher relays from the job's rank 0."""
        body: dict[str, Any] = {
            "tenant": tenant, "job": job, "epoch": epoch, "step": step, "world_size": world_size,
            "parallel_plan": plan, "loss": loss, "samples_per_s": 900.0 * world_size,
            "checkpoint_interval_steps": 100, "batch_size": 32, "updated_at": datetime.now(UTC).isoformat(),
        }
        reply = await self.admin.post("/v1/provider/progress", json=body)
        assert reply.status_code == 202, reply.text


def carbon(g_per_kwh: float) -> CarbonIntensity:
    return CarbonIntensity(region="DE", g_per_kwh=g_per_kwh, observed_at=datetime.now(UTC))


@asynccontextmanager
async def console_cloud(
    data_dir: Path, *, nats_url: str, tenant_broker: NatsTenantBroker, provider_secret: bytes
) -> AsyncIterator[ConsoleCloud]:
    settings = Settings(
        _env_file=None, data_dir=data_dir, admin_token=ADMIN_TOKEN, provider_secret=provider_secret.decode(),
        nats_url=nats_url,
    )
    await upgrade_async(settings)
    bus = NatsProviderBus([nats_url], provider_secret=provider_secret)
    app = create_app(settings, broker=tenant_broker, bus=bus)
    serving = await serve_api(app, host="127.0.0.1", port=0)
    url = f"http://127.0.0.1:{serving.port}"
    try:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                                     timeout=30) as admin:
            for host, group in (("h1", "g1"), ("h2", "g1"), ("h3", "g2")):
                reply = await admin.post("/v1/hosts", json={"id": host, "gpus": 4, "locality_group": group})
                assert reply.status_code == 201, reply.text
            tokens: dict[str, str] = {}
            for tenant, job in TENANTS.items():
                reply = await admin.post("/v1/tenants", json={"id": tenant, "display_name": tenant.title()})
                assert reply.status_code == 201, reply.text
                tokens[tenant] = reply.json()["api_token"]
                reply = await admin.post(
                    "/v1/jobs", json={"id": job, "min_workers": 1, "max_workers": 4, "gpus_per_worker": 2,
                                      "initial_workers": 2},
                    headers={"Authorization": f"Bearer {tokens[tenant]}"},
                )
                assert reply.status_code == 201, reply.text
            provider = await tenant_broker.provider_connection(max_reconnect_attempts=-1, reconnect_time_wait=0.2)
            try:
                yield ConsoleCloud(app=app, url=url, admin=admin, tokens=tokens, provider=provider)
            finally:
                await provider.close()
    finally:
        await asyncio.wait_for(serving.stop(), 60)
        await bus.close()
