"""Tenant isolation at the broker: acme can read and ack its own slice and nothing else.

A forbidden subscribe or publish does not raise in nats-py; the server reports it asynchronously. Each attack asserts
both: the violation reported through `error_cb`, and exact delivered counts.
"""

from __future__ import annotations

import json

import nats.errors
import pytest
from nats.js.api import ConsumerConfig

from broker_config.accounts import UserKeys
from broker_config.provisioner import NatsTenantBroker
from broker_config.render import TENANT_JS_PREFIX
from broker_config.server import NatsServer
from tests.support import Inbox, connect_probe, eventually

pytestmark = pytest.mark.asyncio


async def publish_events(broker: NatsTenantBroker, tenant: str, count: int, *, job: str = "j1") -> None:
    provider = await broker.provider_connection()
    js = provider.jetstream()
    for i in range(count):
        await js.publish(f"hz.t.{tenant}.events.failure.{job}", json.dumps({"n": i}).encode())
    await provider.close()


async def test_acme_subscriptions_outside_its_slice_are_refused_and_receive_nothing(
    nats_server: NatsServer, tenant_broker: NatsTenantBroker, two_tenants: dict[str, UserKeys]
) -> None:
    acme = await connect_probe(nats_server.url, two_tenants["acme"].seed)
    everything, globex_slice, own_slice = Inbox(), Inbox(), Inbox()
    await acme.client.subscribe(">", cb=everything.on_message)
    await acme.client.subscribe("hz.t.globex.>", cb=globex_slice.on_message)
    await acme.client.subscribe("hz.p.>", cb=everything.on_message)
    await acme.client.subscribe("$SYS.>", cb=everything.on_message)
    await acme.client.subscribe("hz.t.acme.>", cb=own_slice.on_message)
    await acme.client.flush()
    await eventually(lambda: len(acme.violations("subscription")) == 4, what="4 subscription violations")

    await publish_events(tenant_broker, "globex", 7)
    await publish_events(tenant_broker, "acme", 3)
    await eventually(lambda: len(own_slice.messages) == 3, what="acme's own 3 events")
    # A marker published after everything else: once it arrives, nothing earlier is still in flight.
    await publish_events(tenant_broker, "acme", 1, job="marker")
    await eventually(lambda: len(own_slice.messages) == 4, what="marker")

    assert everything.messages == []
    assert globex_slice.messages == []
    assert all(s.startswith("hz.t.acme.") for s in own_slice.subjects)
    assert set(acme.violations()) >= {
        'nats: permissions violation for subscription to ">"',
        'nats: permissions violation for subscription to "hz.t.globex.>"',
    }
    await acme.client.close()


async def test_acme_cannot_create_or_read_jetstream_consumers_on_globex_events(
    nats_server: NatsServer, tenant_broker: NatsTenantBroker, two_tenants: dict[str, UserKeys]
) -> None:
    await tenant_broker.ensure_consumer("globex", "ctl")
    await publish_events(tenant_broker, "globex", 5)
    acme = await connect_probe(nats_server.url, two_tenants["acme"].seed)
    attempts = 0
    for prefix in ("$JS.API", TENANT_JS_PREFIX):
        js = acme.client.jetstream(prefix=prefix, timeout=0.5)
        for stream, filt in (("HZ_T_globex", "hz.t.globex.>"), ("HZ_T_acme", "hz.t.globex.>"),
                             ("HZ_T_acme", "hz.t.acme.>")):
            with pytest.raises(nats.errors.TimeoutError):
                await js.add_consumer(stream, ConsumerConfig(durable_name="spy", filter_subject=filt))
            attempts += 1
        received: list[bytes] = []
        spy = await js.pull_subscribe_bind("ctl", stream="HZ_T_globex")
        with pytest.raises(nats.errors.TimeoutError):
            for msg in await spy.fetch(5, timeout=0.5):
                received.append(msg.data)
        attempts += 1
        assert received == []
    await eventually(lambda: len(acme.violations("publish")) >= attempts, what="a violation per consumer attempt")

    for request in ("$JS.API.STREAM.LIST", "$JS.API.STREAM.DELETE.HZ_T_acme", "$JS.API.STREAM.PURGE.HZ_T_globex",
                    "$JS.API.STREAM.CREATE.KV_spy", "$KV.placements.x", "$SYS.REQ.SERVER.PING"):
        with pytest.raises(nats.errors.TimeoutError):
            await acme.client.request(request, b"{}", timeout=0.5)
    await eventually(lambda: len(acme.violations("publish")) >= attempts + 6, what="violations for the JS/KV/SYS API")

    provider = await tenant_broker.provider_connection()
    info = await provider.jetstream().consumer_info("HZ_T_globex", "ctl")
    assert info.num_pending == 5 and info.delivered.stream_seq == 0, "globex's consumer was not touched"
    assert [c.name for c in await provider.jetstream().consumers_info("HZ_T_acme")] == []
    assert [c.name for c in await provider.jetstream().consumers_info("HZ_T_globex")] == ["ctl"]
    await provider.close()
    await acme.client.close()


async def test_acme_cannot_publish_into_any_hz_subject_or_ack_for_globex(
    nats_server: NatsServer, tenant_broker: NatsTenantBroker, two_tenants: dict[str, UserKeys]
) -> None:
    provider = await tenant_broker.provider_connection()
    watched = Inbox()
    await provider.subscribe("hz.>", cb=watched.on_message)
    await provider.flush()
    acme = await connect_probe(nats_server.url, two_tenants["acme"].seed)

    forged = ["hz.t.globex.events.failure.j1", "hz.t.acme.events.failure.j1", "hz.p.hosts.h1.commands",
              "$JS.ACK.HZ_T_globex.ctl.1.1.1.0.0"]
    for subject in forged:
        await acme.client.publish(subject, b'{"forged": true}')
    await acme.client.flush()
    await eventually(lambda: len(acme.violations("publish")) == len(forged), what="a violation per forged publish")

    stream = await provider.jetstream().stream_info("HZ_T_globex")
    assert stream.state.messages == 0
    stream = await provider.jetstream().stream_info("HZ_T_acme")
    assert stream.state.messages == 0
    assert watched.messages == []
    await provider.close()
    await acme.client.close()


async def test_acme_reads_and_acks_its_own_slice(
    nats_server: NatsServer, tenant_broker: NatsTenantBroker, two_tenants: dict[str, UserKeys]
) -> None:
    await tenant_broker.ensure_consumer("acme", "ctl")
    await publish_events(tenant_broker, "acme", 4)
    await publish_events(tenant_broker, "globex", 4)
    acme = await connect_probe(nats_server.url, two_tenants["acme"].seed)
    sub = await acme.client.jetstream(prefix=TENANT_JS_PREFIX).pull_subscribe_bind("ctl", stream="HZ_T_acme")
    msgs = await sub.fetch(10, timeout=1.0)
    assert [json.loads(m.data)["n"] for m in msgs] == [0, 1, 2, 3]
    for m in msgs:
        await m.ack_sync()
    provider = await tenant_broker.provider_connection()
    info = await provider.jetstream().consumer_info("HZ_T_acme", "ctl")
    assert info.ack_floor.stream_seq == 4 and info.num_ack_pending == 0
    assert acme.errors == []
    await provider.close()
    await acme.client.close()
