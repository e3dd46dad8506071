"""Reloading the broker through the system account, the path a control plane in another container uses (no pid)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from broker_config.accounts import TenantAccount
from broker_config.cluster import local_cluster, start_all
from broker_config.keys import ProviderKeys
from broker_config.provisioner import NatsTenantBroker
from broker_config.reload import SystemAccountReload, cluster_server_ids, reload_via_system_account
from broker_config.render import ACCOUNTS_FILE, TENANT_JS_PREFIX, render_accounts
from broker_config.server import BrokerError, NatsServer
from tests.support import connect_probe, eventually

pytestmark = pytest.mark.asyncio


async def _load_times(system: Client, expected: int) -> dict[str, str]:
    """config_load_time of every server, from one PING (each server of the cluster answers it)."""
    times: dict[str, str] = {}

    async def collect(msg: Msg) -> None:
        body = json.loads(msg.data)
        times[body["server"]["id"]] = body["data"]["config_load_time"]

    inbox = system.new_inbox()
    sub = await system.subscribe(inbox, cb=collect)
    await system.publish("$SYS.REQ.SERVER.PING.VARZ", b"{}", reply=inbox)
    await eventually(lambda: len(times) == expected, timeout=5, what=f"VARZ from {expected} servers")
    await sub.unsubscribe()
    return times


def _routed(system: Client, size: int) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        return len(await cluster_server_ids(system)) == size

    return probe


async def _jetstream_ready(url: str, seed: str) -> None:
    """A fresh cluster answers clients before it has elected its JetStream meta leader."""
    client = await nats.connect(url, nkeys_seed_str=seed)

    async def ready() -> bool:
        try:
            await client.jetstream(timeout=1.0).account_info()
            return True
        except Exception:  # no responders / timeout while the meta leader is being elected
            return False

    try:
        await eventually(ready, timeout=30, interval=0.2, what="JetStream meta leader elected")
    finally:
        await client.close()


async def test_tenant_added_through_a_system_account_reload_consumes_and_connections_stay_up(
    nats_server: NatsServer, provider_secret: bytes
) -> None:
    broker = NatsTenantBroker(
        servers=[nats_server.url],
        provider_secret=provider_secret,
        accounts_file=nats_server.accounts_file,
        reload=SystemAccountReload(),
    )
    acme_keys = broker.new_user_keys()
    await broker.apply([TenantAccount("acme", acme_keys.public_key)])
    acme = await connect_probe(nats_server.url, acme_keys.seed)
    provider = await broker.provider_connection()

    start = time.monotonic()
    initech = broker.new_user_keys()
    await broker.apply([TenantAccount("acme", acme_keys.public_key), TenantAccount("initech", initech.public_key)])
    await broker.ensure_consumer("initech", "ctl")
    await provider.jetstream().publish("hz.t.initech.events.capacity.j9", b'{"n": 0}')
    client = await nats.connect(nats_server.url, nkeys_seed_str=initech.seed)
    sub = await client.jetstream(prefix=TENANT_JS_PREFIX).pull_subscribe_bind("ctl", stream="HZ_T_initech")
    msgs = await sub.fetch(1, timeout=2.0)
    await msgs[0].ack_sync()
    assert time.monotonic() - start < 2.0
    assert acme.disconnects == 0 and acme.client.is_connected and acme.errors == []
    await asyncio.gather(client.close(), provider.close(), acme.client.close())


async def test_a_config_the_server_refuses_is_an_error_naming_the_reason(
    nats_server: NatsServer, provider_secret: bytes
) -> None:
    system = await nats.connect(nats_server.url, nkeys_seed_str=ProviderKeys(provider_secret).system.seed)
    try:
        nats_server.accounts_file.write_text("accounts: { broken")
        with pytest.raises(BrokerError, match="refused to reload its config: .*accounts.conf"):
            await reload_via_system_account(system)
    finally:
        await system.close()
    provider = await nats.connect(nats_server.url, nkeys_seed_str=ProviderKeys(provider_secret).provider.seed)
    await provider.close()  # the server kept its previous config


async def test_only_the_system_account_may_ask_for_a_reload(nats_server: NatsServer, provider_secret: bytes) -> None:
    provider = await nats.connect(nats_server.url, nkeys_seed_str=ProviderKeys(provider_secret).provider.seed)
    try:
        with pytest.raises(BrokerError, match="did not answer"):
            await reload_via_system_account(provider, timeout=1.0)
    finally:
        await provider.close()


@pytest.mark.slow
async def test_every_node_of_a_cluster_sharing_one_accounts_file_reloads(
    tmp_path: Path, provider_secret: bytes
) -> None:
    """As in the compose `cluster` profile: three nodes include one accounts file; a tenant added through node 0 can
    connect to node 2."""
    keys = ProviderKeys(provider_secret)
    servers = local_cluster(tmp_path, accounts_text=render_accounts(keys, []))
    shared = servers[0].directory / ACCOUNTS_FILE
    servers[0].directory.mkdir(parents=True)
    shared.write_text(render_accounts(keys, []))
    for server in servers[1:]:
        server.directory.mkdir(parents=True)
        os.symlink(shared, server.directory / ACCOUNTS_FILE)
    start_all(servers)
    try:
        system = await nats.connect(servers[0].url, nkeys_seed_str=keys.system.seed)
        try:
            await eventually(_routed(system, 3), timeout=15, interval=0.05, what="a full mesh of routes")
            before = await _load_times(system, 3)
            ids = await reload_via_system_account(system)
            after = await _load_times(system, 3)
        finally:
            await system.close()
        assert sorted(ids) == sorted(before)
        assert all(after[i] != before[i] for i in ids), "a node did not reload"

        await _jetstream_ready(servers[0].url, keys.provider.seed)
        broker = NatsTenantBroker(
            servers=[servers[0].url], provider_secret=provider_secret, accounts_file=shared,
            reload=SystemAccountReload(),
        )
        acme = broker.new_user_keys()
        await broker.apply([TenantAccount("acme", acme.public_key)])
        client = await nats.connect(servers[2].url, nkeys_seed_str=acme.seed, allow_reconnect=False)
        await client.close()
    finally:
        for server in servers:
            server.stop()
