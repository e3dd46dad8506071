"""Carbon-intensity forecasts for the provider's policy, and the default: a real trace replayed onto "now".

The policy needs only `points(now)`: (start of interval, gCO2eq/kWh) pairs, ordered, the first one covering `now`.
A real forecast service (Electricity Maps, WattTime) would implement the same protocol.

`TraceReplayForecast` replays the shipped 59-hour California ISO trace (`harmonaize/data/carbon`, see its README):
the trace's first hour maps to `anchor`, and `speedup` compresses trace time (360: one trace hour every 10 s), looping
at the end so a long-running local cloud never runs out of forecast. The "forecast" is the trace's own future, i.e.
a perfect forecast; say so wherever a figure derived from it is reported.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cached_property
from importlib import resources
from itertools import pairwise
from typing import Protocol

from harmonaize.events import parse_rfc3339

TRACE_RESOURCE = "data/carbon/us-cal-ciso-2020-01-01.csv"
DEFAULT_HORIZON_HOURS = 24
"""How far ahead (in trace hours) a forecast reaches: a day, like commercial day-ahead forecasts."""

CarbonPoint = tuple[datetime, float]


class CarbonForecast(Protocol):
    """Forecast carbon intensity of the region the provider's hosts draw from."""

    def points(self, now: datetime) -> list[CarbonPoint]:
        """(interval start, g/kWh) in time order; the first interval contains `now`."""
        ...


@dataclass(frozen=True)
class CarbonTrace:
    """An hourly trace: its zone and the intensity of each consecutive hour."""

    zone: str
    hourly_g_per_kwh: tuple[float, ...]


def load_trace(text: str | None = None) -> CarbonTrace:
    """Parse a trace CSV (`datetime_utc,zone,carbon_intensity_g_per_kwh`, hourly, in order).

    Without `text`, the trace shipped with the package is read.
    """
    if text is None:
        text = (resources.files("harmonaize") / TRACE_RESOURCE).read_text()
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise ValueError("the carbon trace has no rows")
    times = [parse_rfc3339(row["datetime_utc"].replace("+00:00", "Z")) for row in rows]
    for earlier, later in pairwise(times):
        if later - earlier != timedelta(hours=1):
            raise ValueError(f"the carbon trace must be hourly and in order; {earlier} is followed by {later}")
    zones = {row["zone"] for row in rows}
    if len(zones) != 1:
        raise ValueError(f"the carbon trace must cover one zone, got {sorted(zones)}")
    hourly = tuple(float(row["carbon_intensity_g_per_kwh"]) for row in rows)
    return CarbonTrace(zone=zones.pop(), hourly_g_per_kwh=hourly)


@dataclass(frozen=True)
class TraceReplayForecast:
    """A trace replayed from `anchor`, `speedup` times faster than real time, looping."""

    anchor: datetime
    speedup: float = 1.0
    trace: CarbonTrace = field(default_factory=load_trace)
    horizon_hours: int = DEFAULT_HORIZON_HOURS

    def __post_init__(self) -> None:
        if self.anchor.tzinfo is None:
            raise ValueError("anchor must be an aware (UTC) datetime")
        if not self.speedup > 0:
            raise ValueError(f"speedup must be positive, got {self.speedup}")

    @property
    def region(self) -> str:
        return self.trace.zone

    @cached_property
    def hour(self) -> timedelta:
        """How long one trace hour lasts in real time."""
        return timedelta(hours=1) / self.speedup

    def points(self, now: datetime) -> list[CarbonPoint]:
        current = math.floor((now - self.anchor) / self.hour)
        cached: tuple[int, tuple[CarbonPoint, ...]] | None = self.__dict__.get("_points")
        if cached is None or cached[0] != current:  # every offer asks; the answer changes once per trace hour
            cached = (current, self._points_from(current))
            self.__dict__["_points"] = cached
        return list(cached[1])

    def _points_from(self, current: int) -> tuple[CarbonPoint, ...]:
        values = self.trace.hourly_g_per_kwh
        return tuple(
            ((self.anchor + (current + step) * self.hour).astimezone(UTC), values[(current + step) % len(values)])
            for step in range(self.horizon_hours + 1)
        )


@dataclass(frozen=True)
class StepCurveForecast:
    """A step curve of (offset from `anchor`, g/kWh) points, e.g. a scenario's carbon curve; the last value holds.

    The local cloud builds it from the same scenario its simulated hosts replay, so the provider's forecast and the
    carbon the tenants are told about agree.
    """

    anchor: datetime
    steps: tuple[tuple[timedelta, float], ...]

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError("a step curve needs at least one point")
        offsets = [offset for offset, _ in self.steps]
        if offsets != sorted(set(offsets)):
            raise ValueError("step offsets must be strictly increasing")

    def points(self, now: datetime) -> list[CarbonPoint]:
        starts = [(self.anchor + offset, value) for offset, value in self.steps]
        current = 0
        for index, (start, _) in enumerate(starts):
            if start <= now:
                current = index
        first_start, first_value = starts[current]
        return [(min(first_start, now), first_value), *starts[current + 1 :]]


def carbon_at(points: Sequence[CarbonPoint], at: datetime) -> float | None:
    """The forecast for the interval containing `at` (None before the first point, or without points)."""
    value = None
    for start, g_per_kwh in points:
        if start > at:
            break
        value = g_per_kwh
    return value
