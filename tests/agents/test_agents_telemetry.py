"""Telemetry sources: the simulator is deterministic and follows its scenario; NVML is used only when usable."""

from __future__ import annotations

import importlib
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from harmonaize.events import MaintenanceStatus
from provider_agents.clock import ManualClock
from provider_agents.telemetry import (
    GpuHealth,
    NvmlHost,
    RawFailureKind,
    SimulatedHost,
    SourceKind,
    SourceUnavailableError,
    TraceReplay,
    detect_source,
    load_trace,
    parse_scenario,
)
from tests.agents.fakes import START

SCENARIO = parse_scenario(
    {
        "hosts": {"h1": {"locality_group": "g1", "gpus": 4}, "h3": {"locality_group": "g2", "gpus": 2}},
        "congestion": [
            {"groups": ["g1"], "link": "leaf-g1", "start": "3s", "duration": "3s", "slowdown": 2.5},
            {"groups": ["g1", "g2"], "link": "spine-7", "start": "4s", "slowdown": 1.5},
        ],
        "failures": [{"host": "h1", "at": "2s", "kind": "gpu_error", "gpu": 3, "reason": "xid_79", "duration": "2s"}],
        "predicted_failures": [{"host": "h1", "at": "1s", "eta": "5s", "confidence": 0.9, "gpu": 0}],
        "maintenance": [
            {"host": "h1", "notice": "tkt-1", "kind": "reboot", "announce": "1s", "start": "3s", "end": "4s"}
        ],
        "carbon": {"US-CAL-CISO": {"speedup": 3600}},
    }
)


def _run(host: str, *, seed: int, times: list[float]) -> list[Any]:
    clock = ManualClock(START)
    sim = SimulatedHost(host, scenario=SCENARIO, seed=seed, clock=clock)
    samples, now = [], 0.0
    for t in times:
        clock.advance(t - now)
        now = t
        samples.append(sim.sample())
    return samples


def test_same_seed_scenario_and_clock_give_the_same_telemetry() -> None:
    times = [0.0, 0.5, 1.0, 2.5, 3.2, 4.0, 7.5]
    first, second = _run("h1", seed=11, times=times), _run("h1", seed=11, times=times)
    assert first == second
    assert [s.model_dump_json() for s in first] == [s.model_dump_json() for s in second]


def test_a_different_seed_changes_the_noise_not_the_scenario() -> None:
    a, b = _run("h1", seed=1, times=[2.5]), _run("h1", seed=2, times=[2.5])
    assert a[0].power_w != b[0].power_w
    assert a[0].failures == b[0].failures and a[0].links == b[0].links


def test_samples_do_not_depend_on_call_history() -> None:
    """A sample is a function of time, not of how many samples came before."""
    assert _run("h1", seed=3, times=[0.0, 1.0, 2.5])[-1] == _run("h1", seed=3, times=[2.5])[-1]


def test_the_scenario_unfolds_on_the_clock() -> None:
    times = [0.5, 1.5, 2.5, 3.5, 4.5, 5.5]
    at = dict(zip(times, _run("h1", seed=0, times=times), strict=True))
    assert at[0.5].failures == () and at[0.5].maintenance == () and at[0.5].links == ()
    predicted = [f for f in at[1.5].failures if f.kind is RawFailureKind.PREDICTED_FAILURE]
    assert predicted and predicted[0].eta == START + timedelta(seconds=5) and predicted[0].confidence == 0.9
    assert at[1.5].maintenance[0].status is MaintenanceStatus.SCHEDULED
    errors = [f for f in at[2.5].failures if f.kind is RawFailureKind.GPU_ERROR]
    assert errors[0].gpu_index == 3 and at[2.5].gpus[3].health is GpuHealth.ERROR and at[2.5].gpus[3].utilization == 0
    assert [link.link for link in at[3.5].links] == ["leaf-g1"]
    assert at[3.5].links[0].expected_until == START + timedelta(seconds=6)
    assert at[3.5].maintenance[0].status is MaintenanceStatus.STARTED
    assert {link.link for link in at[4.5].links} == {"leaf-g1", "spine-7"}
    assert not [f for f in at[4.5].failures if f.kind is RawFailureKind.GPU_ERROR], "the error lasted 2 s"
    assert at[4.5].maintenance[0].status is MaintenanceStatus.COMPLETED
    assert not [f for f in at[5.5].failures if f.kind is RawFailureKind.PREDICTED_FAILURE], "past its eta"
    assert len(at[0.5].gpus) == 4 and at[0.5].locality_group == "g1"


def test_a_host_sees_only_links_that_serve_its_group() -> None:
    h3 = _run("h3", seed=0, times=[3.5, 4.5])
    assert h3[0].links == ()
    assert [link.link for link in h3[1].links] == ["spine-7"]
    assert h3[0].failures == () and h3[0].maintenance == ()


def test_carbon_replays_the_caiso_trace_faster_than_real_time() -> None:
    trace = load_trace("caiso")
    assert len(trace) == 59 and trace[0] == 332.39
    samples = _run("h1", seed=0, times=[0.0, 1.0, 2.5, 59.0])
    assert [s.carbon.g_per_kwh for s in samples] == [trace[0], trace[1], trace[2], trace[0]]  # loops after 59 h
    reading = samples[2].carbon
    assert reading.region == "US-CAL-CISO" and reading.observed_at == START + timedelta(seconds=2)
    assert len(reading.forecast) == 24
    assert reading.forecast[0].at == START + timedelta(seconds=3) and reading.forecast[0].g_per_kwh == trace[3]


def test_trace_replay_speed_and_start_hour() -> None:
    replay = TraceReplay(region="US-CAL-CISO", values=(1.0, 2.0, 3.0), speedup=60.0, start_hour=1, forecast_points=2)
    reading = replay.reading(start=START, offset_s=90.0)  # 1.5 trace hours at one trace hour per minute
    assert reading.g_per_kwh == 3.0 and reading.observed_at == START + timedelta(minutes=1)
    assert [p.g_per_kwh for p in reading.forecast] == [1.0, 2.0]


def test_step_curves_hold_until_the_next_point() -> None:
    points = [{"at": "0s", "g_per_kwh": 380}, {"at": "4s", "g_per_kwh": 210}]
    scenario = parse_scenario({"carbon": {"DE": {"points": points}}})
    clock = ManualClock(START)
    sim = SimulatedHost("h1", scenario=scenario, region="DE", clock=clock)
    first = sim.sample().carbon
    clock.advance(4.0)
    second = sim.sample().carbon
    assert first is not None and second is not None
    assert (first.g_per_kwh, second.g_per_kwh) == (380.0, 210.0)
    assert [p.g_per_kwh for p in first.forecast] == [210.0] and second.forecast == ()


class FakeNvml(SimpleNamespace):
    """The subset of pynvml the NVML source uses, over a dict of fake boards."""

    class NVMLError(Exception):
        pass

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    def __init__(self, boards: list[dict[str, Any]]) -> None:
        super().__init__()
        self.boards = boards
        self.initialised = False

    def nvmlInit(self) -> None:
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.boards)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        board = self.boards[index]
        if board.get("lost"):
            raise self.NVMLError("GPU is lost")
        return board

    def nvmlDeviceGetSerial(self, handle: dict[str, Any]) -> str:
        if "serial" not in handle:
            raise self.NVMLError("not supported")
        return handle["serial"]

    def nvmlDeviceGetUUID(self, handle: dict[str, Any]) -> str:
        return "GPU-uuid"

    def nvmlDeviceGetPowerUsage(self, handle: dict[str, Any]) -> int:
        return handle["power_mw"]

    def nvmlDeviceGetUtilizationRates(self, handle: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(gpu=handle["util"], memory=10)

    def nvmlDeviceGetMemoryInfo(self, handle: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(total=handle["mem_gib"] * 2**30)

    def nvmlDeviceGetTotalEccErrors(self, handle: dict[str, Any], kind: int, counter: int) -> int:
        return handle.get("ecc", 0)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: dict[str, Any]) -> int:
        return handle.get("pending", 0)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: dict[str, Any]) -> int:
        return handle.get("throttle", 0)


def test_nvml_host_reads_power_utilisation_and_health() -> None:
    nvml = FakeNvml(
        [
            {"serial": "1650923", "power_mw": 512_000, "util": 87, "mem_gib": 141},
            {"serial": "1650924", "power_mw": 90_000, "util": 0, "mem_gib": 141, "ecc": 2},
            {"power_mw": 300_000, "util": 50, "mem_gib": 141, "throttle": 0x40},
            {"lost": True},
        ]
    )
    clock = ManualClock(START)
    host = NvmlHost("h1", nvml=nvml, locality_group="g1", clock=clock)
    first = host.sample()
    assert [g.power_w for g in first.gpus[:3]] == [512.0, 90.0, 300.0]
    assert first.gpus[0].utilization == 0.87 and round(first.gpus[0].memory_gib) == 141
    assert [g.health for g in first.gpus] == [GpuHealth.HEALTHY, GpuHealth.ERROR, GpuHealth.DEGRADED, GpuHealth.ERROR]
    assert {(f.gpu_index, f.kind, f.reason) for f in first.failures} == {
        (1, RawFailureKind.GPU_ERROR, "ecc_uncorrectable"),
        (2, RawFailureKind.DEGRADED, "thermal"),
        (3, RawFailureKind.GPU_ERROR, "fallen_off_bus"),
    }
    assert first.gpus[2].serial == "GPU-uuid" and first.links == () and first.maintenance == ()
    assert first.carbon is not None and first.carbon.region == "US-CAL-CISO"
    clock.advance(5.0)
    nvml.boards[2]["throttle"] = 0
    second = host.sample()
    assert {f.detected_at for f in second.failures} == {START}, "a failure keeps the time it was first seen"
    assert len(second.failures) == 2


def test_detect_source_prefers_nvml_only_when_it_sees_a_gpu() -> None:
    clock = ManualClock(START)
    with_gpu = FakeNvml([{"serial": "1", "power_mw": 1, "util": 1, "mem_gib": 80}])
    assert isinstance(detect_source("h1", nvml_loader=lambda: with_gpu, locality_group="g1", clock=clock), NvmlHost)
    assert isinstance(detect_source("h1", nvml_loader=lambda: None, clock=clock), SimulatedHost)
    scenario_given = detect_source("h1", scenario=SCENARIO, nvml_loader=lambda: with_gpu, clock=clock)
    assert isinstance(scenario_given, SimulatedHost), "a scenario means a simulation"
    forced = detect_source("h1", kind=SourceKind.SIMULATED, nvml_loader=lambda: with_gpu, clock=clock)
    assert isinstance(forced, SimulatedHost)
    with pytest.raises(SourceUnavailableError):
        detect_source("h1", kind=SourceKind.NVML, nvml_loader=lambda: None)


def test_without_pynvml_installed_the_real_loader_falls_back_to_the_simulator() -> None:
    pytest.importorskip("harmonaize")
    try:
        importlib.import_module("pynvml")
    except ImportError:
        assert isinstance(detect_source("h1"), SimulatedHost)
    else:  # pragma: no cover - a GPU machine with nvidia-ml-py
        pytest.skip("pynvml is installed here; the fallback is covered by the fake loader")
