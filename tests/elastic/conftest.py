"""Fixtures of the elastic-job tier: a whole provider (API, broker, central loops, agents) around real torchrun jobs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from tests.elastic.harness import CloudFactory, ElasticCloud, elastic_cloud


@pytest.fixture
async def make_cloud(
    tmp_path: Path, nats_server: NatsServer, tenant_broker: NatsTenantBroker, provider_secret: bytes
) -> AsyncIterator[CloudFactory]:
    """`cloud = await make_cloud(hosts=("h1", "h2"), scenario=path)`; every cloud made stops with the test."""
    async with AsyncExitStack() as stack:

        async def make(**options: Any) -> ElasticCloud:
            return await stack.enter_async_context(
                elastic_cloud(
                    tmp_path / "cloud",
                    nats_server=nats_server,
                    tenant_broker=tenant_broker,
                    provider_secret=provider_secret,
                    **options,
                )
            )

        yield make


@pytest.fixture
async def cloud(make_cloud: CloudFactory) -> ElasticCloud:
    return await make_cloud()
