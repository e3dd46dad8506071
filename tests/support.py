"""Small helpers for tests: wait on conditions with deadlines (never bare sleeps), count deliveries, capture errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import StreamConfig
from nats.js.client import JetStreamContext
from nats.js.errors import APIError


class ManualClock:
    """A clock of seconds (monotonic or wall, as the code under test takes it) that moves only when a test moves it:
    `clock.now += 1.5`. Deadlines, windows and rates are tested without sleeping."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], *, timeout: float = 5.0, interval: float = 0.01, what: str = ""
) -> float:
    """Poll `predicate` until it holds; return the seconds it took, or fail naming `what`."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        result = predicate()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return time.monotonic() - start
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.1f} s waiting for {what or predicate!r}")
        await asyncio.sleep(interval)


@dataclass
class ClientProbe:
    """A NATS connection that records the async errors the server sends (permission violations do not raise)."""

    client: Client
    errors: list[str] = field(default_factory=list)
    disconnects: int = 0

    def violations(self, needle: str = "") -> list[str]:
        return [e for e in self.errors if "permissions violation" in e.lower() and needle.lower() in e.lower()]


async def connect_probe(url: str, seed: str, **options: Any) -> ClientProbe:
    probe = ClientProbe(client=None)  # type: ignore[arg-type]

    async def on_error(exc: Exception) -> None:
        probe.errors.append(str(exc))

    async def on_disconnect() -> None:
        probe.disconnects += 1

    probe.client = await nats.connect(
        url, nkeys_seed_str=seed, error_cb=on_error, disconnected_cb=on_disconnect, **options
    )
    return probe


class Inbox:
    """Collects messages from a subscription callback, so tests can assert exact counts."""

    def __init__(self) -> None:
        self.messages: list[Msg] = []

    async def on_message(self, msg: Msg) -> None:
        self.messages.append(msg)

    @property
    def subjects(self) -> list[str]:
        return [m.subject for m in self.messages]


async def add_stream_once_the_cluster_serves(
    js: JetStreamContext, config: StreamConfig, *, timeout: float = 30.0
) -> None:
    """Create a stream on a cluster that was just started: its nodes accept clients before they have elected a
    meta leader, and until then the request fails or goes unanswered."""

    async def created() -> bool:
        try:
            await js.add_stream(config)
            return True
        except (APIError, NatsTimeout, NoRespondersError):
            return False

    await eventually(created, timeout=timeout, interval=0.2, what=f"stream {config.name} created on the cluster")
