"""Structured logs: one JSON object per line, carrying the ids of whatever is being handled when it is written.

The ids live in a per-task context (a `ContextVar` holding one mutable mapping), so a log call never has to pass them:

* the request middleware (`api.observability`) opens a context per HTTP request with a request id and the caller's
  W3C `traceparent`, when it sent a valid one;
* `current_tenant` adds the tenant, and a router dependency adds the ids in the path (job, negotiation, tenant);
* the outbox relay opens a context per message it delivers, with the event id.

Any record emitted meanwhile, by the API, SQLAlchemy or a library, carries those fields. The mapping is mutated in
place rather than re-set, so ids bound by a dependency that FastAPI runs in a copied context still reach the
middleware's access-log line.

Nothing here configures logging on import: the process owner (a CLI, the local cloud) calls
`configure_json_logging()` once. Standard library only, so services may use it (they import no web framework).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import IO, Any

LOG_FIELDS = ("request_id", "traceparent", "tenant", "job", "negotiation", "event")
"""The ids a record may carry, in the order they are written."""
EXTRA_FIELDS = ("http",)
"""`extra=` attributes the JSON formatter copies from a record (the access log passes `http`)."""

_context: ContextVar[dict[str, str] | None] = ContextVar("hz_log_context", default=None)


@contextmanager
def log_context(**fields: str | None) -> Iterator[dict[str, str]]:
    """Open a fresh context (one request, one delivery) holding `fields`; the previous one is restored on exit."""
    token = _context.set({name: value for name, value in fields.items() if value is not None})
    try:
        yield _context.get() or {}
    finally:
        _context.reset(token)


def bind(**fields: str | None) -> None:
    """Add ids to the current context; outside one (a background task without a context) this does nothing."""
    context = _context.get()
    if context is not None:
        context.update({name: value for name, value in fields.items() if value is not None})


def current() -> dict[str, str]:
    """A copy of the ids bound now."""
    return dict(_context.get() or {})


def current_traceparent() -> str | None:
    """The W3C traceparent of the request being handled, if its caller sent a valid one."""
    return (_context.get() or {}).get("traceparent")


class ContextFilter(logging.Filter):
    """Attach the ids bound at emit time to the record (`record.hz`), before any handler thread formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "hz"):
            record.hz = current()
        return True


class JsonFormatter(logging.Formatter):
    """`{"time", "level", "logger", "message", <ids>, "http"?, "exception"?}`, one line per record."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace(
                "+00:00", "Z"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        ids: dict[str, str] = getattr(record, "hz", None) or current()
        payload.update({name: ids[name] for name in LOG_FIELDS if name in ids})
        for name in EXTRA_FIELDS:
            if hasattr(record, name):
                payload[name] = getattr(record, name)
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str, ensure_ascii=False)


def configure_json_logging(level: int | str = logging.INFO, *, stream: IO[str] | None = None) -> logging.Handler:
    """Route every record of this process to `stream` (stderr) as JSON lines; returns the handler it installed.

    Replaces the root logger's handlers: call it once, where the process starts, never from library code.
    """
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level)
    return handler
