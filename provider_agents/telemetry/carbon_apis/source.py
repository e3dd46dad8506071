"""`LiveCarbonSource`: a telemetry source whose carbon is a live feed's while the feed has a fresh reading.

This is `LiveCarbonCurve`'s rule applied to a whole source, for sources whose curve is their own: a simulated host
replays its scenario's curve (and an injected scenario may replace it), an NVML host its configured one. The fallback
is therefore whatever the base source reports at that moment, so nothing changes for the base while the provider is
unreachable or its reading is stale.
"""

from __future__ import annotations

from provider_agents.telemetry.carbon_apis.feed import CurrentReading
from provider_agents.telemetry.model import HostTelemetry
from provider_agents.telemetry.source import TelemetrySource

__all__ = ["LiveCarbonSource"]


class LiveCarbonSource:
    """`base`'s telemetry with `feed`'s fresh reading (moved along its forecast to the sample's time) as its carbon."""

    def __init__(self, base: TelemetrySource, *, feed: CurrentReading) -> None:
        self.base = base
        self.feed = feed
        self.host = base.host
        self.locality_group = base.locality_group

    def sample(self) -> HostTelemetry:
        telemetry = self.base.sample()
        live = self.feed.current(telemetry.sampled_at)
        if live is None:
            return telemetry
        # A validated reading into a validated snapshot: nothing across the two for a second validation to check.
        return telemetry.model_copy(update={"carbon": live})
