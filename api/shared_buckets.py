"""The negotiation pace's token buckets in PostgreSQL, one per tenant for every API replica (`api.limits`).

One statement takes a token: an upsert that refills the bucket by the time since its last grant (the database's
clock, the same for all replicas) and takes one only if one is there, returning a row only when it did. It runs on an
autocommit connection, outside the request's transaction, so the bucket's row is locked for that one statement
rather than for the whole request; only a refused write pays a second statement, to say how long to wait.

The connection comes from a small pool of its own: when the limiter runs, the request's session already holds a
connection of the main pool (the token lookup), so taking a second one from that pool would deadlock as soon as as
many requests wait as the pool has connections. That pool pings nothing before use: a pooled connection that died
(a database restart) fails its statement as a disconnect, and the take runs once more on a fresh one. The
statement is the take's only one, so nothing else can have happened; at worst the lost answer hid a granted token,
and the tenant's bucket is one token lower for a moment. A ping would cost every request a round trip.
"""

from __future__ import annotations

from sqlalchemy import Float, bindparam, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

__all__ = ["POOL_SIZE", "SharedBuckets"]

POOL_SIZE = 4
"""Each take holds its connection for one statement, so a few serve many concurrent requests."""

_REFILLED = "LEAST(:burst, b.tokens + EXTRACT(EPOCH FROM clock_timestamp() - b.at) * :rate)"
_TAKE = text(
    "INSERT INTO rate_buckets AS b (tenant_id, tokens, at) VALUES (:key, :burst - 1, clock_timestamp()) "
    f"ON CONFLICT (tenant_id) DO UPDATE SET tokens = {_REFILLED} - 1, at = clock_timestamp() "
    f"WHERE {_REFILLED} >= 1 RETURNING b.tokens"
).bindparams(bindparam("burst", type_=Float), bindparam("rate", type_=Float))
_LEFT = text(f"SELECT {_REFILLED} FROM rate_buckets AS b WHERE b.tenant_id = :key").bindparams(
    bindparam("burst", type_=Float), bindparam("rate", type_=Float)
)


class SharedBuckets:
    """The buckets of the PostgreSQL database at `url`; `aclose` when the app stops."""

    def __init__(self, url: URL) -> None:
        self._engine = create_async_engine(url, pool_size=POOL_SIZE, max_overflow=0, isolation_level="AUTOCOMMIT")

    @property
    def engine(self) -> AsyncEngine:
        return self._engine

    async def take(self, key: str, *, rate_per_s: float, burst: int) -> float:
        """Take one token of `key`'s bucket: 0.0 when granted, otherwise the seconds until a token will be there."""
        try:
            return await self._take(key, rate_per_s=rate_per_s, burst=burst)
        except DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
            return await self._take(key, rate_per_s=rate_per_s, burst=burst)  # a dead pooled connection: once more

    async def _take(self, key: str, *, rate_per_s: float, burst: int) -> float:
        params = {"key": key, "burst": float(burst), "rate": rate_per_s}
        async with self._engine.connect() as connection:
            if (await connection.execute(_TAKE, params)).first() is not None:
                return 0.0
            left = await connection.scalar(_LEFT, params)
        return max(0.0, (1.0 - float(left or 0.0)) / rate_per_s)

    async def aclose(self) -> None:
        await self._engine.dispose()
