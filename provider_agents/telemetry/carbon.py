"""Carbon curves for simulated (and, until a live feed exists, real) hosts: a replayed trace or explicit steps.

The default is the real hourly CAISO trace shipped with the contract package (59 hours from Electricity Maps via the
CarbonScaler repository; see `harmonaize/data/carbon/README.md`), **replayed faster than real time**: with
`speedup` S one trace hour lasts 3600/S seconds of scenario time, and the trace loops when it runs out. The trace's own
timestamps (January 2020) are not used: hour i of the replay is stamped `start + i * 3600/S`, so events carry
scenario time and a forecast point is simply the next replayed hours. Anything reported from a replay is a replay,
not a measurement of today's grid; the docs and demo say so.

Curves are pure functions of the offset from the scenario start, so two hosts (or two runs) replaying the same curve
from the same start agree exactly.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Protocol

from provider_agents.telemetry.model import CarbonPoint, CarbonReading
from provider_agents.telemetry.scenario import BUILTIN_TRACE_NAMES, CarbonSpec

__all__ = ["BUILTIN_TRACES", "CarbonCurve", "StepCurve", "TraceReplay", "curve_from_spec", "load_trace"]

BUILTIN_TRACES = {"caiso": "us-cal-ciso-2020-01-01.csv"}
assert set(BUILTIN_TRACES) == BUILTIN_TRACE_NAMES


class CarbonCurve(Protocol):
    def reading(self, *, start: datetime, offset_s: float) -> CarbonReading:
        """The reading `offset_s` seconds after `start`, with the forecast that follows it."""
        ...


def _parse_trace(text: str, *, origin: str) -> tuple[float, ...]:
    rows = list(csv.DictReader(io.StringIO(text)))
    column = "carbon_intensity_g_per_kwh"
    if not rows or column not in rows[0]:
        raise ValueError(f"{origin}: expected a CSV with a {column!r} column")
    try:
        values = tuple(float(row[column]) for row in rows)
    except ValueError as exc:
        raise ValueError(f"{origin}: {exc}") from None
    if any(not 0.0 <= v <= 5000.0 or math.isnan(v) for v in values):
        raise ValueError(f"{origin}: intensities must lie in 0..5000 g/kWh")
    return values


@lru_cache(maxsize=8)
def load_trace(name_or_path: str) -> tuple[float, ...]:
    """Hourly intensities of a built-in trace (`caiso`) or of a CSV file in the same format."""
    if name_or_path in BUILTIN_TRACES:
        resource = resources.files("harmonaize") / "data" / "carbon" / BUILTIN_TRACES[name_or_path]
        return _parse_trace(resource.read_text(), origin=name_or_path)
    path = Path(name_or_path)
    try:
        text = path.read_text()
    except OSError as exc:
        known = ", ".join(sorted(BUILTIN_TRACES))
        raise ValueError(f"carbon trace {name_or_path!r} is neither built in ({known}) nor a readable file") from exc
    return _parse_trace(text, origin=str(path))


@dataclass(frozen=True)
class TraceReplay:
    """An hourly trace replayed `speedup` times faster than real time, looping, from hour `start_hour`."""

    region: str
    values: tuple[float, ...]
    speedup: float
    start_hour: int = 0
    forecast_points: int = 24

    def reading(self, *, start: datetime, offset_s: float) -> CarbonReading:
        hour_s = 3600.0 / self.speedup
        index = max(0, math.floor(offset_s / hour_s))

        def point(i: int) -> CarbonPoint:
            value = self.values[(self.start_hour + i) % len(self.values)]
            return CarbonPoint(at=start + timedelta(seconds=i * hour_s), g_per_kwh=value)

        now = point(index)
        forecast = tuple(point(index + k) for k in range(1, self.forecast_points + 1))
        return CarbonReading(region=self.region, g_per_kwh=now.g_per_kwh, observed_at=now.at, forecast=forecast)


@dataclass(frozen=True)
class StepCurve:
    """Explicit points; the value holds from one point until the next (the first also before it)."""

    region: str
    points: tuple[tuple[float, float], ...]
    forecast_points: int = 24

    def reading(self, *, start: datetime, offset_s: float) -> CarbonReading:
        current = 0
        for i, (at, _) in enumerate(self.points):
            if at <= offset_s:
                current = i
        at, value = self.points[current]
        upcoming = self.points[current + 1 : current + 1 + self.forecast_points]
        return CarbonReading(
            region=self.region,
            g_per_kwh=value,
            observed_at=start + timedelta(seconds=at if at <= offset_s else 0.0),
            forecast=tuple(CarbonPoint(at=start + timedelta(seconds=t), g_per_kwh=g) for t, g in upcoming),
        )


def curve_from_spec(region: str, spec: CarbonSpec) -> CarbonCurve:
    """The curve a scenario's carbon entry describes."""
    if spec.points is not None:
        return StepCurve(
            region=region,
            points=tuple((p.at, p.g_per_kwh) for p in spec.points),
            forecast_points=spec.forecast_points,
        )
    return TraceReplay(
        region=region,
        values=load_trace(spec.trace or "caiso"),
        speedup=spec.speedup,
        start_hour=spec.start_hour,
        forecast_points=spec.forecast_points,
    )
