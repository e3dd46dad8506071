"""Bounds on what one caller can make the API do: the size of a request body, and the pace of negotiation writes.

Body size. `BodySizeLimit` (pure ASGI, outside the routes) reads a request's body into memory only up to the limit:
a declared `Content-Length` over it is refused before a byte is read, and a body without one (chunked) is refused as
soon as it grows past the limit. The refusal is a 413 in the API's one error shape, naming the limit and the setting
that raises it. Beyond the body, every string, list and number a route accepts is bounded by its schema (a 422 naming
the field); tests/security walks the OpenAPI document to keep it that way.

Negotiation pace. Every write to the negotiation routes (open, accept, counter, reject, cancel) takes a token from the
caller's bucket: `negotiation_burst` tokens, refilled at `negotiation_rate_per_s`. An empty bucket is a 429 with
`Retry-After` (whole seconds until the next token) and a reason; reads are never limited. A controller negotiates a
few times a minute, so the defaults (burst 200, 20/s) only ever stop a runaway loop, which would otherwise hold the
ledger lock and the database's single writer for every other tenant. On PostgreSQL the buckets live in the database
(`api.shared_buckets`), so any number of API replicas share one bucket per tenant; on SQLite, with its one API
process per database file, they live in that process's memory. The key is the authenticated tenant, so
unauthenticated callers cannot grow the table (they are refused before the limiter runs).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, HTTPException, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import NegotiationCallDep
from api.errors import error_response
from api.schemas import ErrorDetail, ErrorPublic
from api.shared_buckets import SharedBuckets
from harmonaize.settings import Settings

BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
LIMITED_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})

RATE_LIMITED_RESPONSE: dict[int | str, dict[str, object]] = {
    429: {
        "model": ErrorPublic,
        "description": "Too many negotiation requests from this tenant; retry after `Retry-After` seconds.",
        "headers": {
            "Retry-After": {"description": "Seconds until a request is allowed.", "schema": {"type": "integer"}}
        },
    }
}
BODY_TOO_LARGE_RESPONSE: dict[int | str, dict[str, object]] = {
    413: {"model": ErrorPublic, "description": "The request body is larger than the API accepts."}
}


@dataclass(frozen=True)
class ApiLimits:
    """The limits an app enforces, read from the settings (`HZ_API_MAX_BODY_BYTES`, `HZ_NEGOTIATION_RATE_PER_S`,
    `HZ_NEGOTIATION_BURST`)."""

    max_body_bytes: int = 1024 * 1024
    negotiation_rate_per_s: float = 20.0
    negotiation_burst: int = 200

    @classmethod
    def from_settings(cls, settings: Settings) -> ApiLimits:
        return cls(
            max_body_bytes=settings.api_max_body_bytes,
            negotiation_rate_per_s=settings.negotiation_rate_per_s,
            negotiation_burst=settings.negotiation_burst,
        )


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class TokenBuckets:
    """One token bucket per key; `rate_per_s == 0` turns limiting off."""

    rate_per_s: float
    burst: int
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, _Bucket] = field(default_factory=dict, repr=False)

    def take(self, key: str) -> float:
        """Take one token for `key`: 0.0 when granted, otherwise the seconds until a token will be there."""
        if self.rate_per_s <= 0:
            return 0.0
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(tokens=float(self.burst), at=now)
        bucket.tokens = min(float(self.burst), bucket.tokens + max(0.0, now - bucket.at) * self.rate_per_s)
        bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate_per_s


async def limit_negotiation_writes(request: Request, call: NegotiationCallDep) -> None:
    """Router dependency of the negotiation routes: writes take a token from the tenant's bucket, reads pass. Takes
    the routes' own `NegotiationCall` (solved once per request): one session, one authentication."""
    tenant = call.tenant
    if request.method not in LIMITED_METHODS:
        return
    buckets: TokenBuckets = request.app.state.negotiation_buckets
    shared: SharedBuckets | None = getattr(request.app.state, "shared_buckets", None)
    if buckets.rate_per_s > 0 and shared is not None:
        wait = await shared.take(tenant.id, rate_per_s=buckets.rate_per_s, burst=buckets.burst)
    else:
        wait = buckets.take(tenant.id)
    if wait > 0:
        retry_after = max(1, math.ceil(wait))
        raise HTTPException(
            429,
            f"too many negotiation requests: at most {buckets.burst} at once and {buckets.rate_per_s:g} per second "
            f"per tenant; retry in {retry_after} s",
            headers={"Retry-After": str(retry_after)},
        )


class BodySizeLimit:
    """Refuse request bodies over `max_bytes` with a 413 (our error shape); pass everything else through unchanged."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, size=f"{declared} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, size=f"more than {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, *, size: str) -> None:
        limit = f"at most {self.max_bytes} bytes (HZ_API_MAX_BODY_BYTES)"
        response = error_response(
            413,
            f"request body too large: {size}, the limit is {limit}",
            errors=[ErrorDetail(field="body", message=limit)],
            headers={"Connection": "close"},
        )
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app the body already read, then defers to the server (disconnect notices)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def install_limits(app: FastAPI, limits: ApiLimits) -> None:
    """Add the body-size middleware and the negotiation buckets to `app` (the routes add the dependency)."""
    app.state.limits = limits
    app.state.negotiation_buckets = TokenBuckets(
        rate_per_s=limits.negotiation_rate_per_s, burst=limits.negotiation_burst
    )
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)
