"""The negotiation pace's shared buckets on PostgreSQL (`api.shared_buckets`): one statement per take, no ping, and
a pooled connection that died is replaced without failing the take.

On a real PostgreSQL server (the migrated test database): a granted take sends one statement and no pre-ping; after
the server process of the bucket's pooled connection is ended (as a database restart or a cut network would), the
next take still answers, on a new server process, and the bucket grants exactly its burst in all.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.engine import make_url

from api.db import make_engine
from api.shared_buckets import SharedBuckets
from harmonaize.settings import Settings
from harmonaize.timeids import uuid7

pytestmark = pytest.mark.postgres

BURST = 5


async def _pooled_pid(buckets: SharedBuckets) -> int:
    """The server process of the bucket pool's connection (the pool holds one: the takes run one at a time)."""
    async with buckets.engine.connect() as connection:
        return int(await connection.scalar(text("SELECT pg_backend_pid()")))


async def test_a_take_is_one_statement_and_survives_a_dead_pooled_connection(postgres_migrated: Settings) -> None:
    buckets = SharedBuckets(make_url(postgres_migrated.resolved_database_url))
    key = f"tenant-{uuid7()}"
    statements: list[str] = []
    pings: list[object] = []

    def on_execute(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)

    sync_engine = buckets.engine.sync_engine
    event.listen(sync_engine, "before_cursor_execute", on_execute)
    ping = sync_engine.dialect.do_ping

    def counted_ping(connection: Any) -> bool:
        pings.append(connection)
        return bool(ping(connection))

    sync_engine.dialect.do_ping = counted_ping  # type: ignore[method-assign, assignment]
    try:
        assert await buckets.take(key, rate_per_s=0.001, burst=BURST) == 0.0  # connects
        statements.clear()
        assert await buckets.take(key, rate_per_s=0.001, burst=BURST) == 0.0  # the pooled connection
        assert len(statements) == 1 and statements[0].startswith("INSERT INTO rate_buckets"), statements
        assert pings == [], "no pre-ping"
        pid = await _pooled_pid(buckets)
        killer = make_engine(postgres_migrated.resolved_database_url, single_use=True)
        try:
            async with killer.connect() as connection:
                assert await connection.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        finally:
            await killer.dispose()
        granted = 2
        while await buckets.take(key, rate_per_s=0.001, burst=BURST) == 0.0:  # the first on a fresh connection
            granted += 1
            assert granted <= BURST, "more tokens than the burst"
        assert granted == BURST, "the take on the dead connection took no token; each later one took one"
        assert await _pooled_pid(buckets) != pid
    finally:
        event.remove(sync_engine, "before_cursor_execute", on_execute)
        await buckets.aclose()
