"""Fixtures of the elastic-job tier: a whole provider (API, broker, central loops, agents) around real torchrun jobs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from pathlib import Path

import pytest

from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from tests.elastic.harness import ElasticCloud, elastic_cloud

CloudFactory = Callable[..., AbstractAsyncContextManager[ElasticCloud]]


@pytest.fixture
async def make_cloud(
    tmp_path: Path, nats_server: NatsServer, tenant_broker: NatsTenantBroker, provider_secret: bytes
) -> AsyncIterator[Callable[..., AsyncIterator[ElasticCloud]]]:
    """`async with make_cloud(hosts=("h1", "h2"), scenario=path) as cloud:` (one per test)."""
    async with AsyncExitStack() as stack:

        async def make(**options: object) -> ElasticCloud:
            return await stack.enter_async_context(
                elastic_cloud(
                    tmp_path / "cloud",
                    nats_server=nats_server,
                    tenant_broker=tenant_broker,
                    provider_secret=provider_secret,
                    **options,  # type: ignore[arg-type]
                )
            )

        yield make  # type: ignore[misc]


@pytest.fixture
async def cloud(make_cloud: Callable[..., AsyncIterator[ElasticCloud]]) -> ElasticCloud:
    return await make_cloud()  # type: ignore[no-any-return, misc]
