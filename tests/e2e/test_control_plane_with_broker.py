"""The control plane and the broker together, both real: tenants created over REST get working NATS credentials."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from fastapi import FastAPI

from api.app import create_app
from api.migrate import upgrade_async
from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from harmonaize.settings import Settings
from tests.support import Inbox, connect_probe, eventually

pytestmark = pytest.mark.asyncio
ADMIN = {"Authorization": "Bearer e2e-admin-token-0123456789"}


@pytest.fixture
async def api(
    tmp_path: Path, tenant_broker: NatsTenantBroker, provider_secret: bytes
) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(
        _env_file=None,
        data_dir=tmp_path / "hz",
        admin_token="e2e-admin-token-0123456789",
        provider_secret=provider_secret.decode(),
    )
    await upgrade_async(settings)
    app: FastAPI = create_app(settings, broker=tenant_broker)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://hz") as client:
            yield client


async def create_tenant(api: httpx.AsyncClient, tenant: str) -> dict[str, Any]:
    reply = await api.post("/v1/tenants", json={"id": tenant, "display_name": tenant.title()}, headers=ADMIN)
    assert reply.status_code == 201, reply.text
    return reply.json()


async def test_tenant_created_over_rest_at_runtime_consumes_within_2s_and_nobody_is_disconnected(
    api: httpx.AsyncClient, nats_server: NatsServer, tenant_broker: NatsTenantBroker
) -> None:
    acme = await create_tenant(api, "acme")
    acme_headers = {"Authorization": f"Bearer {acme['api_token']}"}
    assert (await api.put("/v1/event-consumers/ctl", json={}, headers=acme_headers)).status_code == 200
    acme_probe = await connect_probe(nats_server.url, acme["nats"]["seed"])
    live = Inbox()
    await acme_probe.client.subscribe("hz.t.acme.>", cb=live.on_message)
    provider_disconnects: list[int] = []

    async def on_provider_disconnect() -> None:
        provider_disconnects.append(1)

    provider = await tenant_broker.provider_connection(disconnected_cb=on_provider_disconnect)

    start = time.monotonic()
    globex = await create_tenant(api, "globex")
    headers = {"Authorization": f"Bearer {globex['api_token']}"}
    consumer = await api.put("/v1/event-consumers/ctl", json={"kinds": ["failure"]}, headers=headers)
    assert consumer.status_code == 200, consumer.text
    view = consumer.json()
    await provider.jetstream().publish("hz.t.globex.events.carbon.j1", b'{"skip": true}')
    await provider.jetstream().publish("hz.t.globex.events.failure.j1", b'{"n": 1}')
    creds = globex["nats"]
    client = await nats.connect(creds["servers"], nkeys_seed_str=creds["seed"])
    sub = await client.jetstream(prefix=view["js_api_prefix"]).pull_subscribe_bind("ctl", stream=view["stream"])
    msgs = await sub.fetch(1, timeout=2.0)
    await msgs[0].ack_sync()
    elapsed = time.monotonic() - start
    assert msgs[0].subject == "hz.t.globex.events.failure.j1", "the consumer's kind filter was applied"
    assert elapsed < 2.0, f"tenant created at runtime took {elapsed:.2f} s to consume its first event"

    await provider.jetstream().publish("hz.t.acme.events.failure.j1", b'{"n": 2}')
    await eventually(lambda: len(live.messages) == 1, what="acme still receiving after globex's reload")
    assert acme_probe.disconnects == 0 and provider_disconnects == []
    await client.close()
    await provider.close()
    await acme_probe.client.close()


async def test_broker_down_means_503_and_no_tenant_left_behind(
    api: httpx.AsyncClient, nats_server: NatsServer
) -> None:
    nats_server.stop()
    reply = await api.post("/v1/tenants", json={"id": "initech", "display_name": "Initech"}, headers=ADMIN)
    assert reply.status_code == 503
    assert reply.json()["reason"]
    assert (await api.get("/v1/tenants/initech", headers=ADMIN)).status_code == 404

    nats_server.start()
    created = await create_tenant(api, "initech")
    client = await nats.connect(nats_server.url, nkeys_seed_str=created["nats"]["seed"])
    assert client.is_connected
    await client.close()


async def test_event_consumer_ack_wait_is_the_tenants_choice_within_bounds(
    api: httpx.AsyncClient, tenant_broker: NatsTenantBroker
) -> None:
    acme = await create_tenant(api, "acme")
    headers = {"Authorization": f"Bearer {acme['api_token']}"}
    assert (await api.put("/v1/event-consumers/ctl", json={}, headers=headers)).json()["ack_wait_s"] == 30.0
    quick = await api.put("/v1/event-consumers/ctl", json={"ack_wait_s": 2.5}, headers=headers)
    assert quick.status_code == 200 and quick.json()["ack_wait_s"] == 2.5
    provider = await tenant_broker.provider_connection()
    info = await provider.jetstream().consumer_info("HZ_T_acme", "ctl")
    assert info.config.ack_wait == 2.5, "the broker's consumer was updated in place"
    await provider.close()
    for bad in (0, 0.5, 601, "soon"):
        refused = await api.put("/v1/event-consumers/ctl", json={"ack_wait_s": bad}, headers=headers)
        assert refused.status_code == 422 and refused.json()["errors"][0]["field"] == "body.ack_wait_s", refused.text


async def test_event_consumer_position_and_start_are_the_tenants_choice_and_checked(
    api: httpx.AsyncClient, tenant_broker: NatsTenantBroker
) -> None:
    """Through the REST API: a reader-kept consumer is created in the broker's memory, from the sequence asked for;
    a bad position or start is refused with the field named, and the consumer is left as it was."""
    acme = await create_tenant(api, "acme")
    headers = {"Authorization": f"Bearer {acme['api_token']}"}
    plain = (await api.put("/v1/event-consumers/ctl", json={}, headers=headers)).json()
    assert plain["position"] == "broker" and plain["stream_created"]
    body = {"position": "reader", "start_after": 41, "stream_created": plain["stream_created"]}
    reader = await api.put("/v1/event-consumers/mine", json=body, headers=headers)
    assert reader.status_code == 200 and reader.json()["position"] == "reader", reader.text
    provider = await tenant_broker.provider_connection()
    info = await provider.jetstream().consumer_info("HZ_T_acme", "mine")
    assert info.config.mem_storage and info.config.opt_start_seq == 42
    bad_values = (("position", "disk"), ("start_after", -1), ("start_after", "soon"), ("stream_created", "x" * 65))
    for field, bad in bad_values:
        refused = await api.put("/v1/event-consumers/mine", json={**body, field: bad}, headers=headers)
        assert refused.status_code == 422 and refused.json()["errors"][0]["field"] == f"body.{field}", refused.text
    assert (await provider.jetstream().consumer_info("HZ_T_acme", "mine")).config == info.config
    await provider.close()
