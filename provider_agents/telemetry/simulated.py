"""A simulated GPU host: seeded, deterministic, driven by a scenario and an injectable clock.

Determinism is the point: the same seed, scenario and clock readings give the same telemetry, in any process, in any
order of calls. So nothing here keeps state between samples; every value is a function of (seed, host, time) and the
scenario. Noise (power draw, utilisation) comes from a SHA-256 of those inputs rather than from a stateful RNG or
Python's `hash`, which is salted per process.

What the host sees of the fleet fabric is what a real host's monitoring would: congestion on links that serve its
own locality group (its leaf, and the uplinks from its group to others), not links elsewhere.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta

from harmonaize.events import MaintenanceStatus
from provider_agents.clock import Clock, SystemClock
from provider_agents.telemetry.carbon import curve_from_spec
from provider_agents.telemetry.model import (
    FabricSample,
    FailureSignal,
    GpuHealth,
    GpuSample,
    HostTelemetry,
    LinkCongestion,
    MaintenanceNotice,
    RawFailureKind,
)
from provider_agents.telemetry.scenario import DEFAULT_REGION, Scenario

__all__ = ["DEFAULT_GPUS", "DEFAULT_LOCALITY_GROUP", "SimulatedHost"]

DEFAULT_GPUS = 8
DEFAULT_LOCALITY_GROUP = "default"


class SimulatedHost:
    """A host that lives through a scenario. Command-line values override the scenario's `hosts` section."""

    def __init__(
        self,
        host: str,
        *,
        scenario: Scenario | None = None,
        locality_group: str | None = None,
        gpus: int | None = None,
        region: str | None = None,
        seed: int | None = None,
        clock: Clock | None = None,
        start: datetime | None = None,
    ) -> None:
        self.scenario = scenario or Scenario()
        spec = self.scenario.host(host)
        self.host = host
        self.locality_group = locality_group or spec.locality_group or DEFAULT_LOCALITY_GROUP
        self.gpus = gpus if gpus is not None else (spec.gpus if spec.gpus is not None else DEFAULT_GPUS)
        self.region = region or spec.region or DEFAULT_REGION
        self.seed = seed if seed is not None else self.scenario.seed
        self.clock: Clock = clock or SystemClock()
        self.start = self.scenario.start or start or self.clock.now()
        self._memory_gib = spec.gpu_memory_gib
        self._tdp_w = spec.gpu_power_w
        self._carbon = curve_from_spec(self.region, self.scenario.carbon_for(self.region))
        self._carbon_start = self.start
        self._layers: list[tuple[Scenario, datetime]] = [(self.scenario, self.start)]

    def inject(self, scenario: Scenario, *, at: datetime | None = None) -> None:
        """Live through `scenario` too, its offsets counted from `at` (default: now), on top of what runs already.

        Episodes add up (a new congestion episode joins the running ones); a carbon curve for this host's region
        replaces the current one from `at` on. This is what `harmonaize scenario run` sends to a running cloud.
        """
        start = at or scenario.start or self.clock.now()
        self._layers.append((scenario, start))
        if self.region in scenario.carbon:
            self._carbon = curve_from_spec(self.region, scenario.carbon[self.region])
            self._carbon_start = start

    def sample(self) -> HostTelemetry:
        now = self.clock.now()
        offset = (now - self.start).total_seconds()
        failures = tuple(item for layer in self._layered(now) for item in self._failures(*layer))
        return HostTelemetry(
            host=self.host,
            locality_group=self.locality_group,
            sampled_at=now,
            gpus=self._gpus(offset, failures),
            fabric=FabricSample(
                intra_group_gbps=self.scenario.fabric.intra_group_gbps,
                inter_group_gbps=self.scenario.fabric.inter_group_gbps,
            ),
            links=tuple(item for layer in self._layered(now) for item in self._links(*layer)),
            failures=failures,
            maintenance=tuple(item for layer in self._layered(now) for item in self._maintenance(*layer)),
            carbon=self._carbon.reading(
                start=self._carbon_start, offset_s=(now - self._carbon_start).total_seconds()
            ),
        )

    def _layered(self, now: datetime) -> list[tuple[Scenario, datetime, float, int]]:
        """(scenario, its start, offset now, layer number) for the base scenario and each injected one."""
        return [
            (scenario, start, (now - start).total_seconds(), number)
            for number, (scenario, start) in enumerate(self._layers)
        ]

    def _noise(self, offset_s: float, *parts: object) -> float:
        """A uniform number in [0, 1) fixed by (seed, host, millisecond, parts)."""
        key = "|".join(str(p) for p in (self.seed, self.host, round(offset_s * 1000), *parts))
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64

    def _serial(self, index: int) -> str:
        digest = hashlib.sha256(f"{self.host}|gpu{index}".encode()).hexdigest()
        return f"SIM{digest[:12].upper()}"

    def _gpus(self, offset: float, failures: tuple[FailureSignal, ...]) -> tuple[GpuSample, ...]:
        health = {index: GpuHealth.HEALTHY for index in range(self.gpus)}
        for failure in failures:
            if failure.gpu_index in health and failure.kind is RawFailureKind.GPU_ERROR:
                health[failure.gpu_index] = GpuHealth.ERROR
            elif failure.gpu_index in health and failure.kind is RawFailureKind.DEGRADED:
                if health[failure.gpu_index] is GpuHealth.HEALTHY:
                    health[failure.gpu_index] = GpuHealth.DEGRADED
        samples = []
        for index in range(self.gpus):
            utilization = 0.80 + 0.19 * self._noise(offset, index, "util")
            if health[index] is GpuHealth.DEGRADED:
                utilization *= 0.5
            elif health[index] is GpuHealth.ERROR:
                utilization = 0.0
            idle_w = 0.1 * self._tdp_w
            jitter = 0.95 + 0.05 * self._noise(offset, index, "power")
            samples.append(
                GpuSample(
                    index=index,
                    serial=self._serial(index),
                    health=health[index],
                    power_w=round(idle_w + utilization * (self._tdp_w - idle_w) * jitter, 1),
                    utilization=round(utilization, 3),
                    memory_gib=self._memory_gib,
                )
            )
        return tuple(samples)

    def _links(self, scenario: Scenario, start: datetime, offset: float, layer: int) -> tuple[LinkCongestion, ...]:
        links = []
        for episode in scenario.congestion:
            end = None if episode.duration is None else episode.start + episode.duration
            if self.locality_group not in episode.groups or offset < episode.start:
                continue
            if end is not None and offset >= end:
                continue
            links.append(
                LinkCongestion(
                    link=episode.link_name,
                    groups=episode.groups,
                    utilization=episode.utilization,
                    slowdown=episode.slowdown,
                    since=_at(start, episode.start),
                    expected_until=_at(start, end) if end is not None and episode.announce_end else None,
                )
            )
        return tuple(links)

    def _failures(self, scenario: Scenario, start: datetime, offset: float, layer: int) -> tuple[FailureSignal, ...]:
        found = []
        for failure in scenario.failures:
            ends = None if failure.duration is None else failure.at + failure.duration
            if failure.host != self.host or offset < failure.at or (ends is not None and offset >= ends):
                continue
            found.append(
                FailureSignal(
                    kind=RawFailureKind(failure.kind),
                    gpu_index=failure.gpu,
                    component=self._serial(failure.gpu) if failure.gpu is not None else self.host,
                    detected_at=_at(start, failure.at),
                    reason=failure.reason,
                )
            )
        for predicted in scenario.predicted_failures:
            if predicted.host != self.host or not predicted.at <= offset < predicted.eta:
                continue
            found.append(
                FailureSignal(
                    kind=RawFailureKind.PREDICTED_FAILURE,
                    gpu_index=predicted.gpu,
                    component=self._serial(predicted.gpu) if predicted.gpu is not None else self.host,
                    detected_at=_at(start, predicted.at),
                    reason=predicted.reason,
                    eta=_at(start, predicted.eta),
                    confidence=predicted.confidence,
                )
            )
        return tuple(found)

    def _maintenance(
        self, scenario: Scenario, start: datetime, offset: float, layer: int
    ) -> tuple[MaintenanceNotice, ...]:
        notices = []
        for number, spec in enumerate(scenario.maintenance):
            if spec.host != self.host or offset < spec.announce:
                continue
            if offset < spec.start:
                status = MaintenanceStatus.SCHEDULED
            elif offset < spec.end:
                status = MaintenanceStatus.STARTED
            else:
                status = MaintenanceStatus.COMPLETED
            notices.append(
                MaintenanceNotice(
                    notice_id=spec.notice or (f"sim-notice-{number}" if layer == 0 else f"sim-notice-{layer}-{number}"),
                    kind=spec.kind,
                    status=status,
                    not_before=_at(start, spec.start),
                    not_after=_at(start, spec.end),
                    early_approval=spec.early_approval,
                )
            )
        return tuple(notices)


def _at(start: datetime, offset_s: float) -> datetime:
    return start + timedelta(seconds=offset_s)
