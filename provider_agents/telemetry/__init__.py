"""Telemetry sources behind one small interface (`TelemetrySource.sample() -> HostTelemetry`).

`HostTelemetry` is raw and provider-internal; `provider_agents.projection` is the only way from it to a tenant.
Sources: `SimulatedHost` (seeded, scenario-driven, deterministic), `NvmlHost` (real NVIDIA GPUs), chosen by
`detect_source`. Carbon comes from curves (`carbon.py`), by default a faster-than-real-time replay of a real trace.
`ProviderInputs` lay polled inputs over a source: cloud notices (`notices`), NVSentinel's health events
(`gpu_health`), a live carbon API (`carbon_apis`), all on one polling core (`polling`).
"""

from provider_agents.telemetry.carbon import CarbonCurve, StepCurve, TraceReplay, curve_from_spec, load_trace
from provider_agents.telemetry.detect import (
    ProviderInputs,
    SourceKind,
    SourceUnavailableError,
    detect_source,
    host_region,
    load_nvml,
)
from provider_agents.telemetry.model import (
    CarbonPoint,
    CarbonReading,
    FabricSample,
    FailureSignal,
    GpuHealth,
    GpuSample,
    HostTelemetry,
    LinkCongestion,
    MaintenanceNotice,
    RawFailureKind,
)
from provider_agents.telemetry.nvml import NvmlHost
from provider_agents.telemetry.scenario import Scenario, ScenarioError, load_scenario, parse_scenario
from provider_agents.telemetry.simulated import SimulatedHost
from provider_agents.telemetry.source import TelemetrySource

__all__ = [
    "CarbonCurve",
    "CarbonPoint",
    "CarbonReading",
    "FabricSample",
    "FailureSignal",
    "GpuHealth",
    "GpuSample",
    "HostTelemetry",
    "LinkCongestion",
    "MaintenanceNotice",
    "NvmlHost",
    "ProviderInputs",
    "RawFailureKind",
    "Scenario",
    "ScenarioError",
    "SimulatedHost",
    "SourceKind",
    "SourceUnavailableError",
    "StepCurve",
    "TelemetrySource",
    "TraceReplay",
    "curve_from_spec",
    "detect_source",
    "host_region",
    "load_nvml",
    "load_scenario",
    "load_trace",
    "parse_scenario",
]
