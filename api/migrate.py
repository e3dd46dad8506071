"""Run the Alembic migrations from code: `harmonaize db upgrade`, the app's start-up check, tests.

The Alembic config is built here (script_location = the installed `api.migrations` package), so no alembic.ini is needed
and the URL always comes from `Settings`. Each async function opens an async engine, and hands Alembic the sync face
of one connection through `Config.attributes` (Alembic's documented connection-sharing recipe), so migrations run in
the caller's event loop. The sync functions are for sync callers (the CLI); because Alembic's API is itself sync and
must not nest `asyncio.run`, they run the async version on a fresh loop, in a worker thread when the calling thread
already has a running loop. Never call a sync function from a coroutine you care about the latency of: it blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from api import migrations
from api.db import make_engine
from harmonaize.settings import Settings

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent
UPGRADE_COMMAND = "harmonaize db upgrade"

_T = TypeVar("_T")


class SchemaNotCurrentError(RuntimeError):
    """The database is not at the revision this code was written for; the app refuses to start on it."""


def alembic_config(settings: Settings | None = None, *, connection: Connection | None = None) -> Config:
    """An Alembic config for our migrations; `settings` and `connection` travel to env.py via `attributes`."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if settings is not None:
        config.attributes["settings"] = settings
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """The newest revision in `api/migrations/versions` (the schema this code expects)."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no migrations found in {MIGRATIONS_DIR}")
    return head


async def _with_connection(settings: Settings, action: Callable[[Connection], _T]) -> _T:
    engine = make_engine(settings.resolved_database_url, single_use=True, foreign_keys=False)
    try:
        async with engine.begin() as connection:
            return await connection.run_sync(action)
    finally:
        await engine.dispose()


async def upgrade_async(settings: Settings, revision: str = "head") -> None:
    """Migrate the database of `settings` up to `revision`."""
    await _with_connection(
        settings, lambda conn: command.upgrade(alembic_config(settings, connection=conn), revision)
    )


async def downgrade_async(settings: Settings, revision: str) -> None:
    """Migrate the database of `settings` down to `revision` (`"base"` drops everything we created)."""
    await _with_connection(
        settings, lambda conn: command.downgrade(alembic_config(settings, connection=conn), revision)
    )


def _current_of(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


async def current_async(settings: Settings) -> str | None:
    """The revision the database is at; None for a database never migrated."""
    return await _with_connection(settings, _current_of)


async def check_schema_current(engine: AsyncEngine) -> None:
    """Raise SchemaNotCurrentError, naming the command to run, unless the database is at our head revision.

    Starting on an older schema would fail later, on the first query that touches a missing column, with an error
    that says nothing about the cause; starting on a newer one could silently write rows a newer code base reads
    wrongly. Both are refused here, once, with the fix in the message.
    """
    async with engine.connect() as connection:
        current = await connection.run_sync(_current_of)
    head = head_revision()
    if current == head:
        return
    where = make_url(engine.url).render_as_string(hide_password=True)
    if current is None:
        state = "has no HarmonAIze schema (never migrated)"
    else:
        state = f"is at schema revision {current}"
    raise SchemaNotCurrentError(
        f"the database {where} {state}, but this code needs revision {head}. "
        f"Run `{UPGRADE_COMMAND}` (with the same HZ_ settings) before starting the API."
    )


def _run_blocking(make_coroutine: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coroutine())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hz-migrate") as pool:
        return pool.submit(lambda: asyncio.run(make_coroutine())).result()


def upgrade(settings: Settings, revision: str = "head") -> None:
    """Sync `upgrade_async`, for the CLI (`harmonaize db upgrade`)."""
    _run_blocking(lambda: upgrade_async(settings, revision))


def downgrade(settings: Settings, revision: str) -> None:
    """Sync `downgrade_async`, for the CLI."""
    _run_blocking(lambda: downgrade_async(settings, revision))


def current(settings: Settings) -> str | None:
    """Sync `current_async`, for the CLI."""
    return _run_blocking(lambda: current_async(settings))
