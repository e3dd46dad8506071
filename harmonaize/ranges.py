"""Inclusive integer ranges, the one shape every "the provider may choose within" declaration takes.

A tenant's ranges travel through the API (job bodies), the database, the launcher's run spec and the training runtime,
and a negotiation names the worker counts a tenant would accept: all of them are `{min, max}` with min <= max, checked
here once. The bounds differ by use (a worker count may be 0, a step interval may not), so a use narrows the fields in
a subclass and inherits the ordering check, the membership test and the wire shape.
"""

from __future__ import annotations

from typing import ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

__all__ = ["MAX_RANGE_VALUE", "MAX_WORKERS", "IntRange", "WorkerRange", "check_ordered"]

MAX_RANGE_VALUE = 1_000_000_000
"""Upper bound of a declared range: far beyond any real step count or batch, far below a 32-bit column's limit."""
MAX_WORKERS = 4096


def check_ordered(low: int, high: int, *, low_field: str, high_field: str) -> None:
    """Refuse low > high, blaming `low_field`: the error's ctx names the field, so an API that appends it to the
    location answers `body.min_workers` (or `body.batch_size.min`) rather than just `body`."""
    if low > high:
        raise PydanticCustomError(
            "range_order",
            "{low_field} ({low}) must be <= {high_field} ({high})",
            {"field": low_field, "low_field": low_field, "high_field": high_field, "low": low, "high": high},
        )


class IntRange(BaseModel):
    """An inclusive range the provider may choose from; min == max pins the value."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ORDER_MESSAGE: ClassVar[str | None] = None
    """None: the ordering error names both values (`check_ordered`); a text: a plain value error with that text, for
    a range whose callers already match on it."""

    min: int = Field(ge=1, le=MAX_RANGE_VALUE)
    max: int = Field(ge=1, le=MAX_RANGE_VALUE)

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.ORDER_MESSAGE is not None and self.min > self.max:
            raise ValueError(self.ORDER_MESSAGE)
        check_ordered(self.min, self.max, low_field="min", high_field="max")
        return self

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int) and self.min <= value <= self.max


class WorkerRange(IntRange):
    """Worker counts a tenant would accept in a negotiation; 0 is a count (scale to nothing)."""

    ORDER_MESSAGE: ClassVar[str | None] = "min must be <= max"
    """The SDK and the negotiation 422s say exactly this, and tenants' handlers may match on it: keep it stable."""

    min: int = Field(ge=0, le=MAX_WORKERS)
    max: int = Field(ge=0, le=MAX_WORKERS)
