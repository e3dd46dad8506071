"""Pick the telemetry source for this host: NVML when the package is importable and a GPU is present, else simulated.

`auto` is what an agent normally runs with. A scenario file describes a simulation, so giving one selects the
simulator even on a GPU host; `simulated` and `nvml` force a choice (`nvml` fails loudly when NVML is unusable,
instead of quietly simulating on a machine that was meant to report real hardware).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from enum import StrEnum
from types import ModuleType

from provider_agents.clock import Clock
from provider_agents.telemetry.carbon import curve_from_spec
from provider_agents.telemetry.nvml import NvmlHost
from provider_agents.telemetry.scenario import Scenario
from provider_agents.telemetry.simulated import DEFAULT_LOCALITY_GROUP, SimulatedHost
from provider_agents.telemetry.source import TelemetrySource

__all__ = ["SourceKind", "SourceUnavailableError", "detect_source", "load_nvml"]

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
    resolved_region = region or spec.region or "US-CAL-CISO"
    return NvmlHost(
        host,
        nvml=nvml,
        locality_group=locality_group or spec.locality_group or DEFAULT_LOCALITY_GROUP,
        region=resolved_region,
        carbon=curve_from_spec(resolved_region, (scenario or Scenario()).carbon_for(resolved_region)),
        clock=clock,
    )
