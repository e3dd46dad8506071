"""A tenant's durable consumer survives broker restarts (kept by the broker, or by its reader, which asks for it
again from where it recorded); tenants added at runtime work without one."""

from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest
from nats.aio.client import Client
from nats.js.api import ConsumerInfo
from nats.js.errors import NotFoundError

from broker_config.accounts import TenantAccount, UserKeys
from broker_config.provisioner import NatsTenantBroker
from broker_config.render import TENANT_JS_PREFIX
from broker_config.server import NatsServer
from broker_config.streams import ConsumerPosition
from tests.support import Inbox, connect_probe, eventually

pytestmark = pytest.mark.asyncio


async def _publish(broker: NatsTenantBroker, tenant: str, numbers: range) -> None:
    provider = await broker.provider_connection()
    js = provider.jetstream()
    for n in numbers:
        ack = await js.publish(f"hz.t.{tenant}.events.carbon.j1", json.dumps({"n": n}).encode())
        assert ack.stream == f"HZ_T_{tenant}"
    await provider.close()


async def _drain(sub: object, *, expect: int) -> list[int]:
    """Fetch until `expect` messages arrived (or none is left), then prove nothing more is pending."""
    got: list[int] = []
    deadline = time.monotonic() + 10
    while len(got) < expect and time.monotonic() < deadline:
        try:
            batch = await sub.fetch(expect - len(got), timeout=1.0)  # type: ignore[attr-defined]
        except (nats.errors.TimeoutError, TimeoutError):  # nats-py 2.16 raises either
            break
        for msg in batch:
            got.append(json.loads(msg.data)["n"])
            await msg.ack_sync()
    with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
        await sub.fetch(1, timeout=0.5)  # type: ignore[attr-defined]
    return got


async def _consume_four_then_restart(
    nats_server: NatsServer, tenant_broker: NatsTenantBroker, seed: str, *, crash: bool
) -> Client:
    await tenant_broker.ensure_consumer("acme", "ctl")
    await _publish(tenant_broker, "acme", range(10))
    acme = await nats.connect(nats_server.url, nkeys_seed_str=seed)
    sub = await acme.jetstream(prefix=TENANT_JS_PREFIX).pull_subscribe_bind("ctl", stream="HZ_T_acme")
    first = await sub.fetch(4, timeout=2.0)
    for msg in first:
        await msg.ack_sync()  # acknowledged by the server, not just sent
    assert [json.loads(m.data)["n"] for m in first] == [0, 1, 2, 3]
    await acme.close()

    if crash:
        nats_server.kill()
    else:
        nats_server.stop()
    nats_server.start()
    return await nats.connect(nats_server.url, nkeys_seed_str=seed)


async def test_durable_consumer_resumes_exactly_at_its_ack_point_after_broker_restart(
    nats_server: NatsServer, tenant_broker: NatsTenantBroker, two_tenants: dict[str, UserKeys]
) -> None:
    acme = await _consume_four_then_restart(nats_server, tenant_broker, two_tenants["acme"].seed, crash=False)
    sub = await acme.jetstream(prefix=TENANT_JS_PREFIX).pull_subscribe_bind("ctl", stream="HZ_T_acme")
    assert await _drain(sub, expect=10) == [4, 5, 6, 7, 8, 9], "lost or redelivered after a restart"
    await acme.close()


async def test_broker_crash_loses_no_event_and_redelivers_only_the_last_acked(
    nats_server: NatsServer, tenant_broker: NatsTenantBroker, two_tenants: dict[str, UserKeys]
) -> None:
    """After SIGKILL, every stored event is still there. nats-server flushes consumer ack state asynchronously even
    with `sync_interval: always`, so acks from the last moments before the crash can be forgotten: those events come
    back (at-least-once), which is why tenant controllers deduplicate by CloudEvent id."""
    acme = await _consume_four_then_restart(nats_server, tenant_broker, two_tenants["acme"].seed, crash=True)
    sub = await acme.jetstream(prefix=TENANT_JS_PREFIX).pull_subscribe_bind("ctl", stream="HZ_T_acme")
    got = await _drain(sub, expect=10)
    assert got[-6:] == [4, 5, 6, 7, 8, 9], "an event stored before the crash was lost"
    assert got == list(range(10 - len(got), 10)), "redeliveries must be a contiguous run of the latest acked events"
    await acme.close()


async def test_tenant_added_at_runtime_consumes_within_2s_and_existing_connections_stay_up(
    nats_server: NatsServer, tenant_broker: NatsTenantBroker, two_tenants: dict[str, UserKeys]
) -> None:
    acme = await connect_probe(nats_server.url, two_tenants["acme"].seed)
    live = Inbox()
    await acme.client.subscribe("hz.t.acme.>", cb=live.on_message)
    provider_probe_disconnects: list[int] = []

    async def on_provider_disconnect() -> None:
        provider_probe_disconnects.append(1)

    provider = await tenant_broker.provider_connection(disconnected_cb=on_provider_disconnect)

    start = time.monotonic()
    initech = tenant_broker.new_user_keys()
    accounts = [TenantAccount(t, k.public_key) for t, k in two_tenants.items()]
    await tenant_broker.apply([*accounts, TenantAccount("initech", initech.public_key)])
    await tenant_broker.ensure_consumer("initech", "ctl")
    await provider.jetstream().publish("hz.t.initech.events.capacity.j9", b'{"n": 0}')
    client = await nats.connect(nats_server.url, nkeys_seed_str=initech.seed)
    sub = await client.jetstream(prefix=TENANT_JS_PREFIX).pull_subscribe_bind("ctl", stream="HZ_T_initech")
    msgs = await sub.fetch(1, timeout=2.0)
    await msgs[0].ack_sync()
    elapsed = time.monotonic() - start
    assert elapsed < 2.0, f"runtime tenant took {elapsed:.2f} s to consume"

    await provider.jetstream().publish("hz.t.acme.events.capacity.j1", b'{"n": 1}')
    await eventually(lambda: len(live.messages) == 1, what="acme's live event after the reload")
    assert acme.disconnects == 0 and provider_probe_disconnects == []
    assert acme.client.is_connected and provider.is_connected
    assert acme.errors == []
    await asyncio.gather(client.close(), provider.close(), acme.client.close())


async def _ack_first(nats_server: NatsServer, seed: str, count: int) -> None:
    """As acme's reader: fetch `count` events from consumer `ctl` and ack each, acknowledged by the server."""
    acme = await nats.connect(nats_server.url, nkeys_seed_str=seed)
    sub = await acme.jetstream(prefix=TENANT_JS_PREFIX).pull_subscribe_bind("ctl", stream="HZ_T_acme")
    batch = await sub.fetch(count, timeout=2.0)
    assert len(batch) == count
    for msg in batch:
        await msg.ack_sync()
    await acme.close()


async def _consumer_info(tenant_broker: NatsTenantBroker, name: str) -> ConsumerInfo | None:
    provider = await tenant_broker.provider_connection()
    try:
        return await provider.jetstream().consumer_info("HZ_T_acme", name)
    except NotFoundError:
        return None
    finally:
        await provider.close()


async def test_a_reader_kept_consumer_lives_in_memory_is_gone_after_a_restart_and_resumes_where_asked(
    nats_server: NatsServer, tenant_broker: NatsTenantBroker, two_tenants: dict[str, UserKeys]
) -> None:
    """position="reader": the broker writes no state file for it (in memory only), so a restart loses it; asked for
    again with the ack floor the reader recorded (and the stream it was recorded in), it delivers from just after."""
    created = await tenant_broker.ensure_consumer("acme", "ctl", position="reader")
    assert created.position == "reader" and created.stream_created
    info = await _consumer_info(tenant_broker, "ctl")
    assert info is not None and info.config.mem_storage
    await _publish(tenant_broker, "acme", range(10))
    await _ack_first(nats_server, two_tenants["acme"].seed, 4)
    info = await _consumer_info(tenant_broker, "ctl")
    assert info is not None and info.ack_floor is not None
    floor = info.ack_floor.stream_seq
    assert floor == 4

    nats_server.stop()
    nats_server.start()
    assert await _consumer_info(tenant_broker, "ctl") is None, "a memory-kept consumer outlived the restart"
    again = await tenant_broker.ensure_consumer(
        "acme", "ctl", position="reader", start_after=floor, stream_created=created.stream_created
    )
    assert again.stream_created == created.stream_created, "the stream itself survived the restart"
    acme = await nats.connect(nats_server.url, nkeys_seed_str=two_tenants["acme"].seed)
    sub = await acme.jetstream(prefix=TENANT_JS_PREFIX).pull_subscribe_bind("ctl", stream="HZ_T_acme")
    assert await _drain(sub, expect=6) == [4, 5, 6, 7, 8, 9], "lost or redelivered after the reader's position"
    await acme.close()

    # Asked for again while it exists: it stays where it is (start_after applies only to a new consumer).
    await tenant_broker.ensure_consumer("acme", "ctl", position="reader", start_after=0,
                                        stream_created=created.stream_created)
    info = await _consumer_info(tenant_broker, "ctl")
    assert info is not None and info.ack_floor is not None and info.ack_floor.stream_seq == 10


async def test_a_position_recorded_in_a_stream_since_re_created_is_ignored(
    nats_server: NatsServer, tenant_broker: NatsTenantBroker, two_tenants: dict[str, UserKeys]
) -> None:
    """A reader whose state outlived the stream (a provider that wiped the broker's storage) must not skip the new
    stream's first events: its start_after names the old stream, so the consumer delivers from the start."""
    first = await tenant_broker.ensure_consumer("acme", "ctl", position="reader")
    assert first.stream_created
    await _publish(tenant_broker, "acme", range(3))
    consumer = await tenant_broker.ensure_consumer(
        "acme", "fresh", position="reader", start_after=2, stream_created="2001-01-01T00:00:00Z"
    )
    assert consumer.stream_created == first.stream_created
    acme = await nats.connect(nats_server.url, nkeys_seed_str=two_tenants["acme"].seed)
    sub = await acme.jetstream(prefix=TENANT_JS_PREFIX).pull_subscribe_bind("fresh", stream="HZ_T_acme")
    assert await _drain(sub, expect=3) == [0, 1, 2]
    await acme.close()


@pytest.mark.parametrize(("before", "after"), [("broker", "reader"), ("reader", "broker")])
async def test_a_consumer_asked_for_with_the_other_position_moves_keeping_its_ack_floor(
    nats_server: NatsServer, tenant_broker: NatsTenantBroker, two_tenants: dict[str, UserKeys],
    before: ConsumerPosition, after: ConsumerPosition,
) -> None:
    """A controller upgraded to keep its own position meets the broker-kept consumer of its earlier version (or the
    other way round): nats-server cannot change a consumer's storage, so it is re-created from its ack floor."""
    await tenant_broker.ensure_consumer("acme", "ctl", position=before)
    await _publish(tenant_broker, "acme", range(6))
    await _ack_first(nats_server, two_tenants["acme"].seed, 2)

    moved = await tenant_broker.ensure_consumer("acme", "ctl", position=after)
    assert moved.position == after
    info = await _consumer_info(tenant_broker, "ctl")
    assert info is not None and bool(info.config.mem_storage) == (after == "reader")
    acme = await nats.connect(nats_server.url, nkeys_seed_str=two_tenants["acme"].seed)
    sub = await acme.jetstream(prefix=TENANT_JS_PREFIX).pull_subscribe_bind("ctl", stream="HZ_T_acme")
    assert await _drain(sub, expect=4) == [2, 3, 4, 5], "the move lost the consumer's place"
    await acme.close()
