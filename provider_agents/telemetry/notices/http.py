"""Notice channels' HTTP and lifecycle: requests to a metadata service, and the poll loops under every channel.

A metadata service is local and usually quick, but it does answer 503 while it starts (Azure's first call even
enables the service), hangs under host trouble, or hands out a half-written body. None of that may stop a channel or
make it forget what it knew; the loops use the agent's shared polling core (`provider_agents.telemetry.polling`): a
failed poll is counted, logged once per streak and kind, and retried after a capped exponential backoff; the first
success after a streak says so in one line. The client ignores proxy variables: a metadata address reached through
an HTTP proxy is at best a wrong answer and at worst the proxy's own metadata.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Self

import httpx

from provider_agents.clock import Clock, SystemClock
from provider_agents.telemetry.notices.channel import NoticeError, NoticeView
from provider_agents.telemetry.polling import Background, PollHealth, PollState, http_client, retry_after_s

__all__ = ["Answer", "ChannelHealth", "FetchError", "MetadataHttp", "PollingChannel"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_BACKOFF_CAP_S = 30.0

ChannelHealth = PollHealth
"""A channel's health: its loops' counts summed, `failing` while the latest poll of any of them failed."""


class FetchError(NoticeError):
    """The service could not be read this time: a transport error, a timeout, or a status nobody expects."""


@dataclass(frozen=True)
class Answer:
    status: int
    text: str
    headers: httpx.Headers


class MetadataHttp:
    """An HTTP client for one metadata service: base URL, fixed headers, a timeout per request."""

    def __init__(self, base_url: str, *, headers: Mapping[str, str], timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._client = http_client(base_url, headers=headers, timeout_s=timeout_s)

    async def fetch(
        self,
        method: str,
        path: str,
        *,
        expect: Collection[int] = (200, 404),
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        json: Any = None,
        timeout_s: float | None = None,
    ) -> Answer:
        """One request; any status outside `expect` (and every transport error or timeout) is a `FetchError`."""
        try:
            response = await self._client.request(
                method,
                path,
                headers=headers,
                params=params,
                json=json,
                timeout=self.timeout_s if timeout_s is None else timeout_s,
            )
        except httpx.TimeoutException as exc:
            raise FetchError(f"{path}: timeout", f"{method} {path}: no answer in time ({type(exc).__name__})") from exc
        except httpx.HTTPError as exc:
            raise FetchError(f"{path}: {type(exc).__name__}", f"{method} {path}: {exc!r}") from exc
        if response.status_code not in expect:
            raise FetchError(
                f"{path}: HTTP {response.status_code}",
                f"{method} {path}: HTTP {response.status_code}",
                retry_after_s=retry_after_s(response.headers),
            )
        return Answer(status=response.status_code, text=response.text, headers=response.headers)

    async def aclose(self) -> None:
        await self._client.aclose()


PollOnce = Callable[[], Awaitable[float | None]]
"""One poll; returns how long to wait before the next one (None: the poll interval). Raises to report a failure."""


class PollingChannel:
    """A channel's lifecycle and poll loops; each cloud's subclass says what one poll does and what its view is.

    `run()` polls until cancelled (for a caller that owns a task group); `start()`/`stop()`, or `async with`, run it
    in a task of its own. A subclass with more than one loop (GCP's long-poll) overrides `loops()`.
    """

    def __init__(
        self,
        *,
        name: str,
        base_url: str,
        headers: Mapping[str, str],
        poll_interval_s: float,
        timeout_s: float,
        backoff_cap_s: float,
        clock: Clock | None,
    ) -> None:
        if poll_interval_s <= 0 or timeout_s <= 0:
            raise ValueError("poll_interval_s and timeout_s must be positive")
        self.name = name
        self.poll_interval_s = poll_interval_s
        self.backoff_cap_s = max(backoff_cap_s, poll_interval_s)
        self.clock: Clock = clock or SystemClock()
        self.http = MetadataHttp(base_url, headers=headers, timeout_s=timeout_s)
        self._background = Background(f"notices:{name}", logger=log)
        self._loops: dict[str, PollState] = {}
        self._last_error: str | None = None

    # --- what a subclass provides -------------------------------------------------------------------------------

    def view(self, now: datetime) -> NoticeView:
        """The latest valid view, statuses as of `now`."""
        raise NotImplementedError

    async def poll_once(self) -> float | None:
        """One poll of every endpoint the channel reads; raises `NoticeError` when any of them failed."""
        raise NotImplementedError

    def loops(self) -> dict[str, PollOnce]:
        return {"poll": self.poll_once}

    # --- running ---------------------------------------------------------------------------------------------------

    @property
    def health(self) -> ChannelHealth:
        states = self._loops.values()
        return ChannelHealth(
            successes=sum(state.successes for state in states),
            failures=sum(state.failures for state in states),
            failing=any(state.failing for state in states),
            last_error=self._last_error,
        )

    async def run(self) -> None:
        """Poll until cancelled."""
        await asyncio.gather(*(self._loop(label, once) for label, once in self.loops().items()))

    def start(self) -> None:
        self._background.start(self.run)

    async def stop(self) -> None:
        await self._background.stop()
        await self.http.aclose()

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _loop(self, label: str, once: PollOnce) -> None:
        state = self._loops.get(label)
        if state is None:
            state = PollState(
                f"{self.name} ({label})",
                first_backoff_s=self.poll_interval_s,
                max_backoff_s=self.backoff_cap_s,
                logger=log,
            )
            self._loops[label] = state
        while True:
            try:
                wait = await once()
            except NoticeError as exc:
                delay = self._failed(state, exc.key, str(exc), retry_after_s=exc.retry_after_s)
            except Exception as exc:  # a bug or a surprise in a parser must not end the channel either
                delay = self._failed(state, type(exc).__name__, f"unexpected {exc!r}")
            else:
                state.succeeded()
                delay = self.poll_interval_s if wait is None else wait
            await self.clock.sleep(delay)

    def _failed(self, state: PollState, key: str, message: str, *, retry_after_s: float | None = None) -> float:
        self._last_error = message
        return state.failed(key, message, retry_after_s=retry_after_s)
