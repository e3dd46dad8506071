"""A tenant's live events as Server-Sent Events (`GET /v1/events/stream`), for the web console's feed.

The same CloudEvents the tenant receives on NATS (each `data:` is the structured-mode body exactly as published,
`event:` its kind), for the caller's own tenant only: the subscription is built from `CurrentTenant`'s id
(`api.services.event_feed`). Live only: what was published before the stream opened is on the tenant's JetStream
stream, not here. The first message is `event: ready` once the subscription is live on the broker; a comment line
every `keepalive_s` keeps proxies from closing an idle stream; after `max_s` the stream ends with `event: end` and
the client reconnects, which authenticates its token again (a revoked tenant stops getting events). Both limits are
`StreamLimits`, from `app.state.event_stream_limits` where set.

A stream also ends when its client goes away (Starlette cancels it; the subscription is dropped on the way out) and
when the app shuts down: the lifespan's shutdown closes the feed, which ends every stream with `event: end`. uvicorn
runs the lifespan's shutdown only after its graceful window for requests in flight (`api.serving`, 10 s), and
cancels the streams still open then, which drops their subscriptions the same way.

Not in the OpenAPI document: an endless `text/event-stream` has no response schema to describe, and the document's
walkers (the route classification and the schema fuzzer in tests/) read each response to its end. Its scoping and
authentication are tested in tests/console/test_event_stream.py instead.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from api.deps import CurrentTenant, SessionDep
from api.services.event_feed import FeedEvent, TenantEventFeed

router = APIRouter(tags=["events"])



@dataclass(frozen=True)
class StreamLimits:
    """How long one stream lasts before the client must reconnect, and how often an idle one sends a comment."""

    max_s: float = 300.0
    keepalive_s: float = 15.0


_HEADERS: Final = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


def sse(event: str, data: bytes | str) -> bytes:
    """One SSE message; every line of `data` gets its own `data:` field, as the format requires."""
    text = data.decode() if isinstance(data, bytes) else data
    lines = "".join(f"data: {line}\n" for line in text.splitlines() or [""])
    return f"event: {event}\n{lines}\n".encode()


def _message(event: FeedEvent) -> bytes:
    dropped = sse("dropped", json.dumps({"count": event.dropped})) if event.dropped else b""
    return dropped + sse(event.kind, event.payload)


async def _stream(feed: TenantEventFeed, tenant_id: str, limits: StreamLimits) -> AsyncIterator[bytes]:
    deadline = time.monotonic() + limits.max_s
    async with feed.subscribe(tenant_id) as reader:
        yield sse("ready", json.dumps({"tenant": tenant_id}))
        while (left := deadline - time.monotonic()) > 0:
            event = await reader.next(min(limits.keepalive_s, left))
            if reader.closed:
                yield sse("end", json.dumps({"reason": "shutdown"}))
                return
            yield b": keep-alive\n\n" if event is None else _message(event)
        yield sse("end", json.dumps({"reason": "reconnect"}))


@router.get("/events/stream", include_in_schema=False)
async def event_stream(request: Request, tenant: CurrentTenant, session: SessionDep) -> StreamingResponse:
    """The caller's live events (SSE); 503 when the broker cannot be reached."""
    feed: TenantEventFeed = request.app.state.event_feed
    tenant_id = tenant.id
    await session.close()  # the stream outlives the request's database work: give the connection back now
    await feed.ensure_connected()
    limits: StreamLimits = getattr(request.app.state, "event_stream_limits", StreamLimits())
    return StreamingResponse(
        _stream(feed, tenant_id, limits),
        media_type="text/event-stream",
        headers=_HEADERS,
    )
