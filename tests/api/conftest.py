"""Fixtures for the control-plane API tests: databases on both backends, the app with its lifespan, a client.

Databases:
- `sqlite_settings` / `postgres_settings`: an EMPTY database (for migration tests), one per test.
- `migrated_settings`: a database at the Alembic head with empty tables, parametrised over SQLite and PostgreSQL.
  Migrating once per session is much cheaper than per test: SQLite copies a migrated file (sqlite3 backup API);
  PostgreSQL truncates the tables of one migrated database (CREATE DATABASE from a migrated template costs ~0.4 s).
- `engine`: an engine as the app makes it, on `migrated_settings`, for tests below the HTTP layer.
PostgreSQL comes from HZ_TEST_POSTGRES_URL (default: postgres@127.0.0.1:5432, trust auth). Unreachable: the
PostgreSQL variants are skipped, saying so; with CI set they fail instead, because CI always provides one.

The app runs its real lifespan (`app.router.lifespan_context`), so every test passes the schema check and the
broker reconciliation, against `InMemoryBroker`, a real in-memory implementation of the broker port. Negotiations
read time from `clock` (a `FakeClock` a test moves by hand) and carbon from the shipped trace anchored at its start;
the sweeper is started but idle (a test that wants a sweep calls `sweep_once`), and no bus is given (the outbox
accumulates; tests/api/test_outbox_relay.py and tests/e2e deliver it).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sqlite3
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from api import migrate
from api.app import create_app
from api.db import make_engine
from api.models import Base
from api.options import NegotiationOptions
from harmonaize.settings import Settings
from tests.api.api_memory_broker import InMemoryBroker
from tests.api.api_testkit import ADMIN_TOKEN, PROVIDER_SECRET, FakeClock, TenantHandle, create_tenant

DEFAULT_POSTGRES_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
_T = TypeVar("_T")


def make_settings(**overrides: Any) -> Settings:
    """Settings isolated from the developer's environment and .env file."""
    values: dict[str, Any] = {"admin_token": ADMIN_TOKEN, "provider_secret": PROVIDER_SECRET}
    values.update(overrides)
    return Settings(_env_file=None, **values)


def run_blocking(make_coroutine: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run a coroutine to completion from sync code, on its own loop in a worker thread (session fixtures)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(make_coroutine())).result()


class PostgresServer:
    """Creates and drops uniquely named databases on the test server."""

    def __init__(self, url: URL) -> None:
        self.url = url

    def _dsn(self) -> str:
        return self.url.set(drivername="postgresql").render_as_string(hide_password=False)

    async def _execute(self, statement: str) -> None:
        connection = await asyncpg.connect(self._dsn(), timeout=5)
        try:
            await connection.execute(statement)
        finally:
            await connection.close()

    async def probe(self) -> None:
        await self._execute("SELECT 1")

    async def create(self, *, template: str = "template0", prefix: str = "hz_test") -> str:
        name = f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"
        await self._execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        return name

    async def drop(self, name: str) -> None:
        await self._execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def settings_for(self, database: str) -> Settings:
        url = self.url.set(database=database).render_as_string(hide_password=False)
        return make_settings(database_url=url)


@pytest.fixture(scope="session")
def postgres_server() -> PostgresServer:
    url = make_url(os.environ.get("HZ_TEST_POSTGRES_URL") or DEFAULT_POSTGRES_URL)
    server = PostgresServer(url)
    try:
        run_blocking(server.probe)
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        where = url.render_as_string(hide_password=True)
        message = f"PostgreSQL is unreachable at {where} ({type(exc).__name__}: {exc}); set HZ_TEST_POSTGRES_URL"
        if os.environ.get("CI"):
            pytest.fail(f"{message}. CI must provide PostgreSQL.")
        pytest.skip(message)
    return server


@pytest.fixture
async def postgres_settings(postgres_server: PostgresServer) -> AsyncIterator[Settings]:
    """A fresh, empty PostgreSQL database for this test, dropped afterwards."""
    name = await postgres_server.create()
    try:
        yield postgres_server.settings_for(name)
    finally:
        await postgres_server.drop(name)


@pytest.fixture
def sqlite_settings(tmp_path: Path) -> Settings:
    """A fresh, empty SQLite database in this test's tmp_path."""
    return make_settings(data_dir=tmp_path)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def empty_settings(backend: str, request: pytest.FixtureRequest) -> Settings:
    """An empty database on each backend."""
    return request.getfixturevalue(f"{backend}_settings")


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    settings = make_settings(data_dir=tmp_path_factory.mktemp("sqlite-template"))
    migrate.upgrade(settings)
    return settings.data_dir / "harmonaize.db"


@pytest.fixture(scope="session")
def postgres_migrated(postgres_server: PostgresServer) -> Iterator[Settings]:
    """One migrated PostgreSQL database for the session, emptied before each test that uses it."""
    name = run_blocking(lambda: postgres_server.create(prefix="hz_migrated"))
    try:
        settings = postgres_server.settings_for(name)
        migrate.upgrade(settings)
        yield settings
    finally:
        run_blocking(lambda: postgres_server.drop(name))


async def _empty_all_tables(settings: Settings) -> None:
    engine = make_engine(settings.resolved_database_url, single_use=True)
    tables = ", ".join(table.name for table in Base.metadata.sorted_tables)
    try:
        async with engine.begin() as connection:
            await connection.execute(text("SET LOCAL lock_timeout = '5s'"))
            await connection.execute(text(f"TRUNCATE TABLE {tables}"))
    finally:
        await engine.dispose()


@pytest.fixture
async def migrated_settings(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Settings:
    """A database at the Alembic head with empty tables, on each backend, private to this test.

    SQLite: a copy of a migrated file. PostgreSQL: the session's migrated database, truncated; equivalent to a fresh
    one because migrations insert no rows and no key comes from a sequence, and ~30x cheaper than CREATE DATABASE
    from a migrated template (~0.4 s each on this machine).
    """
    if backend == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        with sqlite3.connect(template) as source, sqlite3.connect(tmp_path / "harmonaize.db") as target:
            source.backup(target)
        return make_settings(data_dir=tmp_path)
    settings: Settings = request.getfixturevalue("postgres_migrated")
    await _empty_all_tables(settings)
    return settings


@pytest.fixture
async def engine(migrated_settings: Settings) -> AsyncIterator[AsyncEngine]:
    """An engine of the app's kind (`api.db.make_engine`) on `migrated_settings`, disposed after the test."""
    engine = make_engine(migrated_settings.resolved_database_url)
    try:
        yield engine
    finally:
        await engine.dispose()


@pytest.fixture
def broker() -> InMemoryBroker:
    return InMemoryBroker()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def negotiation_options(clock: FakeClock) -> NegotiationOptions:
    return NegotiationOptions(clock=clock, sweep_interval_s=3600.0)


@pytest.fixture
async def app(
    migrated_settings: Settings, broker: InMemoryBroker, negotiation_options: NegotiationOptions
) -> AsyncIterator[FastAPI]:
    """The API, started (schema checked, broker reconciled) and shut down around the test."""
    application = create_app(migrated_settings, broker=broker, negotiation=negotiation_options)
    async with application.router.lifespan_context(application):
        yield application


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://hz.test") as http:
        yield http


@pytest.fixture
async def acme(client: httpx.AsyncClient) -> TenantHandle:
    return await create_tenant(client, "acme", display_name="Acme Corporation")


@pytest.fixture
async def globex(client: httpx.AsyncClient) -> TenantHandle:
    return await create_tenant(client, "globex", display_name="Globex Secret Projects")
