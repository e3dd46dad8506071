"""Scenario files: what a simulated fleet goes through, as a YAML file validated by pydantic.

A scenario schedules congestion episodes, failures, predicted failures and maintenance notices, and gives each grid
region a carbon curve. Every time in it is an offset from the scenario start (`3s`, `250ms`, `2m`, `1.5h`, or a bare
number of seconds); the start is the agent's start unless the file pins it (`start: 2025-01-01T00:00:00Z`), which
is how several agent processes replay one scenario in step. Without a carbon entry, a region replays the real CAISO
trace shipped in `harmonaize/data/carbon/` (59 hours of hourly data), faster than real time by `speedup`.

The file names provider-internal things (host ids, locality groups, link names, notice ids): it is the provider's
view, like raw telemetry, and none of those names reach a tenant.

Errors name the field (`congestion[0].slowdown: ...`) and, for YAML syntax, the line, so a scenario author can fix
the file without reading this code. Example (every section is optional):

    version: 1
    seed: 7
    hosts:
      h1: {locality_group: g1, gpus: 8, region: US-CAL-CISO}
    fabric: {intra_group_gbps: 400, inter_group_gbps: 100}
    congestion:
      - {groups: [g1], link: leaf-g1-up3, start: 3s, duration: 3s, slowdown: 2.5}
    failures:
      - {host: h2, at: 2s, kind: gpu_error, gpu: 3, reason: xid_79}
    predicted_failures:
      - {host: h1, at: 1s, eta: 30s, confidence: 0.9, gpu: 0, reason: ecc_uncorrectable}
    maintenance:
      - {host: h3, notice: tkt-4711, kind: reboot, announce: 1s, start: 5s, end: 7s}
    carbon:
      US-CAL-CISO: {trace: caiso, speedup: 3600}
      DE: {points: [{at: 0s, g_per_kwh: 380}, {at: 4s, g_per_kwh: 210}]}
    link_rates:  # testbed only
      - {group: g2, start: 4s, duration: 5s, mbit: 10}
    partitions:  # testbed only
      - {host: h4, at: 6s, duration: 2s}
"""

from __future__ import annotations

import re
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from harmonaize.events import MaintenanceKind, UtcDatetime
from harmonaize.ids import ID_PATTERN
from harmonaize.subjects import provider_subject
from provider_agents.telemetry.model import RegionCode

__all__ = [
    "DEFAULT_REGION",
    "DEFAULT_SPEEDUP",
    "CarbonSpec",
    "CongestionEpisode",
    "FabricSpec",
    "HostSpec",
    "LinkRateEpisode",
    "MaintenanceSpec",
    "PartitionEpisode",
    "PredictedFailureSpec",
    "Scenario",
    "ScenarioError",
    "ScheduledFailure",
    "load_scenario",
    "parse_duration",
    "parse_scenario",
]

DEFAULT_REGION = "US-CAL-CISO"
BUILTIN_TRACE_NAMES = frozenset({"caiso"})
DEFAULT_SPEEDUP = 60.0
"""One trace hour per real minute unless a scenario says otherwise."""

_DURATION_RE = re.compile(r"\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m|h)\s*", re.ASCII)
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: object) -> float:
    """Seconds from `3s`, `250ms`, `2m`, `1.5h` or a bare non-negative number of seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 3s, 250ms, 2m or 1.5h")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION_RE.fullmatch(value)):
        seconds = float(match["number"]) * _UNIT_SECONDS[match["unit"]]
    else:
        raise ValueError(f"expected a duration such as 3s, 250ms, 2m or 1.5h, got {value!r}")
    if not 0.0 <= seconds < 10 * 365 * 86400:
        raise ValueError(f"a duration must be between 0 and 10 years, got {value!r}")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]
IdStr = Annotated[str, StringConstraints(pattern=ID_PATTERN)]


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class HostSpec(_Spec):
    """Defaults for one simulated host (command-line options override them)."""

    locality_group: IdStr | None = None
    gpus: int | None = Field(default=None, ge=0, le=64)
    region: RegionCode | None = None
    gpu_memory_gib: float = Field(default=80.0, gt=0.0, le=4096.0)
    gpu_power_w: float = Field(default=700.0, gt=0.0, le=10_000.0)


class FabricSpec(_Spec):
    intra_group_gbps: float = Field(default=400.0, ge=0.0, le=100_000.0)
    inter_group_gbps: float = Field(default=100.0, ge=0.0, le=100_000.0)


class CongestionEpisode(_Spec):
    """A congested link: one group = inside that group, two groups = between them."""

    groups: tuple[IdStr, ...] = Field(min_length=1, max_length=2)
    link: str | None = Field(default=None, min_length=1, max_length=200)
    start: Duration
    duration: Duration | None = None
    slowdown: float = Field(ge=1.0, le=100.0)
    utilization: float = Field(default=0.9, ge=0.0, le=1.0)
    announce_end: bool = True

    @model_validator(mode="after")
    def _distinct_groups(self) -> Self:
        if len(set(self.groups)) != len(self.groups):
            raise ValueError("groups: a link between groups needs two different groups")
        return self

    @property
    def link_name(self) -> str:
        return self.link or "link-" + "-".join(self.groups)


class LinkRateEpisode(_Spec):
    """A group's uplink running at `mbit` (both ways) from `start` for `duration` (forever when omitted), then back at
    the testbed's rate. Played only on the testbed (`provider_agents.testbed.episodes`): a loopback cloud's simulated
    hosts have no links to shape and ignore it."""

    group: IdStr
    start: Duration
    duration: Duration | None = None
    mbit: float = Field(gt=0.0, le=10_000.0)


class PartitionEpisode(_Spec):
    """A host cut off the network at `at` for `duration` (forever when omitted): its data and management links down,
    its processes alive, everything back at the end. Played only on the testbed (`provider_agents.testbed.episodes`):
    a loopback cloud's simulated hosts share one network namespace and ignore it."""

    host: IdStr
    at: Duration
    duration: Duration | None = None


class ScheduledFailure(_Spec):
    """A failure that happens at `at` on `host` and lasts `duration` (forever when omitted)."""

    host: IdStr
    at: Duration
    kind: Literal["gpu_error", "degraded"]
    gpu: int | None = Field(default=None, ge=0, le=63)
    reason: str | None = Field(default=None, min_length=1, max_length=200)
    duration: Duration | None = None


class PredictedFailureSpec(_Spec):
    """A failure predicted at `at` to happen at `eta` (both offsets from the scenario start)."""

    host: IdStr
    at: Duration
    eta: Duration
    confidence: float = Field(ge=0.0, le=1.0)
    gpu: int | None = Field(default=None, ge=0, le=63)
    reason: str | None = Field(default=None, min_length=1, max_length=200)

    @model_validator(mode="after")
    def _eta_after_prediction(self) -> Self:
        if self.eta < self.at:
            raise ValueError("eta must not be before at")
        return self


class MaintenanceSpec(_Spec):
    """A maintenance notice: announced at `announce`, disruptive from `start` to `end`."""

    host: IdStr
    notice: str | None = Field(default=None, min_length=1, max_length=200)
    kind: MaintenanceKind
    announce: Duration
    start: Duration
    end: Duration
    early_approval: bool = False

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if not self.announce <= self.start <= self.end:
            raise ValueError("times must be ordered: announce <= start <= end")
        return self


class CarbonPointSpec(_Spec):
    at: Duration
    g_per_kwh: float = Field(ge=0.0, le=5000.0)


class CarbonSpec(_Spec):
    """A region's carbon curve: a replayed trace (default: the shipped CAISO one) or explicit step points."""

    trace: str | None = Field(default=None, min_length=1)
    speedup: float = Field(default=DEFAULT_SPEEDUP, gt=0.0, le=10_000_000.0)
    start_hour: int = Field(default=0, ge=0)
    points: tuple[CarbonPointSpec, ...] | None = Field(default=None, min_length=1)
    forecast_points: int = Field(default=24, ge=0, le=336)

    @model_validator(mode="after")
    def _one_curve(self) -> Self:
        if self.trace is not None and self.points is not None:
            raise ValueError("give either trace or points, not both")
        if self.points is not None:
            times = [point.at for point in self.points]
            if any(later <= earlier for earlier, later in pairwise(times)):
                raise ValueError("points: times must be strictly increasing")
        return self


class Scenario(_Spec):
    """A whole scenario file."""

    version: Literal[1] = 1
    seed: int = 0
    start: UtcDatetime | None = None
    hosts: dict[IdStr, HostSpec] = Field(default_factory=dict)
    fabric: FabricSpec = FabricSpec()
    congestion: tuple[CongestionEpisode, ...] = ()
    failures: tuple[ScheduledFailure, ...] = ()
    predicted_failures: tuple[PredictedFailureSpec, ...] = ()
    maintenance: tuple[MaintenanceSpec, ...] = ()
    carbon: dict[RegionCode, CarbonSpec] = Field(default_factory=dict)
    link_rates: tuple[LinkRateEpisode, ...] = ()
    """Uplink rate changes, played only on the testbed (a loopback cloud's simulated hosts ignore them)."""
    partitions: tuple[PartitionEpisode, ...] = ()
    """Hosts cut off the network, played only on the testbed (a loopback cloud's simulated hosts ignore them)."""

    def host(self, host: str) -> HostSpec:
        """The host's section, or the defaults."""
        return self.hosts.get(host, HostSpec())

    def carbon_for(self, region: str) -> CarbonSpec:
        """The region's curve, or the default CAISO replay."""
        return self.carbon.get(region, CarbonSpec())


SCENARIO_INJECT_SUBJECT = provider_subject("scenario", "inject")
"""Provider-internal: where `harmonaize scenario run` sends episodes to every running simulated host."""


class ScenarioInjection(_Spec):
    """A scenario to add to running simulated hosts, its offsets counted from `at`."""

    scenario: Scenario
    at: UtcDatetime


class ScenarioError(ValueError):
    """A scenario that cannot be used; each problem names its field (`congestion[0].slowdown`)."""

    def __init__(self, origin: str, problems: list[tuple[str, str]]) -> None:
        self.origin = origin
        self.problems = problems
        lines = "; ".join(f"{field}: {message}" for field, message in problems)
        super().__init__(f"{origin}: {lines}")

    @property
    def fields(self) -> list[str]:
        return [field for field, _ in self.problems]


def _field_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if part == "[key]":
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.startswith("function-"):
            continue
        else:
            path += f".{part}" if path else part
    return path or "<scenario>"


def parse_scenario(data: Any, *, origin: str = "<scenario>") -> Scenario:
    """Validate already-loaded YAML data."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ScenarioError(origin, [("<scenario>", f"must be a mapping, got {type(data).__name__}")])
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        problems = [
            (_field_path(e["loc"]), f"{'invalid key: ' if '[key]' in e['loc'] else ''}{e['msg']}") for e in exc.errors()
        ]
        raise ScenarioError(origin, problems) from None


def load_scenario(path: Path | str) -> Scenario:
    """Read and validate a YAML scenario file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ScenarioError(str(path), [("<file>", f"cannot be read ({exc.strerror or exc})")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "<yaml>"
        problem = getattr(exc, "problem", None) or str(exc)
        raise ScenarioError(str(path), [(where, f"not valid YAML ({problem})")]) from None
    scenario = parse_scenario(data, origin=str(path))
    return _traces_relative_to(scenario, path.parent)


def _traces_relative_to(scenario: Scenario, directory: Path) -> Scenario:
    """A trace path in a scenario file means a path next to that file, wherever the agent was started."""
    carbon = {}
    for region, spec in scenario.carbon.items():
        trace = spec.trace
        if trace is not None and trace not in BUILTIN_TRACE_NAMES and not Path(trace).is_absolute():
            spec = spec.model_copy(update={"trace": str(directory / trace)})
        carbon[region] = spec
    return scenario.model_copy(update={"carbon": carbon})
