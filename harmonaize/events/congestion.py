"""Congestion: how much slower the job's own communication is expected to run, and where.

The tenant gets an outcome, not a measurement: a level and an expected slowdown factor on the job's own paths,
scoped to traffic inside groups or between them, plus the affected groups and a time window. Link counters,
other tenants' flows and switch names stay with the provider. This is enough to decide "repartition DDP to HSDP
grouped by locality" when inter-group traffic slows down, which is the decision the tenant actually owns.

Rules enforced here so consumers need not re-check: `level == none` means a slowdown of exactly 1.0 (the
all-clear event), any other level names at least one affected group, and `expected_until`, when known, is not
before `since`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, ClassVar, Self

from pydantic import Field, Strict, model_validator

from harmonaize.events.base import EventData
from harmonaize.events.fields import GroupPseudonym, UtcDatetime
from harmonaize.events.kinds import EventKind

__all__ = ["Congestion", "CongestionLevel", "CongestionScope"]

MAX_SLOWDOWN = 100.0
MAX_AFFECTED_GROUPS = 64


class CongestionLevel(StrEnum):
    """Ordered from all-clear to worst."""

    NONE = "none"
    LOW = "low"
    MODERATE = "moderate"
    HIGH = "high"
    SEVERE = "severe"


class CongestionScope(StrEnum):
    """Which of the job's traffic is affected: inside locality groups, or between them."""

    INTRA_GROUP = "intra_group"
    INTER_GROUP = "inter_group"


class Congestion(EventData):
    """Expected slowdown of the job's communication on one scope."""

    KIND: ClassVar[EventKind] = EventKind.CONGESTION
    VERSION: ClassVar[int] = 1

    level: CongestionLevel
    slowdown: Annotated[float, Strict(), Field(ge=1.0, le=MAX_SLOWDOWN)] = Field(
        description="Expected factor on the job's communication time on this scope; 1.0 means unaffected."
    )
    scope: CongestionScope
    groups: tuple[GroupPseudonym, ...] = Field(default=(), max_length=MAX_AFFECTED_GROUPS)
    since: UtcDatetime
    expected_until: UtcDatetime | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.level is CongestionLevel.NONE and self.slowdown != 1.0:
            raise ValueError(f"slowdown must be 1.0 when level is 'none' (got {self.slowdown})")
        if self.level is not CongestionLevel.NONE and not self.groups:
            raise ValueError(f"groups: at least one affected group is required when level is {self.level.value!r}")
        if len(set(self.groups)) != len(self.groups):
            raise ValueError("groups: each group may appear once")
        if self.expected_until is not None and self.expected_until < self.since:
            raise ValueError("expected_until must not be before since")
        return self
