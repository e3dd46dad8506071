"""The 3-node cluster variant: an R3 stream keeps taking publishes when a node (here, the stream's leader) dies; the
provider's buckets are replicated like it, raised to three replicas where an older setting left one."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import nats
import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import KeyValueConfig
from nats.js.errors import APIError, NoStreamResponseError
from nats.js.kv import KeyValue

from broker_config.accounts import TenantAccount
from broker_config.buckets import RENDEZVOUS_BUCKET, desired_state_bucket, ensure_bucket
from broker_config.cluster import local_cluster, start_all
from broker_config.keys import ProviderKeys, new_user_keys
from broker_config.render import render_accounts
from broker_config.streams import tenant_events_stream
from harmonaize.desired_state import DESIRED_STATE_BUCKET
from provider_agents.desired import ensure_desired_state_bucket
from provider_agents.rendezvous_host import ensure_rendezvous_bucket
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


async def test_a_node_that_cannot_start_takes_the_started_ones_down_with_it(
    tmp_path: Path, provider_secret: bytes
) -> None:
    """The caller never gets a half-started cluster, so nothing of it may be left running."""
    servers = local_cluster(tmp_path, accounts_text=render_accounts(ProviderKeys(provider_secret), []))
    last = servers[-1]
    assert last.cluster is not None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:
        blocker.bind((last.cluster.host, last.cluster.port))  # the last node's route port is taken
        blocker.listen()
        with pytest.raises(Exception, match="route|router|address already in use"):
            start_all(servers)
    assert not any(server.is_running() for server in servers)
    left = [
        entry.name for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and str(tmp_path).encode() in _cmdline(entry)
    ]
    assert not left, f"nats-server processes of this cluster still running: {left}"


def _cmdline(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""


async def test_the_providers_buckets_are_replicated_scaled_up_and_survive_their_leaders_death(
    tmp_path: Path, provider_secret: bytes
) -> None:
    """A bucket left with one replica by a process of an older setting is raised to three by the next one to bind
    it, never lowered; then the node leading it dies and the bucket still reads and writes."""
    keys = ProviderKeys(provider_secret)
    servers = local_cluster(tmp_path, accounts_text=render_accounts(keys, []))
    start_all(servers)
    try:
        nc = await nats.connect(servers=[s.url for s in servers], nkeys_seed_str=keys.provider.seed,
                                reconnect_time_wait=0.1, max_reconnect_attempts=-1)
        js = nc.jetstream(timeout=2.0)

        made: list[KeyValue] = []

        async def bound(config: KeyValueConfig) -> bool:
            try:
                made.append(await ensure_bucket(js, config))
                return True
            except (APIError, NatsTimeout, NoRespondersError):
                return False

        async def replicas(bucket: str) -> int:
            return (await js.stream_info(f"KV_{bucket}")).config.num_replicas or 1

        await eventually(lambda: bound(desired_state_bucket(replicas=1)), timeout=30, interval=0.2,
                         what="the desired-state bucket created on the cluster")
        old = made[0]
        assert await replicas(DESIRED_STATE_BUCKET) == 1
        await old.put("host.h1", b"generation 1")

        kv = await ensure_desired_state_bucket(js, replicas=3)
        assert await replicas(DESIRED_STATE_BUCKET) == 3
        assert (await kv.get("host.h1")).value == b"generation 1", "scaling up kept what the bucket held"
        await ensure_desired_state_bucket(js, replicas=1)
        assert await replicas(DESIRED_STATE_BUCKET) == 3, "a process with a lower setting never lowers it"
        await ensure_rendezvous_bucket(js, replicas=3)
        assert await replicas(RENDEZVOUS_BUCKET) == 3

        async def caught_up() -> bool:
            cluster = (await js.stream_info(f"KV_{DESIRED_STATE_BUCKET}")).cluster
            return cluster is not None and cluster.leader is not None and len(cluster.replicas or []) == 2 and all(
                r.current for r in cluster.replicas or [])

        await eventually(caught_up, timeout=30, interval=0.2, what="both new replicas current")
        cluster = (await js.stream_info(f"KV_{DESIRED_STATE_BUCKET}")).cluster
        assert cluster is not None
        victim = next(s for s in servers if s.server_name == cluster.leader)
        victim.kill()

        async def written() -> bool:
            try:
                await kv.put("host.h1", b"generation 2")
                return (await kv.get("host.h1")).value == b"generation 2"
            except (APIError, NatsTimeout, NoRespondersError, NoStreamResponseError):
                return False

        await eventually(written, timeout=30, interval=0.2, what="the bucket written after its leader died")
        info = await js.stream_info(f"KV_{DESIRED_STATE_BUCKET}")
        assert info.cluster is not None and info.cluster.leader != victim.server_name
        await nc.close()
    finally:
        for s in servers:
            s.stop()
