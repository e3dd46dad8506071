"""WattTime v3: the marginal emissions rate (`co2_moer`) forecast of one WattTime region, as g/kWh readings.

Protocol (docs.watttime.org): `GET {base}/login` with HTTP basic auth answers `{"token": ...}`, valid for 30 minutes;
`GET {base}/v3/forecast?region=...&signal_type=co2_moer` with `Authorization: Bearer <token>` answers
`{"data": [{"point_time", "value"}, ...], "meta": {"units", "signal_type", "region", "generated_at", ...}}`. The
first point is the rate now, the rest its forecast (5-minute points). A 401 means the token expired or was revoked:
the feed logs in again and retries once in the same poll; the token is also renewed before `token_max_age_s`.

WattTime regions (`CAISO_NORTH`) are not the public zone keys tenants see, so the reading's `zone` is given
separately (`US-CAL-CISO`). Units are converted explicitly (`to_g_per_kwh`); a unit this module does not know makes
the document bad rather than a number in the wrong unit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

from provider_agents.clock import Clock
from provider_agents.telemetry.carbon_apis.documents import (
    BadDocumentError,
    build_reading,
    field,
    intensity,
    mapping,
    timestamp,
)
from provider_agents.telemetry.carbon_apis.feed import CarbonFeed, ProviderStatusError
from provider_agents.telemetry.model import CarbonReading

__all__ = ["GRAMS_PER_POUND", "WATTTIME_URL", "WattTimeFeed", "parse_forecast", "to_g_per_kwh"]

log = logging.getLogger(__name__)

WATTTIME_URL: Final = "https://api.watttime.org"
GRAMS_PER_POUND: Final = 453.59237
SIGNAL_TYPE: Final = "co2_moer"

_LBS_PER_MWH = frozenset({"lbs_co2_per_mwh", "lb_co2_per_mwh", "lbs_co2e_per_mwh", "lbs/mwh"})
_G_PER_KWH = frozenset(
    {"g_co2_per_kwh", "g_co2e_per_kwh", "gco2_per_kwh", "gco2/kwh", "gco2eq/kwh", "g/kwh", "kg_co2_per_mwh"}
)  # kg/MWh is the same quantity as g/kWh


def to_g_per_kwh(units: str) -> float:
    """The factor from `units` to g/kWh: lbs/MWh * 453.59237 g/lb / 1000 kWh/MWh; 1 for g/kWh (or kg/MWh)."""
    key = units.strip().lower()
    if key in _LBS_PER_MWH:
        return GRAMS_PER_POUND / 1000.0
    if key in _G_PER_KWH:
        return 1.0
    raise BadDocumentError(f"meta.units: unknown unit {units!r}")


def parse_forecast(document: object, *, region: str, zone: str) -> CarbonReading:
    """A `/v3/forecast` answer for `region` as a reading for public `zone`; `BadDocumentError` if unusable."""
    body = mapping(document, "forecast")
    meta = mapping(field(body, "meta"), "meta")
    units = field(meta, "units")
    if not isinstance(units, str):
        raise BadDocumentError("meta.units: expected a string")
    factor = to_g_per_kwh(units)
    signal = meta.get("signal_type", SIGNAL_TYPE)
    if signal != SIGNAL_TYPE:
        raise BadDocumentError(f"meta.signal_type: {signal!r}, expected {SIGNAL_TYPE}")
    if meta.get("region", region) != region:
        raise BadDocumentError(f"meta.region: {meta.get('region')!r}, expected {region!r}")
    data = field(body, "data")
    if not isinstance(data, list):
        raise BadDocumentError("data: expected a list")
    points = []
    for i, item in enumerate(data):
        point = mapping(item, f"data[{i}]")
        at = timestamp(field(point, "point_time"), f"data[{i}].point_time")
        points.append((at, intensity(field(point, "value"), f"data[{i}].value", factor=factor)))
    return build_reading(zone, points)


class WattTimeFeed(CarbonFeed):
    """Polls WattTime's `co2_moer` forecast for `region`, read as the public grid zone `zone`."""

    provider = "WattTime"

    def __init__(
        self,
        username: str,
        password: str,
        *,
        region: str,
        zone: str,
        base_url: str = WATTTIME_URL,
        interval_s: float = 300.0,
        stale_after_s: float = 1800.0,
        token_max_age_s: float = 1500.0,
        timeout_s: float = 10.0,
        min_backoff_s: float = 5.0,
        max_backoff_s: float = 600.0,
        jitter: float = 0.1,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(
            zone=zone,
            base_url=base_url,
            interval_s=interval_s,
            stale_after_s=stale_after_s,
            timeout_s=timeout_s,
            min_backoff_s=min_backoff_s,
            max_backoff_s=max_backoff_s,
            jitter=jitter,
            clock=clock,
        )
        if not region:
            raise ValueError("a WattTime region is required (e.g. CAISO_NORTH)")
        self.region = region
        self.token_max_age_s = token_max_age_s
        self.logins = 0
        self._credentials = (username, password)
        self._token: str | None = None
        self._token_at = 0.0

    async def _fetch(self) -> CarbonReading:
        params = {"region": self.region, "signal_type": SIGNAL_TYPE}
        try:
            document = await self._get_json("/v3/forecast", params=params, headers=await self._bearer())
        except ProviderStatusError as exc:
            if exc.status != 401:
                raise
            log.info("WattTime refused the token (401); logging in again")
            self._token = None
            document = await self._get_json("/v3/forecast", params=params, headers=await self._bearer())
        return parse_forecast(document, region=self.region, zone=self.zone)

    async def _bearer(self) -> Mapping[str, str]:
        expired = self.clock.monotonic() - self._token_at > self.token_max_age_s
        if self._token is None or expired:
            self._token = await self._login()
            self._token_at = self.clock.monotonic()
        return {"Authorization": f"Bearer {self._token}"}

    async def _login(self) -> str:
        self.logins += 1
        document: Any = await self._get_json("/login", params={}, auth=self._credentials)
        token = mapping(document, "login").get("token")
        if not isinstance(token, str) or not token:
            raise BadDocumentError("login: no token in the answer")
        return token
