"""A 3-node NATS cluster loses the leader of a tenant's R3 stream (SIGKILL) while agents are publishing into it:
nothing acknowledged is lost.

tests/broker/test_cluster.py kills the leader between two phases of one-at-a-time publishing and counts messages.
Here the kill lands while three agent processes (the product's `JetStreamPublisher`, connected to all three nodes)
have publishes in flight, and what the stream holds afterwards is read back and checked by CloudEvent id: every
event an agent had acknowledged is there, exactly once. Then the killed node comes back with an empty disk (its
machine was replaced) and catches up, and the leader elected meanwhile is killed too: the acknowledged events must
now be served by the replaced node and the third one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError

from broker_config.accounts import TenantAccount
from broker_config.cluster import local_cluster, start_all
from broker_config.keys import ProviderKeys, new_user_keys
from broker_config.render import render_accounts, tenant_stream_name
from broker_config.server import remove_store
from broker_config.streams import tenant_events_stream
from tests.faults.scripts.agent_publisher import event_id
from tests.faults.support import SCRIPTS, Process, clean_env, duplicates, python, scaled, stored_event_ids
from tests.support import add_stream_once_the_cluster_serves, eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(scaled(180, 900))]

AGENTS = 3
PER_AGENT = scaled(600, 6_000)
RATE = 80
STREAM = tenant_stream_name("acme")


async def test_nothing_acknowledged_is_lost_when_the_stream_leader_dies_mid_publish(
    tmp_path: Path, provider_secret: bytes
) -> None:
    keys = ProviderKeys(provider_secret)
    servers = local_cluster(tmp_path / "cluster", accounts_text=render_accounts(
        keys, [TenantAccount("acme", new_user_keys().public_key)]))
    start_all(servers)
    agents: list[Process] = []
    nc = await nats.connect(servers=[s.url for s in servers], nkeys_seed_str=keys.provider.seed,
                            reconnect_time_wait=0.1, max_reconnect_attempts=-1)
    try:
        js = nc.jetstream(timeout=2.0)

        await add_stream_once_the_cluster_serves(js, tenant_events_stream("acme", replicas=3))
        urls = ",".join(s.url for s in servers)
        agents = [
            Process(
                f"agent-{i}",
                python(str(SCRIPTS / "agent_publisher.py"), "--servers", urls, "--tenant", "acme", "--job", "train",
                       "--prefix", f"a{i}", "--count", str(PER_AGENT), "--rate", str(RATE),
                       "--out", str(tmp_path / f"agent-{i}.json")),
                clean_env(HZ_PROVIDER_SECRET=provider_secret.decode()),
                tmp_path / f"agent-{i}.log",
            ).start()
            for i in range(AGENTS)
        ]
        expected = {event_id(f"a{i}", n) for i in range(AGENTS) for n in range(PER_AGENT)}

        async def stored() -> int:
            try:
                return int((await js.stream_info(STREAM)).state.messages)
            except (APIError, NatsTimeout, NoRespondersError):
                return 0

        await eventually(lambda: _at_least(stored, len(expected) // 3), timeout=60, interval=0.05,
                         what="a third of the events stored")
        leader = await _leader(js)
        victim = next(s for s in servers if s.server_name == leader)
        at_kill = await stored()
        victim.kill()
        killed_at = time.monotonic()
        assert all(a.alive() for a in agents), "the leader must die while every agent is still publishing"

        await eventually(lambda: not any(a.alive() for a in agents), timeout=scaled(120, 600), interval=0.2,
                         what="every agent acknowledged all its events")
        for agent in agents:
            assert agent.proc is not None and agent.proc.returncode == 0, f"{agent.name} failed:\n{agent.tail()}"
        summaries = [json.loads((tmp_path / f"agent-{i}.json").read_text()) for i in range(AGENTS)]
        new_leader = await _leader(js)
        after_failover = await stored_event_ids(nc, STREAM)

        remove_store(victim)  # its disk went with it: what it stored must come back from the other replicas
        victim.start()
        await eventually(lambda: _replicas_current(js), timeout=60, interval=0.2,
                         what="the restarted node caught up with the stream")
        caught_up = time.monotonic() - killed_at
        second = next(s for s in servers if s.server_name == new_leader)
        second.kill()
        await eventually(lambda: _leader_elected(js, not_in={new_leader}), timeout=60, interval=0.2,
                         what="a leader among the node that was down and the third one")
        after_second_kill = await stored_event_ids(nc, STREAM)
    finally:
        for agent in agents:
            agent.kill()
        await nc.close()
        for server in servers:
            server.stop()

    print(
        f"\nleader {leader} killed with {at_kill} of {len(expected)} events stored; new leader {new_leader}; "
        f"publisher retries {sum(s['retries'] for s in summaries)}, PubAcks flagged duplicate "
        f"{sum(s['duplicate_acks'] for s in summaries)}; the stream holds {sum(after_failover.values())} messages "
        f"for {len(after_failover)} ids; the old leader, back with an empty disk, was current {caught_up:.1f} s after "
        f"its death; after the new "
        f"leader was killed too: {sum(after_second_kill.values())} messages"
    )
    assert sum(s["published"] for s in summaries) == len(expected), "every event acknowledged once by its agent"
    for holdings in (after_failover, after_second_kill):
        assert set(holdings) == expected, f"acknowledged events lost: {sorted(expected - set(holdings))[:10]}"
        assert duplicates(holdings) == {}, f"stored twice: {duplicates(holdings)}"


async def _at_least(count: Callable[[], Awaitable[int]], n: int) -> bool:
    return await count() >= n


async def _leader(js: object) -> str:
    async def probe() -> str | None:
        try:
            info = await js.stream_info(STREAM)  # type: ignore[attr-defined]
        except (APIError, NatsTimeout, NoRespondersError):
            return None
        return info.cluster.leader if info.cluster is not None else None

    found: list[str] = []

    async def elected() -> bool:
        leader = await probe()
        if leader:
            found.append(leader)
        return bool(leader)

    await eventually(elected, timeout=30, interval=0.1, what="a stream leader")
    return found[-1]


async def _replicas_current(js: object) -> bool:
    try:
        info = await js.stream_info(STREAM)  # type: ignore[attr-defined]
    except (APIError, NatsTimeout, NoRespondersError):
        return False
    replicas = info.cluster.replicas or []
    return len(replicas) == 2 and all(r.current and not r.offline and (r.lag or 0) == 0 for r in replicas)


async def _leader_elected(js: object, *, not_in: set[str]) -> bool:
    try:
        info = await js.stream_info(STREAM)  # type: ignore[attr-defined]
    except (APIError, NatsTimeout, NoRespondersError):
        return False
    return bool(info.cluster.leader) and info.cluster.leader not in not_in
