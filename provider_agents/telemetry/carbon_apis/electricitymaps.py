"""Electricity Maps v3: a zone's grid carbon intensity now and its forecast, in gCO2eq/kWh.

Protocol (the v3 API reference): every request carries the key in an `auth-token` header.
`GET {base}/v3/carbon-intensity/latest?zone=DE` answers `{"zone", "carbonIntensity", "datetime", "updatedAt",
"isEstimated", "estimationMethod", ...}`; `GET {base}/v3/carbon-intensity/forecast?zone=DE` answers
`{"zone", "forecast": [{"carbonIntensity", "datetime"}, ...], "updatedAt"}`. Values are already g/kWh.

A poll asks for both (the forecast only with `forecast=True`, since not every plan includes it) and yields a reading
only if both answers are valid. Forecast points at or before the latest value's `datetime` are dropped (the
measurement supersedes them); the rest must be strictly increasing. Electricity Maps zone keys are the public zone
keys tenants see, so the zone is used as is.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final

from provider_agents.clock import Clock
from provider_agents.telemetry.carbon_apis.documents import (
    BadDocumentError,
    build_reading,
    field,
    increasing,
    intensity,
    mapping,
    timestamp,
)
from provider_agents.telemetry.carbon_apis.feed import CarbonFeed
from provider_agents.telemetry.model import CarbonReading

__all__ = ["ELECTRICITY_MAPS_URL", "ElectricityMapsFeed", "parse_forecast", "parse_latest"]

ELECTRICITY_MAPS_URL: Final = "https://api.electricitymap.org"


def parse_latest(document: object, *, zone: str) -> tuple[datetime, float]:
    """The (datetime, g/kWh) of a `/latest` answer for `zone`; `BadDocumentError` if unusable."""
    body = mapping(document, "latest")
    _same_zone(body, zone)
    at = timestamp(field(body, "datetime"), "datetime")
    return at, intensity(field(body, "carbonIntensity"), "carbonIntensity")


def parse_forecast(document: object, *, zone: str) -> list[tuple[datetime, float]]:
    """The (datetime, g/kWh) points of a `/forecast` answer for `zone`, in the provider's order."""
    body = mapping(document, "forecast")
    _same_zone(body, zone)
    items = field(body, "forecast")
    if not isinstance(items, list):
        raise BadDocumentError("forecast: expected a list")
    points = []
    for i, item in enumerate(items):
        point = mapping(item, f"forecast[{i}]")
        at = timestamp(field(point, "datetime"), f"forecast[{i}].datetime")
        points.append((at, intensity(field(point, "carbonIntensity"), f"forecast[{i}].carbonIntensity")))
    increasing(points, "forecast")
    return points


def _same_zone(body: object, zone: str) -> None:
    got = field(mapping(body, "document"), "zone")
    if got != zone:
        raise BadDocumentError(f"zone: {got!r}, expected {zone!r}")


class ElectricityMapsFeed(CarbonFeed):
    """Polls Electricity Maps for `zone`'s latest intensity (and its forecast)."""

    provider = "Electricity Maps"

    def __init__(
        self,
        api_key: str,
        *,
        zone: str,
        base_url: str = ELECTRICITY_MAPS_URL,
        forecast: bool = True,
        interval_s: float = 900.0,
        stale_after_s: float = 7200.0,
        timeout_s: float = 10.0,
        min_backoff_s: float = 5.0,
        max_backoff_s: float = 600.0,
        jitter: float = 0.1,
        clock: Clock | None = None,
    ) -> None:
        if not api_key:
            raise ValueError("an Electricity Maps API key is required")
        super().__init__(
            zone=zone,
            base_url=base_url,
            interval_s=interval_s,
            stale_after_s=stale_after_s,
            timeout_s=timeout_s,
            min_backoff_s=min_backoff_s,
            max_backoff_s=max_backoff_s,
            jitter=jitter,
            headers={"auth-token": api_key},
            clock=clock,
        )
        self.forecast = forecast

    async def _fetch(self) -> CarbonReading:
        params = {"zone": self.zone}
        now = parse_latest(await self._get_json("/v3/carbon-intensity/latest", params=params), zone=self.zone)
        ahead: list[tuple[datetime, float]] = []
        if self.forecast:
            document = await self._get_json("/v3/carbon-intensity/forecast", params=params)
            ahead = parse_forecast(document, zone=self.zone)
        return build_reading(self.zone, [now, *(point for point in ahead if point[0] > now[0])])
