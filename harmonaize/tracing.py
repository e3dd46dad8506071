"""W3C Trace Context ids for CloudEvents and HTTP calls, so one trace follows a fact from the host agent that saw it,
through the broker and the tenant's controller, to the API request the controller made and the events it caused.

Stdlib only (part of the contract). Agents start a trace per event (`new_traceparent`); a controller handling an
event continues it (`child_traceparent`: same trace id, a new span id) in the `traceparent` header of its API calls;
the API stamps the events that request caused with it (api.services.outbox).
"""

from __future__ import annotations

import secrets

__all__ = ["child_traceparent", "new_traceparent", "trace_id"]


def new_traceparent(*, sampled: bool = True) -> str:
    """A fresh trace: random trace id and span id (never all zeros, as the spec requires)."""
    return f"00-{_nonzero_hex(16)}-{_nonzero_hex(8)}-{'01' if sampled else '00'}"


def child_traceparent(parent: str) -> str:
    """The same trace, one hop further: keep the trace id and flags, new span id."""
    version, trace, _span, flags = parent.split("-")[:4]
    return f"{version}-{trace}-{_nonzero_hex(8)}-{flags}"


def trace_id(traceparent: str) -> str:
    return traceparent.split("-")[1]


def _nonzero_hex(size: int) -> str:
    while True:
        value = secrets.token_hex(size)
        if value.strip("0"):
            return value
