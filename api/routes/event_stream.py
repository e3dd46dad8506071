"""A tenant's events as Server-Sent Events (`GET /v1/events/stream`), for the web console's feed.

The same CloudEvents the tenant receives on NATS (each `data:` is the structured-mode body exactly as published,
`event:` its kind, `id:` its sequence in the tenant's stream), for the caller's own tenant only: the feed is built
from `CurrentTenant`'s id (`api.services.event_feed`). A stream starts after the sequence in `?after=` or the
standard `Last-Event-ID` header (a reconnecting client's last id: nothing the stream still holds is missed), else with
the last `?backlog=` messages of the tenant's stream (default 50; 0: only what comes next). The first message is
`event: ready` (the tenant, and `from`: the first sequence it reads) once the feed exists on the broker; a comment line
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

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from api.deps import CurrentTenant, SessionDep
from api.services.errors import BrokerUnavailableError, InvalidRequestError
from api.services.event_feed import BACKLOG, MAX_BACKLOG, FeedEvent, TenantEventFeed

router = APIRouter(tags=["events"])



@dataclass(frozen=True)
class StreamLimits:
    """How long one stream lasts before the client must reconnect, and how often an idle one sends a comment."""

    max_s: float = 300.0
    keepalive_s: float = 15.0


_HEADERS: Final = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


def sse(event: str, data: bytes | str, *, event_id: int | None = None) -> bytes:
    """One SSE message; every line of `data` gets its own `data:` field, as the format requires."""
    text = data.decode() if isinstance(data, bytes) else data
    lines = "".join(f"data: {line}\n" for line in text.splitlines() or [""])
    id_line = "" if event_id is None else f"id: {event_id}\n"
    return f"event: {event}\n{id_line}{lines}\n".encode()


def _message(event: FeedEvent) -> bytes:
    dropped = sse("dropped", json.dumps({"count": event.dropped})) if event.dropped else b""
    return dropped + sse(event.kind, event.payload, event_id=event.sequence)


def _resume_point(after: int | None, last_event_id: str | None) -> int | None:
    if after is not None or last_event_id is None:
        return after
    if not last_event_id.isdigit():
        raise InvalidRequestError(f"Last-Event-ID must be a stream sequence (digits), got {last_event_id[:40]!r}")
    return int(last_event_id)


async def _stream(feed: TenantEventFeed, tenant_id: str, limits: StreamLimits, *, start: int) -> AsyncIterator[bytes]:
    deadline = time.monotonic() + limits.max_s
    try:
        async with feed.subscribe(tenant_id, start=start) as reader:
            yield sse("ready", json.dumps({"tenant": tenant_id, "from": reader.start}))
            while (left := deadline - time.monotonic()) > 0:
                event = await reader.next(min(limits.keepalive_s, left))
                if reader.closed:
                    yield sse("end", json.dumps({"reason": "shutdown"}))
                    return
                yield b": keep-alive\n\n" if event is None else _message(event)
            yield sse("end", json.dumps({"reason": "reconnect"}))
    except BrokerUnavailableError as exc:  # the feed could not be made (the broker went away since `start_of`)
        yield sse("end", json.dumps({"reason": "unavailable", "detail": str(exc)}))


@router.get("/events/stream", include_in_schema=False)
async def event_stream(
    request: Request,
    tenant: CurrentTenant,
    session: SessionDep,
    after: int | None = Query(default=None, ge=0, description="Start after this stream sequence."),
    backlog: int = Query(default=BACKLOG, ge=0, le=MAX_BACKLOG, description="Without after: replay this many."),
    last_event_id: str | None = Header(default=None),
) -> StreamingResponse:
    """The caller's events (SSE), resumable; 503 when the broker cannot be reached."""
    feed: TenantEventFeed = request.app.state.event_feed
    tenant_id = tenant.id
    start_after = _resume_point(after, last_event_id)
    await session.close()  # the stream outlives the request's database work: give the connection back now
    start = await feed.start_of(tenant_id, after=start_after, backlog=backlog)
    limits: StreamLimits = getattr(request.app.state, "event_stream_limits", StreamLimits())
    return StreamingResponse(
        _stream(feed, tenant_id, limits, start=start),
        media_type="text/event-stream",
        headers=_HEADERS,
    )
