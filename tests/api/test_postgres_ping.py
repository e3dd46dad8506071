"""The pool's pre-ping on PostgreSQL (`api.db`): one query, only for an idle connection, and a dead one replaced.

On a real PostgreSQL server, through the app's own engine: what reaches the server between an idle pooled
connection's checkout and the request's first statement is one `SELECT 1` (SQLAlchemy's own ping for asyncpg sends
BEGIN, a query and ROLLBACK), read off asyncpg's query log of that connection; a connection back in the pool for
less than `ping_after_idle_s` gets no ping at all; an idle connection whose server process was ended (as a database
restart or a cut network would) is replaced at checkout, so the request that takes it next still succeeds, on a new
server process; and one that died within the window fails the request that takes it, the pool replacing it for the
next.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from api.db import make_engine
from harmonaize.settings import Settings
from tests.support import eventually

pytestmark = pytest.mark.postgres


async def _sent_by_a_checkout(engine: AsyncEngine) -> list[str]:
    """What a checkout of the pooled connection sends besides the request's own (prepared) statement."""
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
    return sent


async def test_an_idle_connection_gets_one_query_before_the_first_statement(postgres_settings: Settings) -> None:
    engine = make_engine(postgres_settings.resolved_database_url, ping_after_idle_s=0)  # every checkout is "idle"
    try:
        sent = await _sent_by_a_checkout(engine)
    finally:
        await engine.dispose()
    # the ping, then the connection's own transaction; SQLAlchemy's ping would add its own BEGIN and ROLLBACK
    assert sent == ["SELECT 1", "BEGIN;", "ROLLBACK;"], sent


async def test_a_connection_used_moments_ago_is_handed_out_unpinged(postgres_settings: Settings) -> None:
    engine = make_engine(postgres_settings.resolved_database_url, ping_after_idle_s=3600)
    try:
        sent = await _sent_by_a_checkout(engine)
    finally:
        await engine.dispose()
    assert sent == ["BEGIN;", "ROLLBACK;"], sent


async def _terminate_the_pooled_connection(engine: AsyncEngine, url: str) -> int:
    """End the server process of `engine`'s one pooled connection, as a database restart would; its pid."""
    async with engine.connect() as connection:
        pid = int(await connection.scalar(text("SELECT pg_backend_pid()")))
    other = make_engine(url, single_use=True)
    try:
        async with other.connect() as connection:
            assert await connection.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            await connection.commit()
    finally:
        await other.dispose()
    return pid


async def test_an_idle_connection_whose_server_process_ended_is_replaced_at_checkout(
    postgres_settings: Settings,
) -> None:
    url = postgres_settings.resolved_database_url
    engine = make_engine(url, ping_after_idle_s=0)
    try:
        pid = await _terminate_the_pooled_connection(engine, url)
        async with engine.connect() as connection:  # the pooled connection is dead: the ping says so
            new_pid = await connection.scalar(text("SELECT pg_backend_pid()"))
        assert new_pid not in (None, pid)
    finally:
        await engine.dispose()


async def test_a_connection_that_died_within_the_window_fails_one_request_and_is_replaced(
    postgres_settings: Settings,
) -> None:
    url = postgres_settings.resolved_database_url
    engine = make_engine(url, ping_after_idle_s=3600)
    try:
        pid = await _terminate_the_pooled_connection(engine, url)
        with pytest.raises(DBAPIError) as failed:
            async with engine.connect() as connection:
                await connection.scalar(text("SELECT 1"))
        assert failed.value.connection_invalidated, "the pool knows the connection is gone"
        async with engine.connect() as connection:
            new_pid = await connection.scalar(text("SELECT pg_backend_pid()"))
        assert new_pid not in (None, pid)
    finally:
        await engine.dispose()
