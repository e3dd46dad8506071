"""The pool's pre-ping on PostgreSQL (`api.db.ping_postgresql`): one query, and a dead connection replaced.

On a real PostgreSQL server, through the app's own engine: what reaches the server between a pooled connection's
checkout and the request's first statement is one `SELECT 1` (SQLAlchemy's own ping for asyncpg sends BEGIN, a
query and ROLLBACK), read off asyncpg's query log of that connection; and a connection whose server process was
ended (as a database restart or a cut network would) is replaced at checkout, so the request that takes it next
still succeeds, on a new server process.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
from sqlalchemy import text

from api.db import make_engine
from harmonaize.settings import Settings
from tests.support import eventually

pytestmark = pytest.mark.postgres


async def test_a_checkout_sends_one_query_before_the_first_statement(postgres_settings: Settings) -> None:
    engine = make_engine(postgres_settings.resolved_database_url)
    try:
        async with engine.connect() as connection:  # connected: the pool holds one, no longer fresh
            driver = cast(Any, (await connection.get_raw_connection()).driver_connection)
        sent: list[str] = []

        def log(record: Any) -> None:  # asyncpg logs the queries it sends without preparing them
            sent.append(record.query)

        driver.add_query_logger(log)
        try:
            async with engine.connect() as connection:
                assert (await connection.get_raw_connection()).driver_connection == driver, "the pooled one"
                assert await connection.scalar(text("SELECT 41 + 1")) == 42  # prepared: not in the log
            await eventually(lambda: "ROLLBACK;" in sent, what="the connection's end in asyncpg's query log")
        finally:
            driver.remove_query_logger(log)
    finally:
        await engine.dispose()
    # the ping, then the connection's own transaction; SQLAlchemy's ping would add its own BEGIN and ROLLBACK
    assert sent == ["SELECT 1", "BEGIN;", "ROLLBACK;"], sent


async def test_a_connection_whose_server_process_ended_is_replaced_at_checkout(postgres_settings: Settings) -> None:
    engine = make_engine(postgres_settings.resolved_database_url)
    other = make_engine(postgres_settings.resolved_database_url, single_use=True)
    try:
        async with engine.connect() as connection:
            pid = await connection.scalar(text("SELECT pg_backend_pid()"))
        async with other.connect() as connection:
            assert await connection.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            await connection.commit()
        async with engine.connect() as connection:  # the pooled connection is dead: the ping says so
            new_pid = await connection.scalar(text("SELECT pg_backend_pid()"))
        assert new_pid not in (None, pid)
    finally:
        await engine.dispose()
        await other.dispose()
