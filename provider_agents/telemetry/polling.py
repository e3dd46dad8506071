"""The polling core the agent's HTTP inputs share: cloud notices, NVSentinel health events, carbon APIs.

Each input polls a service that is at times slow, down or wrong, and none of that may end its loop or make it forget
what it last read. So every poll loop keeps a `PollState`: counters (its `PollHealth`, for whoever watches), a
`Backoff` (after a failure the next poll waits a delay that doubles from a first value up to a cap, and at least what
a `Retry-After` asked for, within that cap), and a `FailureStreak` (each kind of failure logged once per streak, and
the recovery once, instead of a line per poll against a service that is down). `http_client` builds the one kind of
httpx client they use: one timeout for every phase, proxy variables ignored unless the caller asks for them.
`Background` runs a loop in a task of its own and stops it without leaving the task behind.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

__all__ = [
    "Background",
    "Backoff",
    "FailureStreak",
    "PollHealth",
    "PollState",
    "failure_key",
    "http_client",
    "retry_after_s",
]

log = logging.getLogger(__name__)


def http_client(
    base_url: str = "",
    *,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
    trust_env: bool = False,
) -> httpx.AsyncClient:
    """An `httpx.AsyncClient` with `timeout_s` for every phase of a request.

    `trust_env` stays off for node-local services (metadata, a health relay): one reached through an HTTP proxy is
    at best a wrong answer and at worst the proxy's own. Public APIs on the internet may need the proxy.
    """
    if timeout_s <= 0:
        raise ValueError("timeout_s must be positive")
    return httpx.AsyncClient(
        base_url=base_url.rstrip("/"), headers=dict(headers or {}), timeout=timeout_s, trust_env=trust_env
    )


def retry_after_s(headers: httpx.Headers | Mapping[str, str], *, now: datetime | None = None) -> float | None:
    """A `Retry-After` header as seconds from `now`: delay-seconds or an HTTP-date; None when absent or unreadable."""
    value = (httpx.Headers(headers).get("retry-after") or "").strip()  # header names in any case
    if value.isdigit():
        return float(value)
    if not value:
        return None
    try:
        at = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if at.tzinfo is None:
        return None
    return max(0.0, (at - (now or datetime.now(UTC))).total_seconds())


def failure_key(exc: BaseException) -> str:
    """The kind of a failed request, for `FailureStreak`: a timeout, an HTTP status, else the exception's type."""
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return type(exc).__name__


class Backoff:
    """Delays after consecutive failures: `first_s`, doubling, never above `cap_s`; `reset` after a success.

    A `Retry-After` the service sent raises the delay to at least that much, still within `cap_s`: a server that asks
    for a day must not park the input for a day.
    """

    def __init__(self, *, first_s: float, cap_s: float) -> None:
        if first_s <= 0 or cap_s < first_s:
            raise ValueError("backoff needs 0 < first_s <= cap_s")
        self.first_s = first_s
        self.cap_s = cap_s
        self.failures = 0
        """Consecutive failures since the last `reset`."""
        self._retry_after_s: float | None = None

    @property
    def delay_s(self) -> float:
        """The wait after the latest failure (0.0 when there is none)."""
        if self.failures == 0:
            return 0.0
        exponential = self.first_s * 2.0 ** min(self.failures - 1, 32)
        return min(self.cap_s, max(exponential, self._retry_after_s or 0.0))

    def failed(self, *, retry_after_s: float | None = None) -> float:
        """Count one failure; the delay before the next try."""
        self.failures += 1
        self._retry_after_s = retry_after_s
        return self.delay_s

    def reset(self) -> None:
        self.failures = 0
        self._retry_after_s = None


class FailureStreak:
    """Logs each kind of failure once per streak (a warning; repeats at debug), and the end of a streak once."""

    def __init__(self, what: str, *, logger: logging.Logger | None = None) -> None:
        self.what = what
        self.length = 0
        self._log = logger or log
        self._logged: set[str] = set()

    def failed(self, key: str, message: str, *, retry_in_s: float | None = None) -> None:
        self.length += 1
        then = "" if retry_in_s is None else f", next try in {retry_in_s:.3g}s"
        if key in self._logged:
            self._log.debug("%s: %s (failure %d in a row%s)", self.what, message, self.length, then)
            return
        self._logged.add(key)
        self._log.warning("%s: %s; keeping what it last read%s", self.what, message, then)

    def succeeded(self) -> None:
        if self.length:
            self._log.info("%s: answering again after %d failed polls", self.what, self.length)
        self.length = 0
        self._logged.clear()


@dataclass(frozen=True)
class PollHealth:
    """Counts since the loop (or channel) started; `failing` while its latest poll failed."""

    successes: int
    failures: int
    failing: bool
    last_error: str | None
    """The latest failure's message, kept after a recovery."""


class PollState:
    """What one poll loop knows about itself: counters, its backoff and its failure streak.

    A loop calls `succeeded()` or `failed(...)` once per poll and waits `next_delay_s(interval)` before the next.
    """

    def __init__(
        self, what: str, *, first_backoff_s: float, max_backoff_s: float, logger: logging.Logger | None = None
    ) -> None:
        self.backoff = Backoff(first_s=first_backoff_s, cap_s=max_backoff_s)
        self.streak = FailureStreak(what, logger=logger)
        self.successes = 0
        self.failures = 0
        """Failed polls in all, not only in a row (that is `consecutive_failures`)."""
        self.last_error: str | None = None

    @property
    def polls(self) -> int:
        """Polls completed, successful or not."""
        return self.successes + self.failures

    @property
    def consecutive_failures(self) -> int:
        return self.backoff.failures

    @property
    def failing(self) -> bool:
        return self.backoff.failures > 0

    @property
    def health(self) -> PollHealth:
        return PollHealth(
            successes=self.successes, failures=self.failures, failing=self.failing, last_error=self.last_error
        )

    def succeeded(self) -> None:
        self.successes += 1
        self.streak.succeeded()
        self.backoff.reset()

    def failed(self, key: str, message: str, *, retry_after_s: float | None = None) -> float:
        """Count a failed poll of kind `key` and log it (once per streak); the backoff before the next poll."""
        self.failures += 1
        self.last_error = message
        delay = self.backoff.failed(retry_after_s=retry_after_s)
        self.streak.failed(key, message, retry_in_s=delay)
        return delay

    def next_delay_s(self, interval_s: float) -> float:
        """The regular `interval_s`, or the backoff while failing."""
        return self.backoff.delay_s if self.failing else interval_s


class Background:
    """One coroutine in a task of its own: `start` (nothing new while it runs), `stop` (cancel, then wait for it)."""

    def __init__(self, name: str, *, logger: logging.Logger | None = None) -> None:
        self.name = name
        self._log = logger or log
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        if not self.running:
            self._task = asyncio.get_running_loop().create_task(run(), name=self.name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        # gather, not a bare await: the task's own cancellation is its result, while a cancellation of stop() itself
        # still propagates.
        (outcome,) = await asyncio.gather(task, return_exceptions=True)
        if isinstance(outcome, Exception):  # poll loops catch everything; this is only the last line of defence
            self._log.error("%s ended with %r", self.name, outcome)
