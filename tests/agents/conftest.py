"""Fixtures for agent tests over a real nats-server: the provider's connection, the desired-state bucket, and a
tenant-side reader that pulls through the JetStream API imported into the tenant's account (what a controller uses)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.js.kv import KeyValue

from broker_config.accounts import UserKeys
from broker_config.provisioner import NatsTenantBroker
from broker_config.render import TENANT_JS_PREFIX, tenant_stream_name
from broker_config.server import NatsServer
from harmonaize.desired_state import HostAssignment, host_key
from harmonaize.events import CloudEvent, parse_event
from provider_agents.desired import ensure_desired_state_bucket


@pytest.fixture
async def provider_nc(tenant_broker: NatsTenantBroker, two_tenants: dict[str, UserKeys]) -> AsyncIterator[Client]:
    """A connection in the provider's account, after acme and globex (and their streams) exist."""
    nc = await tenant_broker.provider_connection()
    yield nc
    await nc.close()


@pytest.fixture
async def kv(provider_nc: Client) -> KeyValue:
    return await ensure_desired_state_bucket(provider_nc.jetstream())


async def put_assignment(kv: KeyValue, assignment: HostAssignment) -> None:
    """Write a host's desired state as the control plane's outbox would."""
    await kv.put(host_key(assignment.host), assignment.model_dump_json().encode())


class TenantReader:
    """A tenant's durable pull consumer, read with the tenant's own credentials."""

    def __init__(self, tenant: str, client: Client, subscription: Any) -> None:
        self.tenant = tenant
        self.client = client
        self._sub = subscription
        self.events: list[tuple[str, CloudEvent[Any]]] = []

    async def read(self, *, wait: float = 1.0) -> list[tuple[str, CloudEvent[Any]]]:
        """Fetch and ack everything available now (waiting up to `wait` for the first message)."""
        got = []
        while True:
            try:
                batch = await self._sub.fetch(100, timeout=wait)
            except TimeoutError:  # nats-py raises its own subclass or the builtin, depending on the path
                break
            for msg in batch:
                got.append((msg.subject, parse_event(msg.data)))
                await msg.ack_sync()
            wait = 0.2
        self.events += got
        return got

    def kinds(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for subject, _ in self.events:
            kind = subject.split(".")[4]
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    async def close(self) -> None:
        await self.client.close()


async def tenant_reader(
    nats_server: NatsServer,
    tenant_broker: NatsTenantBroker,
    tenant: str,
    keys: UserKeys,
    *,
    name: str = "ctl",
    filter_subjects: tuple[str, ...] = (),
) -> TenantReader:
    await tenant_broker.ensure_consumer(tenant, name, filter_subjects=filter_subjects)
    client = await nats.connect(nats_server.url, nkeys_seed_str=keys.seed)
    js = client.jetstream(prefix=TENANT_JS_PREFIX)
    subscription = await js.pull_subscribe_bind(name, stream=tenant_stream_name(tenant))
    return TenantReader(tenant, client, subscription)


async def stored_messages(provider_nc: Client, tenant: str) -> int:
    info = await provider_nc.jetstream().stream_info(tenant_stream_name(tenant))
    return int(info.state.messages)


def event_text(subject: str, event: CloudEvent[Any]) -> str:
    return subject + " " + json.dumps(event.to_json_dict())
