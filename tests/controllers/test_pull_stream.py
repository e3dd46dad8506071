"""The continuous pull, on a real nats-server with our tenant accounts: the tenant pulls through its imported API.

What can go wrong with outstanding pull requests is what these tests provoke: requests expiring while nothing is
published, the consumer vanishing under them (the broker answers 409/503: we must back off, not spin), and the
connection being lost (the requests die with it: a reconnect must re-ask).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client

from broker_config.accounts import UserKeys
from broker_config.provisioner import NatsTenantBroker
from broker_config.render import TENANT_JS_PREFIX, tenant_stream_name
from broker_config.server import NatsServer
from tenant_controllers.pull_stream import PullStream
from tests.support import eventually

SUBJECT = "hz.t.acme.events.carbon.j1"


async def _publish(broker: NatsTenantBroker, numbers: range) -> None:
    provider = await broker.provider_connection()
    js = provider.jetstream()
    for n in numbers:
        await js.publish(SUBJECT, json.dumps({"n": n}).encode())
    await provider.close()


async def _take_all(pull: PullStream, count: int, *, batch: int = 16) -> list[int]:
    got: list[int] = []
    async with asyncio.timeout(15):
        while len(got) < count:
            for msg in await pull.take(batch, timeout=1.0):
                got.append(json.loads(msg.data)["n"])
                await msg.ack()
    return got


@pytest.fixture
async def tenant(
    nats_server: NatsServer, tenant_broker: NatsTenantBroker, two_tenants: dict[str, UserKeys]
) -> AsyncIterator[tuple[Client, list[PullStream]]]:
    """acme's connection (reconnecting forever, as NatsEventSource connects) and a list to register streams in."""
    await tenant_broker.ensure_consumer("acme", "ctl")
    streams: list[PullStream] = []

    async def on_reconnect() -> None:
        for stream in streams:
            stream.forget_requests()

    nc = await nats.connect(
        nats_server.url, nkeys_seed_str=two_tenants["acme"].seed, reconnected_cb=on_reconnect,
        max_reconnect_attempts=-1, reconnect_time_wait=0.2,
    )
    yield nc, streams
    for stream in streams:
        await stream.stop()
    await nc.close()


def _pull(nc: Client, streams: list[PullStream], **options: float) -> PullStream:
    pull = PullStream(nc, api_prefix=TENANT_JS_PREFIX, stream=tenant_stream_name("acme"), consumer="ctl", **options)
    streams.append(pull)
    return pull


async def test_events_flow_in_order_on_outstanding_requests(
    tenant: tuple[Client, list[PullStream]], tenant_broker: NatsTenantBroker
) -> None:
    nc, streams = tenant
    pull = _pull(nc, streams)
    await pull.start()
    consumer = asyncio.create_task(_take_all(pull, 200))
    await _publish(tenant_broker, range(200))
    assert await consumer == list(range(200))
    # Demand is topped up at half the window (16): about one request per 8 events, never one per event.
    assert pull.requests_sent <= 200 // 4, pull.requests_sent
    assert not pull.problems


async def test_requests_that_expire_while_nothing_is_published_are_renewed(
    tenant: tuple[Client, list[PullStream]], tenant_broker: NatsTenantBroker
) -> None:
    nc, streams = tenant
    pull = _pull(nc, streams, expires=0.5, heartbeat=0.1)
    await pull.start()
    assert await pull.take(16, timeout=2.0) == []  # ~4 requests expired meanwhile
    assert pull.requests_sent >= 3, "each expired request is replaced"
    await _publish(tenant_broker, range(3))
    assert await _take_all(pull, 3) == [0, 1, 2]
    assert not pull.problems, "an expiry is routine, not a problem"


async def test_a_consumer_deleted_under_the_requests_is_backed_off_from_then_resumed(
    tenant: tuple[Client, list[PullStream]], tenant_broker: NatsTenantBroker
) -> None:
    nc, streams = tenant
    pull = _pull(nc, streams, expires=5.0, heartbeat=0.5)
    await pull.start()
    await _publish(tenant_broker, range(2))
    assert await _take_all(pull, 2) == [0, 1]
    provider = await tenant_broker.provider_connection()
    await provider.jetstream().delete_consumer(tenant_stream_name("acme"), "ctl")
    await eventually(lambda: bool(pull.problems), timeout=5, what="the broker ending our request")
    sent_before = pull.requests_sent
    assert await pull.take(16, timeout=2.0) == []
    # Backing off 0.25, 0.5, 1 s...: a handful of requests in 2 s, not a hot loop of answered-at-once requests.
    assert pull.requests_sent - sent_before <= 8, pull.requests_sent - sent_before
    await provider.close()
    await tenant_broker.ensure_consumer("acme", "ctl")  # the provider re-creates it (a new durable: from the start)
    await _publish(tenant_broker, range(2, 4))
    assert await _take_all(pull, 4) == [0, 1, 2, 3]


async def test_requests_lost_with_the_connection_are_asked_again_after_a_reconnect(
    tenant: tuple[Client, list[PullStream]], tenant_broker: NatsTenantBroker, nats_server: NatsServer
) -> None:
    nc, streams = tenant
    pull = _pull(nc, streams, expires=30.0, heartbeat=5.0)  # liveness alone would take 15 s to notice
    await pull.start()
    await _publish(tenant_broker, range(1))
    assert await _take_all(pull, 1) == [0]
    nats_server.kill()  # no "server shutdown" status reaches us: the requests are simply gone
    nats_server.start()
    await eventually(lambda: nc.is_connected, timeout=10, what="the tenant reconnected")
    await _publish(tenant_broker, range(1, 3))
    got: list[int] = []
    async with asyncio.timeout(5):  # well inside the 15 s the liveness check would need
        while not {1, 2} <= set(got):
            got += await _take_all(pull, 1)
    # The ack of 0 may have died with the broker (acks are flushed asynchronously): then 0 comes again, first.
    assert got in ([1, 2], [0, 1, 2]), got


async def test_nothing_is_asked_while_the_broker_is_down(
    tenant: tuple[Client, list[PullStream]], tenant_broker: NatsTenantBroker, nats_server: NatsServer
) -> None:
    """nats-py would queue each request and send them all on reconnect, on top of the one asked then."""
    nc, streams = tenant
    pull = _pull(nc, streams, expires=2.0, heartbeat=0.2)  # liveness would re-ask every 0.6 s if allowed
    await pull.start()
    assert await pull.take(16, timeout=0.3) == []
    nats_server.kill()
    await eventually(lambda: not nc.is_connected, timeout=5, what="the tenant noticed")
    sent = pull.requests_sent
    assert await pull.take(16, timeout=2.0) == []
    assert pull.requests_sent == sent, "requests were queued for a broker that is not there"
    nats_server.start()
    await eventually(lambda: nc.is_connected, timeout=10, what="the tenant reconnected")
    await _publish(tenant_broker, range(2))
    assert await _take_all(pull, 2) == [0, 1]


async def test_stopping_hands_buffered_events_back_at_once(
    tenant: tuple[Client, list[PullStream]], tenant_broker: NatsTenantBroker
) -> None:
    """Without the hand-back, the next run would wait out the ack wait (30 s) for what the last one had buffered."""
    nc, streams = tenant
    first = _pull(nc, streams)
    await first.start()
    await _publish(tenant_broker, range(6))
    got: list[int] = []  # taken and never acked: they belong to the first run, which "crashed" holding them
    async with asyncio.timeout(5):
        while len(got) < 2:
            got += [json.loads(m.data)["n"] for m in await first.take(2 - len(got), timeout=1.0)]
    await eventually(lambda: len(first._buffer) > 0, timeout=5, what="more events buffered than taken")
    await first.stop()
    second = _pull(nc, streams)
    await second.start()
    async with asyncio.timeout(5):  # far below the 30 s ack wait
        rest = await _take_all(second, 6 - len(got))
    assert sorted(got + rest) == list(range(6))


async def test_the_wake_up_signal_times_out_is_kept_once_set_and_wakes_every_waiter() -> None:
    """`take` waits on it for arrivals: a missed wake-up would stall the controller until the heartbeat check."""
    from tenant_controllers.pull_stream import _Signal

    signal = _Signal()
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await signal.wait(0.05) is False
    assert loop.time() - started >= 0.04, "timed out, not returned at once"
    signal.set()
    assert await signal.wait(5) is True, "a set before the wait is not lost"
    signal.clear()
    waiters = [asyncio.create_task(signal.wait(5)) for _ in range(2)]
    await eventually(lambda: len(signal._waiters) == 2, timeout=1, what="both waiting")
    signal.set()
    signal.clear()  # before the waiters resume: they were woken all the same
    async with asyncio.timeout(1):
        assert await asyncio.gather(*waiters) == [True, True]
    cancelled = asyncio.create_task(signal.wait(5))
    await eventually(lambda: len(signal._waiters) == 1, timeout=1, what="a waiter")
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert signal._waiters == set(), "a cancelled wait leaves nothing behind"
