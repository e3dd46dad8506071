"""How an app negotiates: the clock, offer lifetime, carbon forecast, regions and background intervals.

Passed to `create_app(..., negotiation=NegotiationOptions(...))`; every field has a working default, so existing
callers need nothing new. Tests inject a clock to move time without sleeping; the local cloud replays the carbon
trace faster than real time with `carbon_speedup`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from api.models import utcnow
from api.services.carbon_forecast import CarbonForecast, TraceReplayForecast, load_trace
from api.services.negotiation_policy import DEFAULT_OFFER_TTL
from api.services.negotiations import NegotiationContext


@dataclass(frozen=True)
class NegotiationOptions:
    """Knobs of the negotiation machinery; `forecast=None` replays the shipped trace from the app's creation."""

    clock: Callable[[], datetime] = utcnow
    offer_ttl: timedelta = DEFAULT_OFFER_TTL
    forecast: CarbonForecast | None = None
    carbon_speedup: float = 1.0
    region: str | None = None
    known_regions: tuple[str, ...] = ()
    sweep_interval_s: float = 1.0
    relay_poll_interval_s: float = 0.25
    relay_backoff_max_s: float = 5.0


@dataclass(frozen=True)
class NegotiationRuntime:
    """The options resolved once per app (the default forecast anchored at the app's creation)."""

    clock: Callable[[], datetime]
    offer_ttl: timedelta
    forecast: CarbonForecast
    region: str
    known_regions: tuple[str, ...]
    sweep_interval_s: float
    relay_poll_interval_s: float
    relay_backoff_max_s: float

    @classmethod
    def resolve(cls, options: NegotiationOptions) -> NegotiationRuntime:
        forecast = options.forecast
        region = options.region
        if forecast is None:
            trace = load_trace()
            forecast = TraceReplayForecast(anchor=options.clock(), speedup=options.carbon_speedup, trace=trace)
            region = region or trace.zone
        region = region or load_trace().zone
        return cls(
            clock=options.clock,
            offer_ttl=options.offer_ttl,
            forecast=forecast,
            region=region,
            known_regions=options.known_regions or (region,),
            sweep_interval_s=options.sweep_interval_s,
            relay_poll_interval_s=options.relay_poll_interval_s,
            relay_backoff_max_s=options.relay_backoff_max_s,
        )

    def context(self, *, pseudonym_secret: bytes = b"") -> NegotiationContext:
        """The context of one request: the time now, and everything else as configured."""
        return NegotiationContext(
            now=self.clock(),
            forecast=self.forecast,
            region=self.region,
            known_regions=self.known_regions,
            offer_ttl=self.offer_ttl,
            pseudonym_secret=pseudonym_secret,
        )
