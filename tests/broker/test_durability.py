"""A tenant's durable consumer survives broker restarts; tenants added at runtime work without one."""

from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest

from broker_config.accounts import TenantAccount, UserKeys
from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
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
    """Fetch until `expect` messages arrived, then prove nothing more is pending."""
    got: list[int] = []
    deadline = time.monotonic() + 10
    while len(got) < expect and time.monotonic() < deadline:
        try:
            batch = await sub.fetch(expect - len(got), timeout=1.0)  # type: ignore[attr-defined]
        except nats.errors.TimeoutError:
            continue
        for msg in batch:
            got.append(json.loads(msg.data)["n"])
            await msg.ack_sync()
    with pytest.raises(nats.errors.TimeoutError):
        await sub.fetch(1, timeout=0.5)  # type: ignore[attr-defined]
    return got


@pytest.mark.parametrize("how", ["graceful", "sigkill"])
async def test_durable_consumer_resumes_from_ack_point_after_broker_restart(
    nats_server: NatsServer, tenant_broker: NatsTenantBroker, two_tenants: dict[str, UserKeys], how: str
) -> None:
    await tenant_broker.ensure_consumer("acme", "ctl")
    await _publish(tenant_broker, "acme", range(10))
    acme = await nats.connect(nats_server.url, nkeys_seed_str=two_tenants["acme"].seed)
    sub = await acme.jetstream().pull_subscribe_bind("ctl", stream="HZ_T_acme")
    first = await sub.fetch(4, timeout=2.0)
    for msg in first:
        await msg.ack_sync()  # acknowledged by the server, not just sent
    assert [json.loads(m.data)["n"] for m in first] == [0, 1, 2, 3]
    await acme.close()

    if how == "graceful":
        nats_server.stop()
    else:
        nats_server.kill()
    nats_server.start()

    acme = await nats.connect(nats_server.url, nkeys_seed_str=two_tenants["acme"].seed)
    sub = await acme.jetstream().pull_subscribe_bind("ctl", stream="HZ_T_acme")
    assert await _drain(sub, expect=6) == [4, 5, 6, 7, 8, 9]
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
    sub = await client.jetstream().pull_subscribe_bind("ctl", stream="HZ_T_initech")
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
