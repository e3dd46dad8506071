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
from typing import Annotated

from pydantic import Field, Strict, StringConstraints

from harmonaize.times import UtcDatetime, format_rfc3339, parse_rfc3339

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


def is_host_pseudonym(value: object) -> bool:
    """True when `value` has the shape of a per-tenant host pseudonym (`h-` + 6..32 lowercase hex digits)."""
    return isinstance(value, str) and _HOST_RE.fullmatch(value) is not None


def is_group_pseudonym(value: object) -> bool:
    """True when `value` has the shape of a per-tenant locality-group pseudonym (`g-` + 6..32 lowercase hex)."""
    return isinstance(value, str) and _GROUP_RE.fullmatch(value) is not None



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
