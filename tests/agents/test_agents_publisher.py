"""The publisher: retries until the PubAck, dedup header, order, back-pressure; and a real broker restart."""

from __future__ import annotations

import asyncio
import json

import pytest
from nats.js.errors import BadRequestError

from broker_config.accounts import UserKeys
from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from harmonaize.events import CloudEvent, Failure, FailureKind, Severity, agent_source, make_event
from harmonaize.subjects import tenant_event_subject
from provider_agents.publisher import Backoff, CoreSink, JetStreamPublisher
from provider_agents.runtime import connect_provider
from tests.agents.conftest import stored_messages, tenant_reader
from tests.agents.fakes import START, FlakyJetStream
from tests.support import eventually

FAST = Backoff(initial_s=0.001, max_s=0.01)
SUBJECT = tenant_event_subject("acme", "failure", "train")


def _event(n: int = 0) -> CloudEvent[Failure]:
    data = Failure(
        kind=FailureKind.GPU_ERROR,
        host="h-0123456789abcdef",
        gpu_index=n % 64,
        detected_at=START,
        severity=Severity.CRITICAL,
    )
    return make_event(data, source=agent_source("h-0123456789abcdef"), subject="train")


async def test_retries_until_acknowledged_with_the_event_id_as_dedup_key() -> None:
    js = FlakyJetStream(failures=3)
    publisher = JetStreamPublisher(js, backoff=FAST)
    publisher.start()
    event = _event()
    await publisher.submit(SUBJECT, event)
    assert await publisher.drain(2.0)
    await publisher.close()
    assert len(js.attempts) == 4 and publisher.retries == 3 and publisher.published == 1
    assert {headers["Nats-Msg-Id"] for _, _, headers in js.attempts} == {event.id}  # type: ignore[index]
    assert json.loads(js.stored[event.id])["id"] == event.id


async def test_a_request_the_broker_refuses_is_dropped_and_the_rest_continue() -> None:
    js = FlakyJetStream(failures=1, error=BadRequestError(code=400, description="bad"))
    publisher = JetStreamPublisher(js, backoff=FAST)
    publisher.start()
    await publisher.submit(SUBJECT, _event(1))
    await publisher.submit(SUBJECT, _event(2))
    assert await publisher.drain(2.0)
    await publisher.close()
    assert publisher.dropped == 1 and publisher.published == 1 and len(js.stored) == 1


async def test_a_bounded_queue_pushes_back_and_order_is_kept() -> None:
    js = FlakyJetStream(blocked=True)
    publisher = JetStreamPublisher(js, max_pending=2, backoff=FAST)
    publisher.start()
    events = [_event(n) for n in range(4)]
    for event in events[:3]:  # one in flight, two queued
        await publisher.submit(SUBJECT, event)
    await eventually(lambda: len(js.attempts) == 1, what="the first event in flight")
    fourth = asyncio.create_task(publisher.submit(SUBJECT, events[3]))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(fourth), 0.2)
    assert publisher.pending == 3 and not fourth.done(), "submit must wait while the queue is full"
    js.release.set()
    await asyncio.wait_for(fourth, 2.0)
    assert await publisher.drain(2.0)
    await publisher.close()
    assert [headers["Nats-Msg-Id"] for _, _, headers in js.attempts] == [e.id for e in events]  # type: ignore[index]


async def test_events_survive_a_broker_restart_exactly_once(
    nats_server: NatsServer,
    tenant_broker: NatsTenantBroker,
    two_tenants: dict[str, UserKeys],
    provider_secret: bytes,
) -> None:
    reader = await tenant_reader(nats_server, tenant_broker, "acme", two_tenants["acme"])
    nc = await connect_provider(nats_server.url, provider_secret, name="test-publisher")
    publisher = JetStreamPublisher(nc.jetstream(), ack_timeout_s=0.5, backoff=Backoff(initial_s=0.05, max_s=0.3))
    publisher.start()
    try:
        first = _event(0)
        await publisher.submit(SUBJECT, first)
        assert await publisher.drain(5.0)
        nats_server.stop()
        during = [_event(n) for n in range(1, 4)]
        for event in during:
            await publisher.submit(SUBJECT, event)
        await eventually(lambda: publisher.retries >= 1, timeout=5.0, what="a failed attempt while the broker is away")
        assert publisher.pending == 3
        nats_server.start()
        assert await publisher.drain(15.0), "the publisher must deliver once the broker is back"
        await eventually(lambda: reader.client.is_connected, timeout=10.0, what="the tenant reconnecting")
        await reader.read()
        assert [event.id for _, event in reader.events] == [first.id] + [e.id for e in during], "once each, in order"
    finally:
        await publisher.close()
        await nc.close()
        await reader.close()
    provider = await tenant_broker.provider_connection()
    assert await stored_messages(provider, "acme") == 4
    await provider.close()


async def test_core_sink_drops_rather_than_raises_when_closed(nats_server: NatsServer, provider_secret: bytes) -> None:
    nc = await connect_provider(nats_server.url, provider_secret, name="test-core")
    sink = CoreSink(nc)
    assert await sink.publish_raw("hz.p.telemetry.h1", b"{}")
    await nc.close()
    assert not await sink.publish_raw("hz.p.telemetry.h1", b"{}") and sink.dropped == 1
