"""The time formats the clouds' metadata services write, each parsed by its documented shape and nothing looser.

A lenient parser (`email.utils`, `dateutil`) would turn a garbled or truncated time into *some* datetime, and a
notice's window would silently move; a strict one makes the whole document bad instead, which the channel survives
(it keeps its previous view). Month names are matched here rather than with `strptime("%b")`, which follows the
process locale. Every result is an aware UTC datetime.

| cloud | field                                        | documented example                |
|-------|----------------------------------------------|-----------------------------------|
| Azure | Scheduled Events `NotBefore` (RFC 1123)      | `Mon, 19 Sep 2016 18:29:47 GMT`   |
| AWS   | `events/maintenance/scheduled` `NotBefore`   | `21 Jan 2019 09:00:43 GMT`        |
| AWS   | `spot/instance-action` `time` (ISO 8601)     | `2017-09-18T08:22:00Z`            |
| GCP   | `upcoming-maintenance` windows (RFC 3339)    | `2024-08-15T15:00:00Z`            |
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

from harmonaize.times import parse_rfc3339

__all__ = ["parse_aws_event_time", "parse_iso8601_utc", "parse_rfc1123", "parse_rfc3339"]

_MONTH_NAMES = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_MONTHS = {name: number for number, name in enumerate(_MONTH_NAMES, start=1)}
_DATE_TIME = r"(?P<day>\d{1,2}) (?P<month>[A-Z][a-z]{2}) (?P<year>\d{4}) (?P<hh>\d{2}):(?P<mm>\d{2}):(?P<ss>\d{2}) GMT"
_RFC1123_RE = re.compile(r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun), " + _DATE_TIME, re.ASCII)
_AWS_EVENT_RE = re.compile(_DATE_TIME, re.ASCII)


def _from_match(match: re.Match[str] | None, text: str, what: str) -> datetime:
    if match is None or match["month"] not in _MONTHS:
        raise ValueError(f"not {what}: {text[:64]!r}")
    try:
        return datetime(
            int(match["year"]),
            _MONTHS[match["month"]],
            int(match["day"]),
            int(match["hh"]),
            int(match["mm"]),
            int(match["ss"]),
            tzinfo=UTC,
        )
    except ValueError as exc:  # 31 Feb, 25:00:00, ...
        raise ValueError(f"not {what}: {text[:64]!r} ({exc})") from None


def parse_rfc1123(text: str) -> datetime:
    """Azure's `NotBefore`: `Mon, 19 Sep 2016 18:29:47 GMT` (the weekday is required but not cross-checked)."""
    return _from_match(_RFC1123_RE.fullmatch(text), text, "an RFC 1123 date (e.g. 'Mon, 19 Sep 2016 18:29:47 GMT')")


def parse_aws_event_time(text: str) -> datetime:
    """AWS scheduled events' `NotBefore` / `NotAfter`: `21 Jan 2019 09:00:43 GMT` (no weekday)."""
    return _from_match(_AWS_EVENT_RE.fullmatch(text), text, "an AWS event time (e.g. '21 Jan 2019 09:00:43 GMT')")


def parse_iso8601_utc(text: str) -> datetime:
    """AWS spot and rebalance times: `2017-09-18T08:22:00Z`, the RFC 3339 profile of ISO 8601 with an offset."""
    return parse_rfc3339(text)
