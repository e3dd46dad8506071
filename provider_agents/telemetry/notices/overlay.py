"""`NoticeOverlay`: a telemetry source that is another source plus the signals of polled channels: the cloud's
maintenance and preemption notices, NVSentinel's health events.

NVML knows the GPUs but nothing of the cloud's plans for the VM; the metadata service knows the plans but nothing
of the GPUs; NVSentinel knows more of the GPUs' health than NVML's counters. The overlay samples its base source and
adds the latest valid view of each channel (`SignalChannel`: notices to `maintenance`, signals to `failures`), so an
agent reads "NVML + Azure Scheduled Events + NVSentinel" as one `TelemetrySource`. `sample()` stays synchronous and
cheap: the channels poll in their own tasks (started by `start()` or `async with`), and a sample only reads what they
last accepted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Self

from provider_agents.telemetry.model import HostTelemetry
from provider_agents.telemetry.notices.channel import SignalChannel
from provider_agents.telemetry.source import TelemetrySource

__all__ = ["NoticeOverlay"]


class NoticeOverlay:
    """`base`'s telemetry with the views of `channels` merged into `maintenance` and `failures`."""

    def __init__(self, base: TelemetrySource, *, channels: Sequence[SignalChannel]) -> None:
        self.base = base
        self.channels = tuple(channels)
        self.host = base.host
        self.locality_group = base.locality_group

    def sample(self) -> HostTelemetry:
        telemetry = self.base.sample()
        views = [channel.view(telemetry.sampled_at) for channel in self.channels]
        maintenance = tuple(notice for view in views for notice in view.maintenance)
        failures = tuple(signal for view in views for signal in view.failures)
        if not maintenance and not failures:
            return telemetry
        # Both sides are validated models already, and merging cannot break HostTelemetry's own invariants (it has
        # none across these tuples), so the copy skips a second validation of the whole snapshot.
        return telemetry.model_copy(
            update={
                "maintenance": telemetry.maintenance + maintenance,
                "failures": telemetry.failures + failures,
            }
        )

    def start(self) -> None:
        """Start every channel's polling task."""
        for channel in self.channels:
            channel.start()

    async def stop(self) -> None:
        """Stop every channel (the base source has nothing to stop)."""
        await asyncio.gather(*(channel.stop() for channel in self.channels))

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
