"""Telemetry from real NVIDIA GPUs through NVML (`pynvml`, from the `nvidia-ml-py` package), when present.

The module is imported lazily and only by `detect_source`, so hosts without NVIDIA drivers (and CI) never need the
package. The NVML module object is passed in rather than imported here, which lets tests hand in a stand-in with the
same functions and lets `detect_source` own the "is there a GPU at all" decision.

What NVML can tell: per GPU power, utilisation, memory, and health signals: uncorrectable ECC errors and row-remap
failures (errors), pending page retirement or row remapping and hardware slowdown (degraded), and a GPU that has
fallen off the bus (error). It knows nothing of the network fabric, maintenance or the grid: links and maintenance
stay empty here, and carbon comes from the same curves as the simulator (a replayed trace until a live feed
exists). Every NVML call may be unsupported on a given board, so each is guarded on its own.

A failure's `detected_at` is when this process first saw it, so the source keeps that memory between samples.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from types import ModuleType
from typing import Any

from provider_agents.clock import Clock, SystemClock
from provider_agents.telemetry.carbon import CarbonCurve, curve_from_spec
from provider_agents.telemetry.model import (
    FabricSample,
    FailureSignal,
    GpuHealth,
    GpuSample,
    HostTelemetry,
    RawFailureKind,
)
from provider_agents.telemetry.scenario import DEFAULT_REGION, CarbonSpec

__all__ = ["NvmlHost"]

_HW_SLOWDOWN = 0x0000000000000008
_HW_THERMAL_SLOWDOWN = 0x0000000000000040
_HW_POWER_BRAKE = 0x0000000000000080


class NvmlHost:
    """A real GPU host read through an initialised NVML module."""

    def __init__(
        self,
        host: str,
        *,
        nvml: ModuleType | Any,
        locality_group: str,
        region: str = DEFAULT_REGION,
        carbon: CarbonCurve | None = None,
        fabric: FabricSample | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.host = host
        self.locality_group = locality_group
        self.region = region
        self._nvml = nvml
        self.clock: Clock = clock or SystemClock()
        self.start = self.clock.now()
        self._carbon = carbon or curve_from_spec(region, CarbonSpec())
        self._fabric = fabric or FabricSample(intra_group_gbps=400.0, inter_group_gbps=100.0)
        self._first_seen: dict[tuple[int, RawFailureKind, str], datetime] = {}
        self.gpus = int(self._nvml.nvmlDeviceGetCount())

    def sample(self) -> HostTelemetry:
        now = self.clock.now()
        gpus: list[GpuSample] = []
        failures: list[FailureSignal] = []
        for index in range(self.gpus):
            sample, problems = self._read_gpu(index)
            gpus.append(sample)
            for kind, reason in problems:
                detected = self._first_seen.setdefault((index, kind, reason), now)
                signal = FailureSignal(
                    kind=kind, gpu_index=index, component=sample.serial, detected_at=detected, reason=reason
                )
                failures.append(signal)
        current = {(f.gpu_index, f.kind, f.reason) for f in failures}
        self._first_seen = {key: at for key, at in self._first_seen.items() if key in current}
        return HostTelemetry(
            host=self.host,
            locality_group=self.locality_group,
            sampled_at=now,
            gpus=tuple(gpus),
            fabric=self._fabric,
            failures=tuple(failures),
            carbon=self._carbon.reading(start=self.start, offset_s=(now - self.start).total_seconds()),
        )

    def _call(self, fn: Callable[..., Any], *args: Any, default: Any = None) -> Any:
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return default

    def _read_gpu(self, index: int) -> tuple[GpuSample, list[tuple[RawFailureKind, str]]]:
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError:
            lost = GpuSample(
                index=index, serial=f"gpu{index}", health=GpuHealth.ERROR, power_w=0.0, utilization=0.0, memory_gib=0.0
            )
            return lost, [(RawFailureKind.GPU_ERROR, "fallen_off_bus")]
        serial = self._call(nvml.nvmlDeviceGetSerial, handle) or self._call(nvml.nvmlDeviceGetUUID, handle)
        power_mw = self._call(nvml.nvmlDeviceGetPowerUsage, handle, default=0)
        rates = self._call(nvml.nvmlDeviceGetUtilizationRates, handle)
        memory = self._call(nvml.nvmlDeviceGetMemoryInfo, handle)
        problems = self._health(handle)
        health = GpuHealth.HEALTHY
        if any(kind is RawFailureKind.GPU_ERROR for kind, _ in problems):
            health = GpuHealth.ERROR
        elif problems:
            health = GpuHealth.DEGRADED
        sample = GpuSample(
            index=index,
            serial=_text(serial) or f"gpu{index}",
            health=health,
            power_w=max(0.0, float(power_mw) / 1000.0),
            utilization=min(1.0, max(0.0, float(getattr(rates, "gpu", 0)) / 100.0)),
            memory_gib=float(getattr(memory, "total", 0)) / 2**30,
        )
        return sample, problems

    def _health(self, handle: Any) -> list[tuple[RawFailureKind, str]]:
        nvml = self._nvml
        problems: list[tuple[RawFailureKind, str]] = []
        uncorrected = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
        volatile = getattr(nvml, "NVML_VOLATILE_ECC", 0)
        if self._call(nvml.nvmlDeviceGetTotalEccErrors, handle, uncorrected, volatile, default=0):
            problems.append((RawFailureKind.GPU_ERROR, "ecc_uncorrectable"))
        remapped = self._call(getattr(nvml, "nvmlDeviceGetRemappedRows", _unsupported), handle)
        if remapped is not None and len(remapped) >= 4:
            if remapped[3]:
                problems.append((RawFailureKind.GPU_ERROR, "row_remap_failure"))
            elif remapped[2]:
                problems.append((RawFailureKind.DEGRADED, "row_remap_pending"))
        pending = self._call(getattr(nvml, "nvmlDeviceGetRetiredPagesPendingStatus", _unsupported), handle)
        if pending:
            problems.append((RawFailureKind.DEGRADED, "ecc_retired_pages"))
        event_reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        # older NVML: the same reasons under the earlier name
        throttle_reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", _unsupported)
        reasons_fn = event_reasons if event_reasons is not None else throttle_reasons
        reasons = int(self._call(reasons_fn, handle, default=0) or 0)
        if reasons & (_HW_SLOWDOWN | _HW_THERMAL_SLOWDOWN):
            problems.append((RawFailureKind.DEGRADED, "thermal"))
        elif reasons & _HW_POWER_BRAKE:
            problems.append((RawFailureKind.DEGRADED, "power_brake"))
        return problems


def _unsupported(*_: Any) -> None:
    return None


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if not isinstance(value, str):
        return None
    return value.strip() or None
