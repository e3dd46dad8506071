"""Carbon intensity: how clean the electricity behind the job's region is now, and is forecast to be.

Region-level on purpose: the zone key (Electricity Maps style, e.g. `US-CAL-CISO`, `DE`, `AUS-NSW`) is public
information, whereas the data centre or power feed behind a host is not. Tenants use this to shift or scale work
in time (the demo negotiates for more workers when intensity drops), so the forecast is part of the event, not a
separate query.

The forecast is ordered strictly by time and bounded in length, so a consumer can bisect it and a producer cannot
flood a subscriber with an unbounded array.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Annotated, ClassVar, Self

from pydantic import Field, Strict, StringConstraints, model_validator

from harmonaize.events.base import ContractModel, EventData
from harmonaize.events.fields import UtcDatetime
from harmonaize.events.kinds import EventKind

__all__ = ["CarbonIntensity", "ForecastPoint"]

MAX_G_PER_KWH = 5000.0
MAX_FORECAST_POINTS = 336

GramsPerKwh = Annotated[float, Strict(), Field(ge=0.0, le=MAX_G_PER_KWH)]
RegionCode = Annotated[str, StringConstraints(pattern=r"^[A-Z]{2,3}(-[A-Z0-9]{1,10}){0,3}$", max_length=40)]


class ForecastPoint(ContractModel):
    """Forecast intensity at one instant (the start of the forecast interval)."""

    at: UtcDatetime
    g_per_kwh: GramsPerKwh


class CarbonIntensity(EventData):
    """Grid carbon intensity for the job's region, in gCO2eq/kWh."""

    KIND: ClassVar[EventKind] = EventKind.CARBON
    VERSION: ClassVar[int] = 1

    region: RegionCode
    g_per_kwh: GramsPerKwh
    observed_at: UtcDatetime
    forecast: tuple[ForecastPoint, ...] = Field(default=(), max_length=MAX_FORECAST_POINTS)

    @model_validator(mode="after")
    def _forecast_ordered(self) -> Self:
        for index, (earlier, later) in enumerate(pairwise(self.forecast), start=1):
            if later.at <= earlier.at:
                raise ValueError(f"forecast: point {index} is not strictly after point {index - 1} in time")
        return self
