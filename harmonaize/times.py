"""Timestamps in the contract: RFC 3339 strings on the wire, timezone-aware UTC datetimes in Python.

Naive datetimes and unix numbers are refused (pydantic's lax mode would take both): events and negotiation terms are
read by other languages and stored for replay, and "which timezone was that?" must never be a question. Up to nine
fractional digits are accepted (Go and nats-server write nanoseconds) and truncated to Python's microseconds; output
always ends in `Z`. This module sits outside `harmonaize.events` so that the negotiation vocabulary, which the events
package also imports, can use it without an import cycle.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import AfterValidator, AwareDatetime, BeforeValidator, PlainSerializer

__all__ = ["UtcDatetime", "format_rfc3339", "parse_rfc3339"]

_RFC3339_RE = re.compile(
    r"(?P<base>\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2})(?:\.(?P<fraction>\d{1,9}))?(?P<offset>[Zz]|[+-]\d{2}:\d{2})",
    re.ASCII,
)


def parse_rfc3339(text: str) -> datetime:
    """Parse an RFC 3339 date-time with an explicit offset into an aware UTC datetime.

    Stricter than `datetime.fromisoformat`: no date-only forms, no missing offset, no week dates.
    """
    match = _RFC3339_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"not an RFC 3339 timestamp with offset (e.g. 2025-01-31T12:00:00Z): {text[:64]!r}")
    fraction = match["fraction"]
    micro = f".{fraction[:6]}" if fraction else ""
    offset = "+00:00" if match["offset"] in {"Z", "z"} else match["offset"]
    try:
        parsed = datetime.fromisoformat(match["base"].upper() + micro + offset)
    except ValueError as exc:
        raise ValueError(f"not a valid RFC 3339 timestamp: {text[:64]!r} ({exc})") from None
    return parsed.astimezone(UTC)


def format_rfc3339(value: datetime) -> str:
    """Format an aware datetime as RFC 3339 in UTC with a `Z` suffix (microseconds kept when present)."""
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _rfc3339_or_datetime(value: Any) -> Any:
    if isinstance(value, str):
        return parse_rfc3339(value)
    if isinstance(value, datetime):
        return value
    raise ValueError(f"expected an RFC 3339 string or an aware datetime, got {type(value).__name__}")


def _to_utc(value: datetime) -> datetime:
    return value.astimezone(UTC)


UtcDatetime = Annotated[
    AwareDatetime,
    BeforeValidator(_rfc3339_or_datetime),
    AfterValidator(_to_utc),
    PlainSerializer(format_rfc3339, return_type=str, when_used="json"),
]
"""An aware datetime, normalised to UTC; RFC 3339 with `Z` on the wire."""
