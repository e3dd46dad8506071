"""Fixtures of the fault-injection suite: the real broker and API (tests/controllers/live_cloud.py), a private
PostgreSQL database (HZ_TEST_POSTGRES_URL, as in tests/api: skipped when unreachable, failed under CI), and hygiene.

Autouse: a test that leaves asyncio tasks running fails (STYLE.md 4), since a fault test that leaks a task would
make the next one flaky; each test runs in its own working directory.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy.engine import URL, make_url

from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from tests.api.conftest import DEFAULT_POSTGRES_URL, PostgresServer
from tests.controllers.conftest import _no_tasks_left_behind, _private_cwd  # noqa: F401  (the same hygiene, autouse)
from tests.controllers.live_cloud import LiveCloud, live_cloud


@pytest.fixture
async def cloud(
    tmp_path: Path, nats_server: NatsServer, tenant_broker: NatsTenantBroker, provider_secret: bytes
) -> AsyncIterator[LiveCloud]:
    """Real broker + real API (uvicorn on a free port, in this process) + tenant acme."""
    async with live_cloud(
        tmp_path / "hz", nats_server=nats_server, tenant_broker=tenant_broker, provider_secret=provider_secret
    ) as world:
        yield world


@pytest.fixture
async def postgres_url() -> AsyncIterator[URL]:
    """A fresh, empty PostgreSQL database for this test (dropped afterwards)."""
    server = PostgresServer(make_url(os.environ.get("HZ_TEST_POSTGRES_URL") or DEFAULT_POSTGRES_URL))
    try:
        await server.probe()
    except (OSError, asyncpg.PostgresError, asyncio.TimeoutError) as exc:
        message = f"PostgreSQL is unreachable ({type(exc).__name__}: {exc}); set HZ_TEST_POSTGRES_URL"
        if os.environ.get("CI"):
            pytest.fail(f"{message}. CI must provide PostgreSQL.")
        pytest.skip(message)
    name = await server.create(prefix="hz_faults")
    try:
        yield server.url.set(database=name)
    finally:
        await server.drop(name)
