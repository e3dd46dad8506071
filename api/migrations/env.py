"""Alembic environment: metadata from `api.models`, URL from the HarmonAIze settings, async engines.

Three ways in:
- `api.migrate` (the app, `harmonaize db upgrade`, tests) opens an async connection itself and passes its sync face as
  `config.attributes["connection"]`; we run on it, inside the caller's transaction.
- the alembic CLI, or `api.migrate` without a connection: we build an engine from `config.attributes["settings"]`
  (or `Settings()` from the environment) and drive it with `run_sync`.
- offline (`--sql`): render SQL for the configured URL.
SQLite gets `render_as_batch=True`, since it can alter a table only by recreating it.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from api.db import is_sqlite, make_engine
from api.models import Base
from harmonaize.settings import Settings

config = context.config
target_metadata = Base.metadata


def _database_url() -> str:
    settings: Settings | None = config.attributes.get("settings")
    if settings is None:
        settings = Settings()
    return settings.resolved_database_url


def _run_on(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_with_own_engine(url: str) -> None:
    engine = make_engine(url, single_use=True, foreign_keys=False)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run_on)
            await connection.commit()
    finally:
        await engine.dispose()


def _run_offline() -> None:
    url = _database_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        compare_type=True,
        literal_binds=True,
        render_as_batch=is_sqlite(url),
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_on(connection)
    else:
        asyncio.run(_run_with_own_engine(_database_url()))


if context.is_offline_mode():
    _run_offline()
else:
    _run_online()
