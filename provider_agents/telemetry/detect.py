"""Pick the telemetry source for this host: NVML when the package is importable and a GPU is present, else simulated.

`auto` is what an agent normally runs with. A scenario file describes a simulation, so giving one selects the
simulator even on a GPU host; `simulated` and `nvml` force a choice (`nvml` fails loudly when NVML is unusable,
instead of quietly simulating on a machine that was meant to report real hardware).

`ProviderInputs` are what a provider switched on besides: polled signal channels (the cloud's maintenance notices,
NVSentinel's health events) and a live carbon feed. `wrap` lays them over the detected source, so the agent still
samples one `TelemetrySource`; `start` and `stop` run their polling for as long as the agent runs.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from types import ModuleType

from provider_agents.clock import Clock
from provider_agents.telemetry.carbon import curve_from_spec
from provider_agents.telemetry.carbon_apis import CarbonFeed, LiveCarbonSource
from provider_agents.telemetry.notices import NoticeOverlay, SignalChannel
from provider_agents.telemetry.nvml import NvmlHost
from provider_agents.telemetry.scenario import DEFAULT_REGION, Scenario
from provider_agents.telemetry.simulated import DEFAULT_LOCALITY_GROUP, SimulatedHost
from provider_agents.telemetry.source import TelemetrySource

__all__ = ["ProviderInputs", "SourceKind", "SourceUnavailableError", "detect_source", "host_region", "load_nvml"]

log = logging.getLogger(__name__)


class SourceKind(StrEnum):
    AUTO = "auto"
    SIMULATED = "simulated"
    NVML = "nvml"


class SourceUnavailableError(RuntimeError):
    """The requested source cannot run on this machine."""


def load_nvml() -> ModuleType | None:
    """An initialised `pynvml` module when it imports and sees at least one GPU, else None."""
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError:
        return None
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no usable GPU here
        log.info("NVML is installed but not usable (%s); simulating", exc)
        return None
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except Exception:
        count = 0
    if count == 0:
        nvml.nvmlShutdown()
        return None
    return nvml


def detect_source(
    host: str,
    *,
    kind: SourceKind = SourceKind.AUTO,
    scenario: Scenario | None = None,
    locality_group: str | None = None,
    gpus: int | None = None,
    region: str | None = None,
    seed: int | None = None,
    clock: Clock | None = None,
    nvml_loader: Callable[[], ModuleType | object | None] = load_nvml,
) -> TelemetrySource:
    """The source this host should sample."""
    simulate = kind is SourceKind.SIMULATED or (kind is SourceKind.AUTO and scenario is not None)
    nvml = None if simulate else nvml_loader()
    if kind is SourceKind.NVML and nvml is None:
        raise SourceUnavailableError("NVML source requested, but pynvml is not installed or sees no GPU")
    if nvml is None:
        return SimulatedHost(
            host, scenario=scenario, locality_group=locality_group, gpus=gpus, region=region, seed=seed, clock=clock
        )
    spec = (scenario or Scenario()).host(host)
    resolved_region = host_region(host, scenario=scenario, region=region)
    return NvmlHost(
        host,
        nvml=nvml,
        locality_group=locality_group or spec.locality_group or DEFAULT_LOCALITY_GROUP,
        region=resolved_region,
        carbon=curve_from_spec(resolved_region, (scenario or Scenario()).carbon_for(resolved_region)),
        clock=clock,
    )


def host_region(host: str, *, scenario: Scenario | None = None, region: str | None = None) -> str:
    """The grid zone `host` reports carbon for: `region` as given, else the scenario's for the host, else the default
    (the rule `SimulatedHost` follows too)."""
    return region or (scenario or Scenario()).host(host).region or DEFAULT_REGION


@dataclass(frozen=True)
class ProviderInputs:
    """The polled inputs a provider configured for this host; none by default."""

    channels: tuple[SignalChannel, ...] = ()
    """Merged into every sample's `maintenance` and `failures` (`NoticeOverlay`)."""
    carbon: CarbonFeed | None = None
    """The sample's carbon while it has a fresh reading (`LiveCarbonSource`)."""

    def wrap(self, source: TelemetrySource) -> TelemetrySource:
        """`source` with these inputs laid over it (`source` itself when there are none)."""
        if self.carbon is not None:
            source = LiveCarbonSource(source, feed=self.carbon)
        if self.channels:
            source = NoticeOverlay(source, channels=self.channels)
        return source

    def describe(self) -> str:
        names = [channel.name for channel in self.channels]
        if self.carbon is not None:
            names.append(f"{self.carbon.provider} for {self.carbon.zone}")
        return ", ".join(names) or "none"

    def start(self) -> None:
        """Start every input's polling task."""
        for channel in self.channels:
            channel.start()
        if self.carbon is not None:
            self.carbon.start()

    async def stop(self) -> None:
        """Stop every polling task and close the inputs' HTTP clients (also of inputs never started)."""
        stops: list[Awaitable[None]] = [channel.stop() for channel in self.channels]
        if self.carbon is not None:
            stops.append(self.carbon.stop())
        await asyncio.gather(*stops)
