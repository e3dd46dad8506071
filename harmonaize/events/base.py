"""Base classes for event payloads, and the mapping between a model and its CloudEvents `type`.

Every payload is a frozen pydantic model with `extra="forbid"`: an event is a fact that was published, so it
must not change after construction, and an unknown field means producer and consumer disagree about the version,
which should fail loudly rather than be dropped. Evolution is by new versions (`VERSION = 2` in a new class, both
registered), never by silently widening v1.

The type name is derived from two class variables (`KIND`, `VERSION`) so there is exactly one place that says
which `type` a model travels under: `io.harmonaize.<kind>.v<version>`.
"""

from __future__ import annotations

import functools
import re
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from harmonaize.events.kinds import EventKind

__all__ = ["EVENT_TYPE_PREFIX", "ContractModel", "EventData", "event_type_name", "split_event_type"]

EVENT_TYPE_PREFIX = "io.harmonaize."
_EVENT_TYPE_RE = re.compile(r"io\.harmonaize\.(?P<kind>[a-z][a-z0-9_]{0,31})\.v(?P<version>[1-9][0-9]{0,3})", re.ASCII)


def event_type_name(kind: EventKind, version: int) -> str:
    """The CloudEvents `type` for a kind and version, e.g. `io.harmonaize.failure.v1`."""
    return f"{EVENT_TYPE_PREFIX}{kind.value}.v{version}"


def split_event_type(event_type: str) -> tuple[str, int] | None:
    """(kind, version) for a well-formed HarmonAIze type string, or None when it is not one of ours."""
    match = _EVENT_TYPE_RE.fullmatch(event_type)
    if match is None:
        return None
    return match["kind"], int(match["version"])


class ContractModel(BaseModel):
    """Frozen, closed, finite: the configuration every model in the contract shares (payloads and their parts)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, validate_default=True)


class EventData(ContractModel):
    """A versioned event payload; subclasses set `KIND` and `VERSION`."""

    KIND: ClassVar[EventKind]
    VERSION: ClassVar[int]

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        kind = cls.__dict__.get("KIND")
        version = cls.__dict__.get("VERSION")
        if not isinstance(kind, EventKind):
            raise TypeError(f"{cls.__name__}.KIND must be an EventKind member, got {kind!r}")
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= 9999:
            raise TypeError(f"{cls.__name__}.VERSION must be an int in 1..9999, got {version!r}")

    @classmethod
    def event_type(cls) -> str:
        """The CloudEvents `type` this payload travels under."""
        return _type_name_of(cls)


@functools.cache
def _type_name_of(model: type[EventData]) -> str:
    """Built once per model: it is asked for several times per event made or decoded."""
    return event_type_name(model.KIND, model.VERSION)
