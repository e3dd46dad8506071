"""Negotiation outcomes reach the broker: real API (SQLite), real nats-server, real NatsProviderBus.

After an acceptance, the tenant's stream holds the NegotiationUpdate CloudEvents (a provider-side reader and the
tenant's own consumer both see them) and the desired-state KV bucket holds the host's new assignment. With the broker
down, decisions still commit; once it is back, a relay (even a new process's) delivers every row, and a message
published twice (crash between publish and mark) is stored once, thanks to `Nats-Msg-Id`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from fastapi import FastAPI
from nats.js.api import ConsumerConfig, DeliverPolicy, StorageType
from sqlalchemy import func, select

from api.app import create_app
from api.migrate import upgrade_async
from api.models import OutboxMessage
from api.options import NegotiationOptions
from broker_config.provider_bus import NatsProviderBus
from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from harmonaize.desired_state import DESIRED_STATE_BUCKET, HostAssignment
from harmonaize.events import NegotiationUpdate, parse_event_as
from harmonaize.settings import Settings
from tests.support import eventually

ADMIN_TOKEN = "e2e-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
FAST = NegotiationOptions(relay_poll_interval_s=0.05, relay_backoff_max_s=0.3, sweep_interval_s=3600.0)


@pytest.fixture
async def settings(tmp_path: Path, provider_secret: bytes) -> Settings:
    settings = Settings(
        _env_file=None, data_dir=tmp_path / "hz", admin_token=ADMIN_TOKEN, provider_secret=provider_secret.decode()
    )
    await upgrade_async(settings)
    return settings


@asynccontextmanager
async def running(
    settings: Settings, broker: NatsTenantBroker, bus: NatsProviderBus | None
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    app = create_app(settings, broker=broker, bus=bus, negotiation=FAST)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://hz") as client:
            yield app, client


async def nothing_pending(app: FastAPI) -> bool:
    """Every outbox row delivered (capacity events from the sweeper included, whenever it ran)."""
    async with app.state.sessionmaker() as session:
        pending = await session.scalar(
            select(func.count()).select_from(OutboxMessage).where(OutboxMessage.delivered_at.is_(None)))
    return pending == 0 and app.state.relay.delivered >= 4


async def post(client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    reply = await client.post(path, json=body, headers=headers)
    assert reply.status_code in (200, 201), reply.text
    return reply.json()


async def demo_world(client: httpx.AsyncClient) -> tuple[dict[str, Any], dict[str, str]]:
    """Tenant acme with a 1-4 worker job on 2 of host h1's 3 GPUs."""
    acme = await post(client, "/v1/tenants", {"id": "acme", "display_name": "Acme"}, ADMIN)
    headers = {"Authorization": f"Bearer {acme['api_token']}"}
    await post(client, "/v1/hosts", {"id": "h1", "gpus": 3, "locality_group": "rack-a"}, ADMIN)
    await post(client, "/v1/jobs", {"id": "train", "min_workers": 1, "max_workers": 4, "initial_workers": 2}, headers)
    return acme, headers


async def scale_to_three(client: httpx.AsyncClient, headers: dict[str, str], key: str) -> dict[str, Any]:
    body = {"job": "train", "kind": "scale", "terms": {"desired_workers": 4, "accept_workers": {"min": 2, "max": 4}}}
    offer = await post(client, "/v1/negotiations", body, {**headers, "Idempotency-Key": key})
    assert offer["offer"]["options"][0]["workers"] == 3
    return await post(client, f"/v1/negotiations/{offer['id']}/accept", {"option": 0}, headers)


async def stream_events(broker: NatsTenantBroker, subject: str) -> list[Any]:
    """Every message stored on `subject` in acme's stream, read by the provider with an ephemeral consumer."""
    provider = await broker.provider_connection()
    try:
        js = provider.jetstream()
        info = await js.stream_info("HZ_T_acme")
        if info.state.messages == 0:
            return []
        sub = await js.pull_subscribe(
            subject, stream="HZ_T_acme", config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        )
        messages = await sub.fetch(info.state.messages, timeout=2.0)
        await sub.unsubscribe()
        return [parse_event_as(msg.data, NegotiationUpdate) for msg in messages]
    finally:
        await provider.close()


async def desired(broker: NatsTenantBroker, key: str) -> HostAssignment:
    """The key's current value; checks the bucket is what agents expect (file storage, history of at least 5)."""
    provider = await broker.provider_connection()
    try:
        js = provider.jetstream()
        bucket = await js.key_value(DESIRED_STATE_BUCKET)
        assert (await bucket.status()).history >= 5
        assert (await js.stream_info(f"KV_{DESIRED_STATE_BUCKET}")).config.storage == StorageType.FILE
        entry = await bucket.get(key)
        assert entry.value is not None
        return HostAssignment.model_validate_json(entry.value)
    finally:
        await provider.close()


async def test_acceptance_reaches_the_tenants_stream_and_the_desired_state_bucket(
    settings: Settings, tenant_broker: NatsTenantBroker, nats_server: NatsServer, provider_secret: bytes
) -> None:
    bus = NatsProviderBus([nats_server.url], provider_secret=provider_secret, connect_timeout=1.0)
    try:
        async with running(settings, tenant_broker, bus) as (app, client):
            acme, headers = await demo_world(client)
            consumer = await client.put("/v1/event-consumers/ctl", json={"kinds": ["negotiation"]}, headers=headers)
            assert consumer.status_code == 200, consumer.text
            accepted = await scale_to_three(client, headers, "k1")
            await eventually(lambda: nothing_pending(app), what="all outbox rows delivered")

        events = await stream_events(tenant_broker, "hz.t.acme.events.negotiation.train")
        assert [(e.data.state, e.data.round) for e in events] == [("offered", 1), ("accepted", 1)]
        assert events[-1].data.negotiation_id == accepted["id"] and events[-1].data.accepted_option.workers == 3
        assignment = await desired(tenant_broker, "host.h1")
        assert (assignment.generation, assignment.jobs[0].job, assignment.jobs[0].workers) == (2, "train", 3)

        tenant = await nats.connect(nats_server.url, nkeys_seed_str=acme["nats"]["seed"])
        try:
            view = consumer.json()
            sub = await tenant.jetstream(prefix=view["js_api_prefix"]).pull_subscribe_bind("ctl", stream=view["stream"])
            received = await sub.fetch(2, timeout=2.0)
            assert [parse_event_as(m.data, NegotiationUpdate).id for m in received] == [e.id for e in events]
        finally:
            await tenant.close()
    finally:
        await bus.close()


class CrashAfterPublish(NatsProviderBus):
    """Publishes, then fails as if the process died before marking the row delivered (the first `crashes` times)."""

    def __init__(self, *args: Any, crashes: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.crashes = crashes

    async def publish_event(self, subject: str, payload: bytes, msg_id: str) -> None:
        await super().publish_event(subject, payload, msg_id)
        if self.crashes:
            self.crashes -= 1
            raise ConnectionError("crashed after publishing")


async def test_decisions_taken_while_the_broker_is_down_are_delivered_once_by_the_next_relay(
    settings: Settings, tenant_broker: NatsTenantBroker, nats_server: NatsServer, provider_secret: bytes
) -> None:
    first_bus = NatsProviderBus([nats_server.url], provider_secret=provider_secret, connect_timeout=0.5,
                                ack_timeout=0.5)
    async with running(settings, tenant_broker, first_bus) as (app, client):
        _, headers = await demo_world(client)
        await eventually(lambda: app.state.relay.delivered >= 1, what="the initial placement delivered")
        nats_server.stop()
        await scale_to_three(client, headers, "while-down")
        await eventually(lambda: app.state.relay.failures >= 1, what="the relay noticing the broker is gone")
    await first_bus.close()

    nats_server.start()
    second_bus = CrashAfterPublish(
        [nats_server.url], provider_secret=provider_secret, connect_timeout=1.0, crashes=2
    )
    try:
        async with running(settings, tenant_broker, second_bus) as (app, _client):
            # >=: the second app adds the job's first capacity event (a newer row); exactly-once: the stream, below
            await eventually(lambda: app.state.relay.delivered >= 3, timeout=10.0, what="rows left by the first app")
            assert app.state.relay.failures == 2
    finally:
        await second_bus.close()

    events = await stream_events(tenant_broker, "hz.t.acme.events.negotiation.train")
    assert [e.data.state for e in events] == ["offered", "accepted"], "published 2x each, stored once each"
    assert len({e.id for e in events}) == 2
    assignment = await desired(tenant_broker, "host.h1")
    assert (assignment.generation, assignment.jobs[0].workers) == (2, 3)


async def test_the_running_relay_reconnects_when_the_broker_comes_back(
    settings: Settings, tenant_broker: NatsTenantBroker, nats_server: NatsServer, provider_secret: bytes
) -> None:
    bus = NatsProviderBus([nats_server.url], provider_secret=provider_secret, connect_timeout=0.5, ack_timeout=0.5)
    try:
        async with running(settings, tenant_broker, bus) as (app, client):
            _, headers = await demo_world(client)
            await eventually(lambda: app.state.relay.delivered >= 1, what="the initial placement delivered")
            nats_server.stop()
            await scale_to_three(client, headers, "bounce")
            await eventually(lambda: app.state.relay.failures >= 1, what="the relay noticing the broker is gone")
            nats_server.start()
            await eventually(lambda: app.state.relay.delivered >= 4, timeout=10.0, what="delivery after the restart")
    finally:
        await bus.close()
    assert [e.data.state for e in await stream_events(tenant_broker, "hz.t.acme.events.negotiation.train")] == [
        "offered", "accepted"
    ]
    assert (await desired(tenant_broker, "host.h1")).jobs[0].workers == 3
