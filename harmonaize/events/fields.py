"""Field types shared by every event model: timestamps, pseudonyms and strict, bounded numbers.

Design decisions:

* Timestamps are RFC 3339 strings on the wire and timezone-aware UTC `datetime`s in Python. Naive datetimes and
  unix numbers are refused (pydantic's lax mode would take both): an event is read by other languages and stored for
  replay, and "which timezone was that?" must never be a question. Up to nine fractional digits are accepted
  (Go and nats-server write nanoseconds) and truncated to Python's microseconds; output always ends in `Z`.
* Hosts and locality groups appear only as per-tenant pseudonyms (`h-<hex>`, `g-<hex>`). The pattern is the
  privacy guarantee at the type level: a provider-internal name such as `gpu-node-17` or `rack-a3` cannot be put
  into a tenant-facing field by mistake, because it does not validate. How the hex is derived (a keyed hash per
  tenant) is the provider agents' business; this module only fixes the shape.
* Numbers are strict (no `"0.5"` strings, no `true` as 1) and finite, with explicit bounds, because these models
  are parsed from untrusted bytes and feed control loops that must not see NaN or a 10**300 slowdown.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import AfterValidator, AwareDatetime, BeforeValidator, Field, PlainSerializer, Strict, StringConstraints

__all__ = [
    "GROUP_PSEUDONYM_PATTERN",
    "HOST_PSEUDONYM_PATTERN",
    "NOTICE_ID_PATTERN",
    "GpuCount",
    "GpuIndex",
    "GroupPseudonym",
    "HostPseudonym",
    "NoticeId",
    "Probability",
    "UtcDatetime",
    "WorkerCount",
    "format_rfc3339",
    "is_group_pseudonym",
    "is_host_pseudonym",
    "parse_rfc3339",
]

HOST_PSEUDONYM_PATTERN = r"^h-[0-9a-f]{6,32}$"
GROUP_PSEUDONYM_PATTERN = r"^g-[0-9a-f]{6,32}$"
NOTICE_ID_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"

_HOST_RE = re.compile(HOST_PSEUDONYM_PATTERN.strip("^$"), re.ASCII)
_GROUP_RE = re.compile(GROUP_PSEUDONYM_PATTERN.strip("^$"), re.ASCII)
_RFC3339_RE = re.compile(
    r"(?P<base>\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2})(?:\.(?P<fraction>\d{1,9}))?(?P<offset>[Zz]|[+-]\d{2}:\d{2})",
    re.ASCII,
)


def is_host_pseudonym(value: object) -> bool:
    """True when `value` has the shape of a per-tenant host pseudonym (`h-` + 6..32 lowercase hex digits)."""
    return isinstance(value, str) and _HOST_RE.fullmatch(value) is not None


def is_group_pseudonym(value: object) -> bool:
    """True when `value` has the shape of a per-tenant locality-group pseudonym (`g-` + 6..32 lowercase hex)."""
    return isinstance(value, str) and _GROUP_RE.fullmatch(value) is not None


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

HostPseudonym = Annotated[str, StringConstraints(pattern=HOST_PSEUDONYM_PATTERN)]
"""A host as one tenant sees it: stable for that tenant, meaningless to anyone else."""

GroupPseudonym = Annotated[str, StringConstraints(pattern=GROUP_PSEUDONYM_PATTERN)]
"""A locality group (hosts sharing a fast fabric) as one tenant sees it; never a rack or switch name."""

NoticeId = Annotated[str, StringConstraints(pattern=NOTICE_ID_PATTERN)]
"""An opaque provider notice id; restricted to the id alphabet so it is safe in subjects and URL paths."""

GpuCount = Annotated[int, Strict(), Field(ge=0, le=64)]
GpuIndex = Annotated[int, Strict(), Field(ge=0, le=63)]
WorkerCount = Annotated[int, Strict(), Field(ge=0, le=4096)]
Probability = Annotated[float, Strict(), Field(ge=0.0, le=1.0)]
