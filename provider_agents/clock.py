"""The clock every agent component reads, injectable so tests drive time instead of sleeping through scenarios.

Two readings, because they answer different questions: `now()` is wall-clock UTC (what goes into events and what
scenario offsets are measured against), `monotonic()` is for measuring intervals (heartbeat deadlines), which must not
jump when NTP steps the wall clock. `ManualClock` advances both together, only when a test says so; its `sleep`
returns once the test has advanced time far enough, so a loop under test runs exactly as far as the test drives it.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Protocol

__all__ = ["Clock", "ManualClock", "SystemClock"]


class Clock(Protocol):
    def now(self) -> datetime:
        """Aware UTC wall-clock time."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` on this clock."""
        ...


class SystemClock:
    """The real clock."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class ManualClock:
    """A clock that moves only when `advance` is called."""

    def __init__(self, start: datetime) -> None:
        if start.tzinfo is None:
            raise ValueError("ManualClock needs an aware start time")
        self._now = start.astimezone(UTC)
        self._elapsed = 0.0
        self._moved = asyncio.Condition()
        self._wakers: set[asyncio.Task[None]] = set()

    def now(self) -> datetime:
        return self._now

    def monotonic(self) -> float:
        return self._elapsed

    def advance(self, seconds: float) -> None:
        """Move time forward and wake the sleepers whose time has come."""
        if seconds < 0:
            raise ValueError("time does not go backwards")
        self._now += timedelta(seconds=seconds)
        self._elapsed += seconds
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop, so nobody can be sleeping
        task = loop.create_task(self._notify())
        self._wakers.add(task)
        task.add_done_callback(self._wakers.discard)

    async def _notify(self) -> None:
        async with self._moved:
            self._moved.notify_all()

    async def sleep(self, seconds: float) -> None:
        wake_at = self._elapsed + max(0.0, seconds)
        async with self._moved:
            await self._moved.wait_for(lambda: self._elapsed >= wake_at)
