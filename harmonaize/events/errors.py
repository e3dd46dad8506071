"""Errors raised when an event cannot be built or read.

Both subclass `ValueError` (so generic input-handling code keeps working) and a common `EventError` (so a consumer
loop can catch exactly "this message is not a usable event" and dead-letter it, without also swallowing bugs).
`InvalidEventError` flattens pydantic's nested report into dotted field paths (`data.confidence`) because that is
what an operator reading a log line, or a test, needs to see first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["EventError", "InvalidEventError", "UnknownEventTypeError"]

_MAX_SHOWN_INPUT = 80


class EventError(ValueError):
    """Base class: the message is not a usable HarmonAIze event."""


class UnknownEventTypeError(EventError):
    """The CloudEvents `type` names no data model this build knows (unknown kind, or unsupported version)."""

    def __init__(self, event_type: object, reason: str) -> None:
        super().__init__(f"unknown event type {event_type!r}: {reason}")
        self.event_type = event_type


class InvalidEventError(EventError):
    """The envelope or its data failed validation; `fields` lists the offending dotted paths."""

    def __init__(self, event_type: object, problems: Iterable[tuple[str, str]]) -> None:
        self.problems: tuple[tuple[str, str], ...] = tuple(problems)
        self.fields: tuple[str, ...] = tuple(field for field, _ in self.problems)
        self.event_type = event_type
        label = f"{event_type} event" if isinstance(event_type, str) and event_type else "event"
        details = "; ".join(f"{field}: {message}" for field, message in self.problems)
        super().__init__(f"invalid {label}: {details}")

    @classmethod
    def from_pydantic(cls, event_type: object, errors: Iterable[Mapping[str, Any]]) -> InvalidEventError:
        """Build from `ValidationError.errors()`, keeping the field path and a short view of the bad input."""
        problems = []
        for error in errors:
            field = ".".join(str(part) for part in error.get("loc", ())) or "<event>"
            message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
            if "input" in error and error.get("type") not in {"missing", "value_error", "assertion_error"}:
                shown = repr(error["input"])
                if len(shown) > _MAX_SHOWN_INPUT:
                    shown = shown[: _MAX_SHOWN_INPUT - 3] + "..."
                message = f"{message} (got {shown})"
            problems.append((field, message))
        return cls(event_type, problems)
