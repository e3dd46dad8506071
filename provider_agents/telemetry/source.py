"""The one small interface every telemetry source implements.

The agent asks for a snapshot once per tick and does not care where it came from: a simulated host driven by a
scenario, NVML on a real GPU host, or a scripted list in a test. A source raises when it cannot read the host this
tick; the agent treats that as an observed state (`source_failed`), not as a crash.
"""

from __future__ import annotations

from typing import Protocol

from provider_agents.telemetry.model import HostTelemetry

__all__ = ["TelemetrySource"]


class TelemetrySource(Protocol):
    host: str
    locality_group: str

    def sample(self) -> HostTelemetry:
        """The host's state now (on the source's clock)."""
        ...
