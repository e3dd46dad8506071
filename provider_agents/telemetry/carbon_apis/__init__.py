"""Live grid carbon intensity from public APIs (WattTime, Electricity Maps), as the agent's `CarbonReading`s.

Each provider is a feed (`CarbonFeed`): it polls on its own with a timeout and capped exponential backoff, keeps the
latest valid reading and marks it stale after a configurable age (`feed.py` says what happens then). The agent reads
`feed.current()`, wraps the feed in a `LiveCarbonCurve` with a fallback curve, which fits where a `CarbonCurve`
(`provider_agents.telemetry.carbon`) goes, or wraps a whole telemetry source in a `LiveCarbonSource`, whose fallback
is the source's own curve. Keys and credentials are constructor arguments; nothing here reads settings or the
environment.
"""

from provider_agents.telemetry.carbon_apis.documents import BadDocumentError
from provider_agents.telemetry.carbon_apis.electricitymaps import ELECTRICITY_MAPS_URL, ElectricityMapsFeed
from provider_agents.telemetry.carbon_apis.feed import CarbonFeed, LiveCarbonCurve, ProviderStatusError, reading_at
from provider_agents.telemetry.carbon_apis.source import LiveCarbonSource
from provider_agents.telemetry.carbon_apis.watttime import GRAMS_PER_POUND, WATTTIME_URL, WattTimeFeed, to_g_per_kwh

__all__ = [
    "ELECTRICITY_MAPS_URL",
    "GRAMS_PER_POUND",
    "WATTTIME_URL",
    "BadDocumentError",
    "CarbonFeed",
    "ElectricityMapsFeed",
    "LiveCarbonCurve",
    "LiveCarbonSource",
    "ProviderStatusError",
    "WattTimeFeed",
    "reading_at",
    "to_g_per_kwh",
]
