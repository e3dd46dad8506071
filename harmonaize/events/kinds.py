"""The closed set of event kinds a tenant can receive.

A kind is three things at once: the `<kind>` token in `hz.t.<tenant>.events.<kind>.<job>`, the middle of the
CloudEvents type `io.harmonaize.<kind>.v<version>`, and the name of one data-model module in this package. Keeping it
a `StrEnum` (not free strings) means a typo in a subscriber's filter fails loudly at build time instead of silently
matching nothing, and every value is by construction a safe single subject token (lowercase ASCII, no `.`, `*`, `>`).
This module imports nothing but the stdlib so `harmonaize.subjects` can use it cheaply.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["EventKind", "UnknownEventKindError", "parse_kind"]


class EventKind(StrEnum):
    """What an event is about; the value is the subject token and the type-name segment."""

    TOPOLOGY = "topology"
    CONGESTION = "congestion"
    FAILURE = "failure"
    MAINTENANCE = "maintenance"
    CARBON = "carbon"
    CAPACITY = "capacity"
    NEGOTIATION = "negotiation"
    DIRECTIVE = "directive"
    JOB = "job"


class UnknownEventKindError(ValueError):
    """A kind that is not part of this contract (a typo, an injection attempt, or a newer producer)."""

    def __init__(self, value: object) -> None:
        known = ", ".join(kind.value for kind in EventKind)
        super().__init__(f"unknown event kind {value!r}; known kinds: {known}")
        self.value = value


def parse_kind(value: object) -> EventKind:
    """Return the `EventKind` for `value` (a member or its exact string), or raise UnknownEventKindError."""
    if isinstance(value, EventKind):
        return value
    if isinstance(value, str):
        try:
            return EventKind(value)
        except ValueError:
            pass
    raise UnknownEventKindError(value)
