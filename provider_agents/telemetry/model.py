"""The raw, provider-internal telemetry snapshot of one host.

Everything in here is the provider's own business and may name internal things freely: the host id, the locality
group, link and switch names, GPU serials, internal maintenance ticket ids, free-text failure reasons. None of it may
reach a tenant as is; `provider_agents.projection` is the only way from this model to a tenant's event. That is why
this model is separate from the contract's event models rather than a superset of them: a raw field can never be
serialised into a tenant event by accident, because the two have nothing in common but primitive types.

The model validates its own invariants (an ETA is not before its detection, a window does not end before it starts,
a forecast is ordered) so that the projection can build contract models from it without failing halfway through a
tick: a source that produces nonsense fails when it builds the snapshot, not when a tenant's event is made.
"""

from __future__ import annotations

from enum import StrEnum
from itertools import pairwise
from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from harmonaize.events import MaintenanceKind, MaintenanceStatus, UtcDatetime
from harmonaize.ids import ID_PATTERN

__all__ = [
    "CarbonPoint",
    "CarbonReading",
    "FabricSample",
    "FailureSignal",
    "GpuHealth",
    "GpuSample",
    "HostTelemetry",
    "LinkCongestion",
    "MaintenanceNotice",
    "REGION_PATTERN",
    "RawFailureKind",
    "RegionCode",
]

InternalId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
InternalName = Annotated[str, StringConstraints(min_length=1, max_length=200)]
REGION_PATTERN = r"^[A-Z]{2,3}(-[A-Z0-9]{1,10}){0,3}$"
RegionCode = Annotated[str, StringConstraints(pattern=REGION_PATTERN, max_length=40)]
"""A public grid zone key (Electricity Maps style). Only public zones belong here: it is passed to tenants."""


class _Raw(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class GpuHealth(StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    ERROR = "error"


class GpuSample(_Raw):
    """One GPU as the host sees it."""

    index: int = Field(ge=0, le=63)
    serial: InternalName
    health: GpuHealth = GpuHealth.HEALTHY
    power_w: float = Field(ge=0.0, le=10_000.0)
    utilization: float = Field(ge=0.0, le=1.0)
    memory_gib: float = Field(ge=0.0, le=4096.0)


class FabricSample(_Raw):
    """Nominal per-GPU bandwidth inside the host's locality group and from it to other groups."""

    intra_group_gbps: float = Field(ge=0.0, le=100_000.0)
    inter_group_gbps: float = Field(ge=0.0, le=100_000.0)


class LinkCongestion(_Raw):
    """A congested link or switch as the provider's network monitoring names it.

    `groups` are the locality groups the link serves: one group for a link inside a group (leaf, NVSwitch domain),
    two for a link between groups (spine uplink). `slowdown` is the provider's estimate of the factor on
    communication crossing the link; `utilization` is the raw counter-derived load, never shown to tenants.
    """

    link: InternalName
    groups: tuple[InternalId, ...] = Field(min_length=1, max_length=2)
    utilization: float = Field(ge=0.0, le=1.0)
    slowdown: float = Field(ge=1.0, le=1000.0)
    since: UtcDatetime
    expected_until: UtcDatetime | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if len(set(self.groups)) != len(self.groups):
            raise ValueError("groups: a link between groups joins two different groups")
        if self.expected_until is not None and self.expected_until < self.since:
            raise ValueError("expected_until must not be before since")
        return self


class RawFailureKind(StrEnum):
    GPU_ERROR = "gpu_error"
    DEGRADED = "degraded"
    PREDICTED_FAILURE = "predicted_failure"


class FailureSignal(_Raw):
    """A failure (or a prediction) on this host. `component` and `reason` may be internal text."""

    kind: RawFailureKind
    gpu_index: int | None = Field(default=None, ge=0, le=63)
    component: InternalName | None = None
    detected_at: UtcDatetime
    reason: InternalName | None = None
    eta: UtcDatetime | None = None
    confidence: float | None = Field(default=None, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _prediction_fields(self) -> Self:
        predicted = self.kind is RawFailureKind.PREDICTED_FAILURE
        if predicted and (self.eta is None or self.confidence is None):
            raise ValueError("eta and confidence are required for a predicted failure")
        if not predicted and (self.eta is not None or self.confidence is not None):
            raise ValueError("eta and confidence belong to predicted failures only")
        if self.eta is not None and self.eta < self.detected_at:
            raise ValueError("eta must not be before detected_at")
        return self


class MaintenanceNotice(_Raw):
    """A maintenance notice for this host, under the provider's (or the cloud's) own notice id."""

    notice_id: InternalName
    kind: MaintenanceKind
    status: MaintenanceStatus
    not_before: UtcDatetime
    not_after: UtcDatetime
    early_approval: bool = False

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.not_after < self.not_before:
            raise ValueError("not_after must be at or after not_before")
        return self


class CarbonPoint(_Raw):
    at: UtcDatetime
    g_per_kwh: float = Field(ge=0.0, le=5000.0)


class CarbonReading(_Raw):
    """Grid carbon intensity for the host's region now, with a forecast."""

    region: RegionCode
    g_per_kwh: float = Field(ge=0.0, le=5000.0)
    observed_at: UtcDatetime
    forecast: tuple[CarbonPoint, ...] = ()

    @model_validator(mode="after")
    def _forecast_ordered(self) -> Self:
        for earlier, later in pairwise(self.forecast):
            if later.at <= earlier.at:
                raise ValueError("forecast must be strictly ordered in time")
        return self


class HostTelemetry(_Raw):
    """One sample of everything the agent knows about its host."""

    host: InternalId
    locality_group: InternalId
    sampled_at: UtcDatetime
    gpus: tuple[GpuSample, ...] = ()
    fabric: FabricSample
    links: tuple[LinkCongestion, ...] = ()
    failures: tuple[FailureSignal, ...] = ()
    maintenance: tuple[MaintenanceNotice, ...] = ()
    carbon: CarbonReading | None = None

    @model_validator(mode="after")
    def _unique_gpus(self) -> Self:
        indices = [gpu.index for gpu in self.gpus]
        if len(set(indices)) != len(indices):
            raise ValueError("gpus: each GPU index may appear once")
        return self

    @property
    def power_w(self) -> float:
        """Total GPU power draw of the host."""
        return sum(gpu.power_w for gpu in self.gpus)

    @property
    def gpu_memory_gib(self) -> float:
        """Memory of the smallest GPU (what bounds a sharding plan); 0 without GPUs."""
        return min((gpu.memory_gib for gpu in self.gpus), default=0.0)
