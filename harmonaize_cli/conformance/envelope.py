"""CloudEvents 1.0 envelope rules, checked on an event as the JSON format has it (attributes plus `data`).

Written from the CloudEvents 1.0.2 core specification and JSON event format, not from our own envelope model, so the
kit judges a feed by the standard rather than by this implementation: the four REQUIRED attributes, attribute names
(lowercase ASCII letters and digits; at most 20 characters is a SHOULD, hence a warning), the type system (String
without control characters, URI-reference, URI, Timestamp as RFC 3339, Integer as 32 bits, Boolean; no objects or
arrays), and `data` against `data_base64` and `datacontenttype`. The interface's stricter rules (`datacontenttype`
always `application/json`, `subject` a job id) come from the published envelope schema, in `checks`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final

from harmonaize_cli.conformance.binding import is_json_media_type
from harmonaize_cli.conformance.findings import Finding, Group, failure, warning

__all__ = ["REQUIRED", "SPEC_VERSION", "check_envelope", "is_rfc3339"]

SPEC_VERSION: Final = "1.0"
REQUIRED: Final = ("id", "source", "specversion", "type")
_DATA_MEMBERS: Final = frozenset({"data", "data_base64"})
"""JSON-format members that carry the data, not attributes (their names follow no attribute rule)."""
_MAX_NAME: Final = 20
_INT32: Final = (-(2**31), 2**31 - 1)

_NAME = re.compile(r"[a-z0-9]+", re.ASCII)
_URI_CHAR = r"(?:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{2})"
_URI_REFERENCE = re.compile(rf"{_URI_CHAR}*")
_ABSOLUTE_URI = re.compile(rf"[A-Za-z][A-Za-z0-9+.\-]*:{_URI_CHAR}*")
_TOKEN = r"[A-Za-z0-9!#$&^_.+\-]+"
_MEDIA_TYPE = re.compile(rf"{_TOKEN}/{_TOKEN}(?:\s*;\s*{_TOKEN}=(?:{_TOKEN}|\"[^\"]*\"))*\s*")
_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.\d+)?(?:[Zz]|[+-](\d{2}):(\d{2}))", re.ASCII
)
_STRING_FORBIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\ufdd0-\ufdef\ufffe\uffff]")


def is_rfc3339(value: str) -> bool:
    """An RFC 3339 `date-time` that names a real instant (month 13, February 30 or hour 24 are not)."""
    found = _RFC3339.fullmatch(value)
    if found is None:
        return False
    year, month, day, hour, minute, second = (int(part) for part in found.groups()[:6])
    offset_hours, offset_minutes = found[7], found[8]
    if offset_hours is not None and (int(offset_hours) > 23 or int(offset_minutes) > 59):
        return False
    try:
        datetime(year, month, day, hour, minute, min(second, 59))  # 60: a leap second, which RFC 3339 allows
    except ValueError:
        return False
    return second <= 60


def check_envelope(event: Mapping[str, Any]) -> list[Finding]:
    """Every CloudEvents 1.0 rule `event` breaks (failures) or only bends (warnings); empty when it conforms."""
    findings: list[Finding] = []
    for name in REQUIRED:
        if name not in event or event[name] is None:
            findings.append(failure(Group.ENVELOPE, f"REQUIRED attribute {name!r} is missing"))
        elif not isinstance(event[name], str) or not event[name]:
            findings.append(failure(Group.ENVELOPE, f"REQUIRED attribute {name!r} must be a non-empty string"))
    if isinstance(event.get("specversion"), str) and event["specversion"] and event["specversion"] != SPEC_VERSION:
        findings.append(failure(
            Group.ENVELOPE, f"specversion {event['specversion']!r} is not {SPEC_VERSION!r} (CloudEvents 1.0)"))
    for name, value in event.items():
        if name in _DATA_MEMBERS:
            continue
        findings.extend(_name_findings(name))
        findings.extend(_value_findings(name, value))
    findings.extend(_data_findings(event))
    return findings


def _name_findings(name: object) -> list[Finding]:
    shown = repr(name)[:48]
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        return [failure(Group.ENVELOPE, f"attribute name {shown} is not lowercase ASCII letters and digits only")]
    if len(name) > _MAX_NAME:
        return [warning(Group.ENVELOPE, f"attribute name {shown} is longer than {_MAX_NAME} characters "
                                        "(CloudEvents: SHOULD NOT)")]
    return []


def _value_findings(name: str, value: Any) -> list[Finding]:
    """The type rules: a context attribute is a CloudEvents scalar, and the core ones have their own types."""
    if value is None:
        if name in REQUIRED:
            return []  # reported as missing
        return [warning(Group.ENVELOPE, f"attribute {name!r} is null: omit an attribute that has no value")]
    if isinstance(value, bool):
        return _typed(name, "Boolean")
    if isinstance(value, int):
        if not _INT32[0] <= value <= _INT32[1]:
            return [failure(Group.ENVELOPE, f"attribute {name!r}: Integer {value} does not fit in 32 bits")]
        return _typed(name, "Integer")
    if isinstance(value, float):
        return [failure(Group.ENVELOPE, f"attribute {name!r} is a fractional number: CloudEvents has no such type")]
    if not isinstance(value, str):
        kind = "an object" if isinstance(value, Mapping) else "an array"
        return [failure(Group.ENVELOPE, f"attribute {name!r} is {kind}: CloudEvents attributes are scalars")]
    if _STRING_FORBIDDEN.search(value):
        return [failure(Group.ENVELOPE, f"attribute {name!r} contains a control, surrogate or non-character")]
    return _string_findings(name, value)


def _typed(name: str, kind: str) -> list[Finding]:
    """A core attribute that must be a string, given another scalar."""
    if name in ("id", "source", "specversion", "type", "subject", "time", "datacontenttype", "dataschema"):
        return [failure(Group.ENVELOPE, f"attribute {name!r} is a {kind}, not a string")]
    return []


def _string_findings(name: str, value: str) -> list[Finding]:
    if name == "source" and value and _URI_REFERENCE.fullmatch(value) is None:
        return [failure(Group.ENVELOPE, f"source {value[:80]!r} is not a URI-reference (RFC 3986)")]
    if name == "time" and not is_rfc3339(value):
        return [failure(Group.ENVELOPE, f"time {value[:48]!r} is not an RFC 3339 timestamp")]
    if name == "dataschema" and (not value or _ABSOLUTE_URI.fullmatch(value) is None):
        return [failure(Group.ENVELOPE, f"dataschema {value[:80]!r} is not an absolute URI")]
    if name == "datacontenttype" and _MEDIA_TYPE.fullmatch(value) is None:
        return [failure(Group.ENVELOPE, f"datacontenttype {value[:80]!r} is not an RFC 2046 media type")]
    if name == "subject" and not value:
        return [failure(Group.ENVELOPE, "subject is empty: omit it or give it a value")]
    return []


def _data_findings(event: Mapping[str, Any]) -> list[Finding]:
    if "data" in event and "data_base64" in event:
        return [failure(Group.ENVELOPE, "both data and data_base64: the JSON format allows one of them")]
    content_type = event.get("datacontenttype")
    if "data" in event and isinstance(content_type, str) and not is_json_media_type(content_type):
        if not isinstance(event["data"], str):
            return [failure(Group.ENVELOPE, f"data is JSON but datacontenttype is {content_type!r}: non-JSON data "
                                            "travels as a string (or data_base64)")]
    return []
