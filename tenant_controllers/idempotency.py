"""Idempotency keys for negotiation requests: one per logical request, reused whenever that request is sent again.

Two kinds of "again" exist, and both must replay instead of opening a second negotiation:

* the HTTP client resends a POST after a timeout or a 5xx: it reuses the key it generated (see `api_client`);
* the controller was killed after a handler's request reached the provider but before the event's outcome was
  committed, so after the restart JetStream redelivers the event and the handler runs again from the top.

For the second case a key cannot be random. Inside a handler the key is derived from what identifies "the same
request of the same run of this handler for this event": controller, CloudEvent id, handler, attempt number, the
position of the call inside the handler, and the request body. A redelivered event re-runs attempt 1 and gets the same
keys, so the provider replays its earlier answers. A *retry* (attempt 2, after a TemporaryError or a declined offer)
gets new keys on purpose: the handler asks again because it wants a fresh answer. A different body never reuses a key,
so a handler that asks for something else after a restart (the job changed meanwhile) opens a new negotiation.

Outside a handler (resync handlers, scripts) keys are random: there is no event id to tie them to.
"""

from __future__ import annotations

import contextvars
import hashlib
import itertools
import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HandlerInvocation", "current_failed_host", "current_traceparent", "invocation", "new_idempotency_key"]


@dataclass
class HandlerInvocation:
    """One attempt of one handler on one event."""

    controller: str
    event_id: str
    handler: str
    attempt: int
    traceparent: str | None = None
    """The event's trace continued (a new span): sent as `traceparent` on the handler's API calls."""
    failed_host: str | None = None
    """The host a Failure event names (the tenant's pseudonym): a scale request in its handler replaces it."""
    _calls: Iterator[int] = field(default_factory=itertools.count)

    def next_call(self) -> int:
        return next(self._calls)


_current: contextvars.ContextVar[HandlerInvocation | None] = contextvars.ContextVar("hz_invocation", default=None)


@contextmanager
def invocation(current: HandlerInvocation) -> Iterator[HandlerInvocation]:
    """Mark the code inside as one handler attempt, so requests it makes get deterministic keys."""
    token = _current.set(current)
    try:
        yield current
    finally:
        _current.reset(token)


def current_traceparent() -> str | None:
    """The trace of the event whose handler is running, if it carried one."""
    current = _current.get()
    return None if current is None else current.traceparent


def current_failed_host() -> str | None:
    """The host of the Failure event whose handler is running, if it is one."""
    current = _current.get()
    return None if current is None else current.failed_host


def new_idempotency_key(scope: str, body: Any) -> str:
    """A key for one logical request to `scope` (e.g. `POST /v1/negotiations`) with this JSON `body`."""
    current = _current.get()
    if current is None:
        return f"hz-{uuid.uuid4().hex}"
    material = json.dumps(
        [current.controller, current.event_id, current.handler, current.attempt, current.next_call(), scope, body],
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    )
    return f"hz-{hashlib.sha256(material.encode()).hexdigest()[:40]}"
