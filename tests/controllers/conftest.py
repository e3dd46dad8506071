"""Fixtures for the tenant-controller tests, and the hygiene every one of them gets.

Autouse: a test that leaves asyncio tasks running fails (a controller that does not stop cleanly is a bug, and its
leftovers would make the next test flaky); each test gets its own state directory as the working directory, so a
runner's default `.hz/` never lands in the repository. There is no global handler registry to reset: each
`Controller` owns its handlers, so every test builds its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.memory import MemoryBroker
from tenant_controllers.store import HandledStore
from tests.controllers.fake_provider import FakeProvider
from tests.controllers.live_cloud import LiveCloud, live_cloud


@pytest.fixture(autouse=True)
async def _no_tasks_left_behind() -> AsyncIterator[None]:
    before = set(asyncio.all_tasks())
    yield
    for _ in range(3):  # let cancelled tasks finish unwinding
        await asyncio.sleep(0)
    current = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() - before if t is not current and not t.done()]
    if left:
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        pytest.fail(f"test left {len(left)} asyncio task(s) running: {sorted(t.get_name() for t in left)}")


@pytest.fixture(autouse=True)
def _private_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    yield


@pytest.fixture
def provider() -> FakeProvider:
    fake = FakeProvider()
    fake.add_job("llm-finetune", min_workers=1, max_workers=4, desired=2)
    fake.add_job("other-job", min_workers=1, max_workers=4, desired=1)
    return fake


@pytest.fixture
async def api(provider: FakeProvider) -> AsyncIterator[ProviderApi]:
    async with ProviderApi(base_url="http://provider", token=provider.token, transport=provider.transport,
                           retry_delay=0.001) as client:
        yield client


@pytest.fixture
def bus() -> MemoryBroker:
    return MemoryBroker(tenant="acme", ack_wait=0.3)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[HandledStore]:
    with HandledStore(tmp_path / "state" / "handled.sqlite3") as handled:
        yield handled


@pytest.fixture
async def cloud(
    tmp_path: Path, nats_server: NatsServer, tenant_broker: NatsTenantBroker, provider_secret: bytes
) -> AsyncIterator[LiveCloud]:
    """Real broker + real API (uvicorn on a free port) + tenant acme; see live_cloud.py."""
    async with live_cloud(
        tmp_path / "hz", nats_server=nats_server, tenant_broker=tenant_broker, provider_secret=provider_secret
    ) as world:
        yield world
