"""The 3-node cluster variant: an R3 stream keeps taking publishes when a node (here, the stream's leader) dies."""

from __future__ import annotations

import json
from pathlib import Path

import nats
import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError, NoStreamResponseError

from broker_config.accounts import TenantAccount
from broker_config.cluster import local_cluster, start_all
from broker_config.keys import ProviderKeys, new_user_keys
from broker_config.render import render_accounts
from broker_config.streams import tenant_events_stream
from tests.support import add_stream_once_the_cluster_serves, eventually

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


async def test_r3_stream_accepts_publishes_after_its_leader_is_killed(tmp_path: Path, provider_secret: bytes) -> None:
    keys = ProviderKeys(provider_secret)
    accounts = render_accounts(keys, [TenantAccount("acme", new_user_keys().public_key)])
    servers = local_cluster(tmp_path, accounts_text=accounts)
    start_all(servers)
    try:
        nc = await nats.connect(servers=[s.url for s in servers], nkeys_seed_str=keys.provider.seed,
                                reconnect_time_wait=0.1, max_reconnect_attempts=-1)
        js = nc.jetstream(timeout=2.0)

        await add_stream_once_the_cluster_serves(js, tenant_events_stream("acme", replicas=3))
        info = await js.stream_info("HZ_T_acme")
        assert info.config.num_replicas == 3

        async def publish(n: int) -> None:
            """Retry until the PubAck arrives; the message id makes retries idempotent."""
            payload = json.dumps({"n": n}).encode()
            async def acked() -> bool:
                try:
                    await js.publish("hz.t.acme.events.carbon.j1", payload, headers={"Nats-Msg-Id": f"m{n}"})
                    return True
                except (NatsTimeout, NoRespondersError, NoStreamResponseError, APIError):
                    return False
            await eventually(acked, timeout=30, interval=0.1, what=f"PubAck for message {n}")

        for n in range(100):
            await publish(n)
        cluster = (await js.stream_info("HZ_T_acme")).cluster
        assert cluster is not None
        leader = cluster.leader
        victim = next(s for s in servers if s.server_name == leader)
        victim.kill()
        for n in range(100, 200):
            await publish(n)

        survivors = [s for s in servers if s is not victim]
        info = await js.stream_info("HZ_T_acme")
        assert info.state.messages == 200
        assert info.cluster is not None and info.cluster.leader in {s.server_name for s in survivors}
        await nc.close()
    finally:
        for s in servers:
            s.stop()
