"""A polled carbon-intensity feed: the latest valid reading of one grid zone, how old it is, and a curve over it.

A provider's API is slow, rate-limited and sometimes wrong, and the agent samples its host every tick: so the feed
polls on its own (`run`, or `start()`/`stop()`), and the agent only reads what the feed holds (`current`, or
`LiveCarbonCurve`). A poll either yields a whole valid reading or nothing: an HTTP error, a timeout or a bad document
is logged (once per streak and kind), the next poll waits longer (exponential backoff from `min_backoff_s`, capped at
`max_backoff_s`, at least a `Retry-After` the provider sent: the agent's shared polling core,
`provider_agents.telemetry.polling`), and the previous valid reading is kept. The client honours proxy variables:
these are public APIs on the internet, which a provider's hosts may only reach through a proxy.

Staleness: a reading is fresh for `stale_after_s` after the document that carried it arrived (monotonic clock).
After that `current()` returns None and `stale` is True, logged once: nobody has confirmed the number for that long,
so the agent should not report it as today's grid. The reading is still kept (`latest()`) and is current again as
soon as a valid document arrives. `LiveCarbonCurve` answers from its fallback curve meanwhile.

While fresh, `current(at)` moves along the reading's forecast: the value is that of the last point at or before `at`,
and the forecast the points after it, so a 5-minute forecast stays right between 5-minute polls.
"""

from __future__ import annotations

import logging
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

import httpx

from provider_agents.clock import Clock, SystemClock
from provider_agents.telemetry.carbon import CarbonCurve
from provider_agents.telemetry.carbon_apis.documents import BadDocumentError
from provider_agents.telemetry.model import REGION_PATTERN, CarbonPoint, CarbonReading
from provider_agents.telemetry.polling import Background, PollHealth, PollState, failure_key, http_client, retry_after_s

__all__ = ["CarbonFeed", "CurrentReading", "LiveCarbonCurve", "ProviderStatusError", "reading_at"]

log = logging.getLogger(__name__)


class ProviderStatusError(Exception):
    """The provider answered with an HTTP error status."""

    def __init__(self, status: int, path: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(f"HTTP {status} from {path}")
        self.status = status
        self.retry_after_s = retry_after_s


class CurrentReading(Protocol):
    def current(self, at: datetime | None = None) -> CarbonReading | None:
        """The fresh reading as of `at`, or None."""
        ...


def reading_at(reading: CarbonReading, at: datetime) -> CarbonReading:
    """`reading` moved along its own forecast to `at` (unchanged when `at` is before its first forecast point)."""
    points = (CarbonPoint(at=reading.observed_at, g_per_kwh=reading.g_per_kwh), *reading.forecast)
    index = 0
    for i, point in enumerate(points):
        if point.at > at:
            break
        index = i
    if index == 0:
        return reading
    now, ahead = points[index], points[index + 1 :]
    return CarbonReading(region=reading.region, g_per_kwh=now.g_per_kwh, observed_at=now.at, forecast=ahead)


class CarbonFeed(ABC):
    """Polls one provider for one zone; keeps the latest valid reading. Subclasses implement `_fetch`."""

    provider = "carbon API"

    def __init__(
        self,
        *,
        zone: str,
        base_url: str,
        interval_s: float,
        stale_after_s: float,
        timeout_s: float = 10.0,
        min_backoff_s: float = 5.0,
        max_backoff_s: float = 600.0,
        jitter: float = 0.1,
        headers: Mapping[str, str] | None = None,
        clock: Clock | None = None,
    ) -> None:
        if re.fullmatch(REGION_PATTERN, zone) is None:
            raise ValueError(f"zone {zone!r} is not a public grid zone key (e.g. DE, US-CAL-CISO)")
        if min(interval_s, stale_after_s, timeout_s, min_backoff_s) <= 0 or min_backoff_s > max_backoff_s:
            raise ValueError("intervals, timeout and backoffs must be positive, min_backoff_s <= max_backoff_s")
        if not 0.0 <= jitter < 1.0:
            raise ValueError("jitter is a fraction in [0, 1)")
        self.zone = zone
        self.interval_s = interval_s
        self.stale_after_s = stale_after_s
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.jitter = jitter
        self.clock: Clock = clock or SystemClock()
        self._poll = PollState(
            f"{self.provider} poll for {zone}", first_backoff_s=min_backoff_s, max_backoff_s=max_backoff_s, logger=log
        )
        self._client = http_client(base_url, timeout_s=timeout_s, headers=headers, trust_env=True)
        self._background = Background(f"carbon:{self.provider}:{zone}", logger=log)
        self._reading: CarbonReading | None = None
        self._fetched_at: float | None = None
        self._stale_reported = False
        self._random = random.Random()

    @abstractmethod
    async def _fetch(self) -> CarbonReading:
        """One valid reading from the provider, or an exception (HTTP, `ProviderStatusError`, `BadDocumentError`)."""

    @property
    def polls(self) -> int:
        """Polls completed, successful or not."""
        return self._poll.polls

    @property
    def failures(self) -> int:
        """Consecutive failed polls (0 after a success)."""
        return self._poll.consecutive_failures

    @property
    def last_error(self) -> str | None:
        """What the latest poll failed with; None after a success."""
        return self._poll.last_error if self._poll.failing else None

    @property
    def health(self) -> PollHealth:
        return self._poll.health

    def latest(self) -> CarbonReading | None:
        """The last valid reading as fetched, fresh or stale; None before the first."""
        return self._reading

    def age_s(self) -> float | None:
        """Seconds since the last valid reading arrived."""
        return None if self._fetched_at is None else self.clock.monotonic() - self._fetched_at

    @property
    def stale(self) -> bool:
        """True without a reading, or when the last valid one is older than `stale_after_s`."""
        age = self.age_s()
        return age is None or age > self.stale_after_s

    def current(self, at: datetime | None = None) -> CarbonReading | None:
        """The fresh reading moved along its forecast to `at` (default: now); None when there is none or it is stale."""
        if self._reading is None:
            return None
        if self.stale:
            if not self._stale_reported:
                self._stale_reported = True
                log.warning(
                    "%s reading for %s is stale (%.0fs old, limit %.0fs): not reported until a valid one arrives",
                    self.provider,
                    self.zone,
                    self.age_s() or 0.0,
                    self.stale_after_s,
                )
            return None
        return reading_at(self._reading, at or self.clock.now())

    @property
    def next_delay_s(self) -> float:
        """How long `run` waits before the next poll (before jitter): the interval, or the backoff after failures."""
        return self._poll.next_delay_s(self.interval_s)

    async def poll_once(self) -> bool:
        """One poll. True with a new valid reading; False (logged, previous reading kept) otherwise."""
        try:
            reading = await self._fetch()
        except (httpx.HTTPError, ProviderStatusError, ValueError) as exc:  # BadDocumentError is a ValueError
            if isinstance(exc, ProviderStatusError):
                key, wait = f"HTTP {exc.status}", exc.retry_after_s
            else:
                key, wait = failure_key(exc), None
            self._poll.failed(key, f"{type(exc).__name__}: {exc}", retry_after_s=wait)
            return False
        self._reading = reading
        self._fetched_at = self.clock.monotonic()
        self._poll.succeeded()
        if self._stale_reported:
            self._stale_reported = False
            log.info("%s reading for %s is fresh again", self.provider, self.zone)
        return True

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            await self.poll_once()
            spread = self.jitter * (2.0 * self._random.random() - 1.0)
            await self.clock.sleep(self.next_delay_s * (1.0 + spread))

    def start(self) -> None:
        """Poll in a task of its own (nothing new while one runs)."""
        self._background.start(self.run)

    async def stop(self) -> None:
        """Stop polling and release the HTTP client."""
        await self._background.stop()
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _get_json(
        self,
        path: str,
        *,
        params: Mapping[str, str],
        headers: Mapping[str, str] | None = None,
        auth: tuple[str, str] | None = None,
    ) -> Any:
        response = await self._client.get(path, params=params, headers=headers, auth=auth)
        if response.status_code >= 400:
            raise ProviderStatusError(response.status_code, path, retry_after_s=retry_after_s(response.headers))
        try:
            return response.json()
        except ValueError as exc:
            raise BadDocumentError(f"{path}: not a JSON document ({exc})") from None


@dataclass(frozen=True)
class LiveCarbonCurve:
    """A `CarbonCurve` over a feed: the feed's fresh reading at the sampled time, else the `fallback` curve's.

    The fallback (a replayed trace, a constant `StepCurve`) keeps the agent's samples whole while the provider is
    unreachable or stale; readings from it carry the fallback's region and values, not the provider's.
    """

    feed: CurrentReading
    fallback: CarbonCurve

    def reading(self, *, start: datetime, offset_s: float) -> CarbonReading:
        live = self.feed.current(start + timedelta(seconds=offset_s))
        if live is not None:
            return live
        return self.fallback.reading(start=start, offset_s=offset_s)
