"""Checks shared by the carbon API parsers: a provider's document becomes a `CarbonReading` whole or not at all.

Every check raises `BadDocumentError` with the field at fault, so a feed can log one line and keep its previous
reading. Intensities are checked against the model's own range (0..5000 g/kWh) here rather than left to pydantic, so
the message names the provider's field instead of ours.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from itertools import pairwise
from typing import Any

from harmonaize.times import parse_rfc3339
from provider_agents.telemetry.model import CarbonPoint, CarbonReading

__all__ = [
    "MAX_G_PER_KWH",
    "BadDocumentError",
    "build_reading",
    "field",
    "increasing",
    "intensity",
    "mapping",
    "timestamp",
]

MAX_G_PER_KWH = 5000.0


class BadDocumentError(ValueError):
    """A provider's answer that cannot be a reading: partial, mistyped, out of range or out of order."""


def mapping(value: object, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise BadDocumentError(f"{name}: expected a JSON object, got {type(value).__name__}")
    return value


def field(document: Mapping[str, Any], name: str) -> Any:
    if name not in document or document[name] is None:
        raise BadDocumentError(f"{name}: missing")
    return document[name]


def timestamp(value: object, name: str) -> datetime:
    if not isinstance(value, str):
        raise BadDocumentError(f"{name}: expected an RFC 3339 string")
    try:
        return parse_rfc3339(value)
    except ValueError as exc:
        raise BadDocumentError(f"{name}: {exc}") from None


def intensity(value: object, name: str, *, factor: float = 1.0) -> float:
    """A number in the provider's units, times `factor`, as g/kWh within 0..5000."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadDocumentError(f"{name}: expected a number, got {type(value).__name__}")
    converted = float(value) * factor
    if not math.isfinite(converted) or converted < 0.0:
        raise BadDocumentError(f"{name}: {value!r} is not a non-negative intensity")
    if converted > MAX_G_PER_KWH:
        raise BadDocumentError(f"{name}: {converted:.1f} g/kWh is above {MAX_G_PER_KWH:.0f}")
    return converted


def increasing(points: Sequence[tuple[datetime, float]], name: str) -> None:
    """Raise unless the points' times strictly increase."""
    for (earlier, _), (later, _) in pairwise(points):
        if later <= earlier:
            order = f"{earlier.isoformat()}, then {later.isoformat()}"
            raise BadDocumentError(f"{name}: times are not strictly increasing ({order})")


def build_reading(zone: str, points: Sequence[tuple[datetime, float]]) -> CarbonReading:
    """The first point as the reading, the rest as its forecast; the times must strictly increase."""
    if not points:
        raise BadDocumentError("no data points")
    increasing(points, "data")
    (at, value), rest = points[0], points[1:]
    forecast = tuple(CarbonPoint(at=t, g_per_kwh=g) for t, g in rest)
    return CarbonReading(region=zone, g_per_kwh=value, observed_at=at, forecast=forecast)
