"""Fixtures of the fault-injection suite: the real broker and API (tests/controllers/live_cloud.py), a private
PostgreSQL database (HZ_TEST_POSTGRES_URL, as in tests/api: skipped when unreachable, failed under CI), and hygiene.

Autouse: a test that leaves asyncio tasks running fails, since a fault test that leaks a task would
make the next one flaky; each test runs in its own working directory.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import asyncpg
import pytest
from sqlalchemy.engine import URL, make_url

from tests.api.conftest import DEFAULT_POSTGRES_URL, PostgresServer

# The same hygiene (autouse) and the same real broker + API + tenant acme as the controllers tier.
from tests.controllers.conftest import _no_tasks_left_behind, _private_cwd, cloud  # noqa: F401


@pytest.fixture
async def postgres_url() -> AsyncIterator[URL]:
    """A fresh, empty PostgreSQL database for this test (dropped afterwards)."""
    server = PostgresServer(make_url(os.environ.get("HZ_TEST_POSTGRES_URL") or DEFAULT_POSTGRES_URL))
    try:
        await server.probe()
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        message = f"PostgreSQL is unreachable ({type(exc).__name__}: {exc}); set HZ_TEST_POSTGRES_URL"
        if os.environ.get("CI"):
            pytest.fail(f"{message}. CI must provide PostgreSQL.")
        pytest.skip(message)
    name = await server.create(prefix="hz_faults")
    try:
        yield server.url.set(database=name)
    finally:
        await server.drop(name)
