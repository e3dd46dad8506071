"""Real inputs for the provider agent: NVSentinel health events and the WattTime / Electricity Maps carbon APIs.

Every client speaks real HTTP to `input_emulator` on 127.0.0.1 (port 0), serving documents written from the providers'
documentation. Outcomes are awaited on conditions with deadlines: a new document must show within the poll interval
plus 50 ms. Bad input (an HTTP 503, a hang past the client's timeout, truncated or partial JSON, unknown units or enum
values, unordered or negative values) must yield no signal or reading, keep the previous one, and be recovered from.
Failure paths step the clients with `poll_once` so each bad answer is checked on its own, without timing.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, suppress
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import pytest

from provider_agents.telemetry.carbon import StepCurve
from provider_agents.telemetry.carbon_apis import (
    BadDocumentError,
    ElectricityMapsFeed,
    LiveCarbonCurve,
    WattTimeFeed,
    reading_at,
    to_g_per_kwh,
)
from provider_agents.telemetry.gpu_health import (
    ActiveHealthSignals,
    HealthEventError,
    NvSentinelPoller,
    RecommendedAction,
    parse_health_event,
)
from provider_agents.telemetry.model import CarbonPoint, CarbonReading, FailureSignal, RawFailureKind
from tests.agents.input_emulator import (
    FakeElectricityMaps,
    FakeNvSentinel,
    FakeWattTime,
    Fault,
    InputEmulator,
    Reply,
    em_forecast,
    em_latest,
    exporter_cloud_event,
    health_event,
    running_emulator,
    watttime_forecast,
)

INTERVAL_S = 0.2
SLACK_S = 0.05
TIMEOUT_S = 0.1
NODE = "gpu-node-7"
LB_TO_G_PER_KWH = 453.59237 / 1000.0
T0 = datetime(2025, 10, 28, 10, 15, 30, tzinfo=UTC)


@pytest.fixture
def emulator() -> Iterator[InputEmulator]:
    with running_emulator(hang_s=3.0) as server:
        yield server


class _Polling(Protocol):
    async def run(self) -> None: ...

    async def aclose(self) -> None: ...


@asynccontextmanager
async def running(client: _Polling) -> AsyncIterator[None]:
    task = asyncio.create_task(client.run())
    try:
        yield
    finally:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        await client.aclose()


async def eventually(predicate: Callable[[], bool], *, within: float, what: str) -> float:
    """Wait for `predicate` with a deadline; the seconds it took."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not predicate():
        if loop.time() - start > within:
            raise AssertionError(f"not within {within:.3f}s: {what}")
        await asyncio.sleep(0.002)
    return loop.time() - start


# --- NVSentinel health events ----------------------------------------------------------------------------------------


def test_documented_event_shapes_parse_alike() -> None:
    """A bare HealthEvent (enum by name) and the exporter's CloudEvent (enum by number) are the same event."""
    bare = health_event(at=T0, gpu=3, codes=("79",), action="RESTART_VM")
    for document in (bare, exporter_cloud_event(bare)):
        event = parse_health_event(document)
        assert (event.node_name, event.component_class, event.check_name) == (NODE, "GPU", "SysLogsXIDError")
        assert (event.is_fatal, event.is_healthy, event.gpu_indices, event.error_codes) == (True, False, (3,), ("79",))
        assert event.recommended_action is RecommendedAction.RESTART_VM
        assert event.generated_at == T0


def _without(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda event: {k: v for k, v in event.items() if k != key}


def _with(**changes: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda event: {**event, **changes}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda event: [event], "expected a JSON object"),
        (_without("checkName"), "checkName"),
        (_without("nodeName"), "nodeName"),
        (_without("isFatal"), "isFatal"),
        (_without("generatedTimestamp"), "generatedTimestamp"),
        (_with(isFatal="true"), "isFatal"),
        (_with(recommendedAction="REBOOT_PLEASE"), "recommendedAction"),
        (_with(recommendedAction=7), "recommendedAction"),
        (_with(isHealthy=True), "both fatal and healthy"),
        (_with(generatedTimestamp="2025-10-28 10:15:30"), "generatedTimestamp"),
        (_with(errorCode="79"), "errorCode"),
        (_with(entitiesImpacted=[{"entityType": "GPU", "entityValue": "64"}]), "out of range"),
        (_with(entitiesImpacted=[{"entityType": "GPU"}]), "entitiesImpacted"),
        (lambda event: {**exporter_cloud_event(event), "type": "com.example.other"}, "CloudEvent type"),
        (lambda event: {**exporter_cloud_event(event), "data": {}}, "data.healthEvent"),
    ],
)
def test_bad_health_events_are_refused(mutate: Callable[[dict[str, Any]], Any], message: str) -> None:
    with pytest.raises(HealthEventError, match=message):
        parse_health_event(mutate(health_event(at=T0)))


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "provider_agents.telemetry.gpu_health" and r.levelno >= logging.WARNING
    ]


def _summary(signals: tuple[FailureSignal, ...]) -> list[tuple[str, int | None, str | None]]:
    return [(s.kind.value, s.gpu_index, s.reason) for s in signals]


def test_healthy_events_clear_what_they_name_and_replays_do_not_resurrect() -> None:
    ledger = ActiveHealthSignals(NODE)
    xid79 = health_event(at=T0, gpu=0, codes=("79",))
    xid48 = health_event(at=T0 + timedelta(seconds=1), gpu=0, codes=("48",))
    thermal = health_event(at=T0, gpu=1, check="GpuThermalWatch", fatal=False, codes=("DCGM_FR_CLOCK_THROTTLE",))
    nvswitch = health_event(at=T0, gpu=None, component="NVSwitch", check="SysLogsSXIDError", codes=("20034",))
    nvswitch["entitiesImpacted"] = [{"entityType": "NVSWITCH", "entityValue": "2"}]
    for document in (xid79, xid48, thermal, nvswitch):
        assert ledger.ingest(document)
    assert _summary(ledger.signals()) == [
        ("gpu_error", None, "20034"),
        ("gpu_error", 0, "xid_48"),
        ("gpu_error", 0, "xid_79"),
        ("degraded", 1, "DCGM_FR_CLOCK_THROTTLE"),
    ]
    assert ledger.signals()[0].component == "NVSwitch/SysLogsSXIDError NVSWITCH=2"

    # a healthy event with a code clears that code on that GPU only
    later = T0 + timedelta(seconds=10)
    assert ledger.ingest(health_event(at=later, gpu=0, codes=("79",), fatal=False, healthy=True, action="NONE"))
    assert ("gpu_error", 0, "xid_79") not in _summary(ledger.signals())
    assert ("gpu_error", 0, "xid_48") in _summary(ledger.signals())

    # without codes or entities it clears the whole check, every entity
    clear_all = health_event(at=later, gpu=None, codes=(), fatal=False, healthy=True, action="NONE")
    assert ledger.ingest(clear_all)
    assert _summary(ledger.signals()) == [("gpu_error", None, "20034"), ("degraded", 1, "DCGM_FR_CLOCK_THROTTLE")]

    # the relay repeats its window: the old unhealthy events change nothing
    assert not ledger.ingest(xid79)
    assert not ledger.ingest(xid48)
    assert len(ledger.signals()) == 2

    # a new occurrence after the clear raises it again, detected at its own time
    again = T0 + timedelta(minutes=5)
    assert ledger.ingest(health_event(at=again, gpu=0, codes=("79",)))
    (raised,) = [s for s in ledger.signals() if s.gpu_index == 0]
    assert (raised.kind, raised.detected_at, raised.reason) == (RawFailureKind.GPU_ERROR, again, "xid_79")


async def test_fatal_event_becomes_gpu_error_within_the_poll_interval(emulator: InputEmulator) -> None:
    relay = FakeNvSentinel(emulator)
    poller = NvSentinelPoller(relay.url, node_name=NODE, interval_s=INTERVAL_S, timeout_s=TIMEOUT_S)
    async with running(poller):
        await eventually(lambda: poller.polls >= 1, within=INTERVAL_S + SLACK_S, what="first poll")
        assert poller.signals() == ()
        relay.events.append(health_event(at=T0, gpu=3, codes=("79",), message="GPU has fallen off the bus"))
        await eventually(lambda: bool(poller.signals()), within=INTERVAL_S + SLACK_S, what="the XID 79 signal")
    (signal,) = poller.signals()
    assert signal == FailureSignal(
        kind=RawFailureKind.GPU_ERROR,
        gpu_index=3,
        component="GPU/SysLogsXIDError",
        detected_at=T0,
        reason="xid_79",
    )
    assert {(r.method, r.path) for r in emulator.requests()} == {("GET", "/events")}


async def test_exporter_batches_degrade_clear_and_skip_other_nodes(
    emulator: InputEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    relay = FakeNvSentinel(emulator, batch=True)
    degraded = health_event(at=T0, gpu=1, check="GpuPcieWatch", fatal=False, codes=("DCGM_FR_PCI_REPLAY_RATE",))
    relay.events = [
        exporter_cloud_event({**degraded, "recommendedAction": "NONE"}),
        exporter_cloud_event(health_event(at=T0, gpu=2, node="gpu-node-8")),  # another node's
    ]
    poller = NvSentinelPoller(relay.url, node_name=NODE, interval_s=INTERVAL_S, timeout_s=TIMEOUT_S)
    async with running(poller):
        await eventually(lambda: bool(poller.signals()), within=INTERVAL_S + SLACK_S, what="the degraded signal")
        assert _summary(poller.signals()) == [("degraded", 1, "DCGM_FR_PCI_REPLAY_RATE")]
        healthy = {**degraded, "isHealthy": True, "generatedTimestamp": "2025-10-28T10:20:00.123456789Z"}
        relay.events.append(exporter_cloud_event({**healthy, "recommendedAction": "NONE"}))
        await eventually(lambda: not poller.signals(), within=INTERVAL_S + SLACK_S, what="the clear")
        polls = poller.polls
        await eventually(lambda: poller.polls >= polls + 2, within=2 * INTERVAL_S + SLACK_S, what="two more polls")
        assert poller.signals() == ()  # the window repeats the unhealthy event: still cleared
    assert _warnings(caplog) == []  # another node's events are skipped quietly


async def test_bad_events_are_logged_and_skipped_beside_good_ones(
    emulator: InputEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    relay = FakeNvSentinel(emulator)
    good = health_event(at=T0, gpu=5, codes=("48",))
    relay.events = [
        "not an event",
        {**good, "recommendedAction": "REBOOT_PLEASE", "entitiesImpacted": [{"entityType": "GPU", "entityValue": "6"}]},
        {k: v for k, v in good.items() if k != "checkName"},
        {**good, "isFatal": None},
        good,
    ]
    poller = NvSentinelPoller(relay.url, node_name=NODE, interval_s=INTERVAL_S, timeout_s=TIMEOUT_S)
    try:
        assert await poller.poll_once()
    finally:
        await poller.aclose()
    assert _summary(poller.signals()) == [("gpu_error", 5, "xid_48")]
    warnings = _warnings(caplog)
    assert len(warnings) == 4
    assert any("recommendedAction: unknown value 'REBOOT_PLEASE'" in w for w in warnings)


async def test_poller_survives_a_failing_endpoint_and_keeps_its_signals(emulator: InputEmulator) -> None:
    relay = FakeNvSentinel(emulator, events=[health_event(at=T0, gpu=0, codes=("79",))])
    poller = NvSentinelPoller(
        relay.url, node_name=NODE, interval_s=INTERVAL_S, timeout_s=TIMEOUT_S, min_backoff_s=0.02, max_backoff_s=0.05
    )
    try:
        assert await poller.poll_once()
        before = poller.signals()
        emulator.fail_next(1, Fault.UNAVAILABLE)
        emulator.fail_next(1, Fault.HANG)
        emulator.fail_next(1, Fault.TRUNCATED)
        for attempt in range(1, 4):
            assert not await poller.poll_once()
            assert poller.failures == attempt
            assert poller.signals() == before
        emulator.set_json(relay.path, {"unexpected": "shape"})
        assert not await poller.poll_once()
        assert poller.signals() == before
    finally:
        await poller.aclose()

    # the run loop backs off and recovers on its own
    relay = FakeNvSentinel(emulator, events=[health_event(at=T0, gpu=0, codes=("79",))])
    emulator.fail_next(3, Fault.UNAVAILABLE)
    poller = NvSentinelPoller(
        relay.url, node_name=NODE, interval_s=INTERVAL_S, timeout_s=TIMEOUT_S, min_backoff_s=0.02, max_backoff_s=0.05
    )
    async with running(poller):
        await eventually(lambda: bool(poller.signals()), within=0.02 + 0.04 + 0.05 + INTERVAL_S, what="recovery")
    assert poller.polls == 4 and poller.failures == 0


# --- WattTime --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("units", "factor"),
    [("lbs_co2_per_mwh", LB_TO_G_PER_KWH), ("g_co2_per_kwh", 1.0), ("gCO2/kWh", 1.0), ("kg_co2_per_mwh", 1.0)],
)
def test_units_convert_explicitly(units: str, factor: float) -> None:
    assert to_g_per_kwh(units) == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("units", ["percent", "lbs_co2_per_kwh", "", "co2_moer"])
def test_unknown_units_are_a_bad_document(units: str) -> None:
    with pytest.raises(BadDocumentError, match="unknown unit"):
        to_g_per_kwh(units)


def _watttime(emulator: InputEmulator, fake: FakeWattTime, **overrides: Any) -> WattTimeFeed:
    options: dict[str, Any] = {
        "region": "CAISO_NORTH",
        "zone": "US-CAL-CISO",
        "base_url": emulator.url,
        "interval_s": INTERVAL_S,
        "timeout_s": TIMEOUT_S,
        "min_backoff_s": 0.02,
        "max_backoff_s": 0.08,
        "jitter": 0.0,
    }
    return WattTimeFeed(fake.username, fake.password, **(options | overrides))


def _now_minute() -> datetime:
    return datetime.now(UTC).replace(second=0, microsecond=0)


async def test_watttime_forecast_becomes_a_reading_in_g_per_kwh(emulator: InputEmulator) -> None:
    start = _now_minute()
    fake = FakeWattTime(emulator, forecast=watttime_forecast(start, [1000.0, 800.0, 500.5, 0.0]))
    feed = _watttime(emulator, fake)
    async with running(feed):
        await eventually(lambda: feed.latest() is not None, within=INTERVAL_S + SLACK_S, what="the first reading")
        reading = feed.latest()
        assert reading is not None
        assert reading.region == "US-CAL-CISO"
        assert reading.observed_at == start
        assert reading.g_per_kwh == pytest.approx(453.59237)
        assert [(p.at, p.g_per_kwh) for p in reading.forecast] == [
            (start + timedelta(minutes=5), pytest.approx(362.873896)),
            (start + timedelta(minutes=10), pytest.approx(500.5 * LB_TO_G_PER_KWH)),
            (start + timedelta(minutes=15), 0.0),
        ]
        assert feed.current() == reading

        fake.forecast = watttime_forecast(start, [200.0, 100.0], units="g_co2_per_kwh")
        await eventually(
            lambda: (r := feed.latest()) is not None and r.g_per_kwh == 200.0,
            within=INTERVAL_S + SLACK_S,
            what="the next forecast",
        )
    login, *forecasts = emulator.requests()
    basic = base64.b64encode(b"wt-user:wt-secret").decode()
    assert (login.path, login.headers["authorization"]) == ("/login", f"Basic {basic}")
    assert {r.path for r in forecasts} == {"/v3/forecast"}
    assert {r.headers["authorization"] for r in forecasts} == {"Bearer token-1"}
    assert forecasts[0].query == {"region": "CAISO_NORTH", "signal_type": "co2_moer"}


async def test_watttime_logs_in_again_after_a_401(emulator: InputEmulator) -> None:
    fake = FakeWattTime(emulator, forecast=watttime_forecast(_now_minute(), [900.0, 950.0]))
    feed = _watttime(emulator, fake)
    try:
        assert await feed.poll_once()
        fake.revoke_tokens()
        fake.forecast = watttime_forecast(_now_minute(), [100.0, 150.0])
        assert await feed.poll_once()
    finally:
        await feed.aclose()
    reading = feed.latest()
    assert reading is not None and reading.g_per_kwh == pytest.approx(100.0 * LB_TO_G_PER_KWH)
    assert fake.issued == ["token-1", "token-2"]
    assert [(r.path, r.headers.get("authorization", "")[:12]) for r in emulator.requests()] == [
        ("/login", "Basic d3QtdX"),
        ("/v3/forecast", "Bearer token"),
        ("/v3/forecast", "Bearer token"),  # refused: 401
        ("/login", "Basic d3QtdX"),
        ("/v3/forecast", "Bearer token"),
    ]
    assert emulator.requests("/v3/forecast")[-1].headers["authorization"] == "Bearer token-2"


def _unordered(start: datetime) -> dict[str, Any]:
    document = watttime_forecast(start, [500.0, 510.0, 520.0])
    document["data"][1], document["data"][2] = document["data"][2], document["data"][1]
    return document


def _partial(start: datetime) -> dict[str, Any]:
    document = watttime_forecast(start, [500.0, 510.0])
    del document["meta"]
    return document


async def test_watttime_bad_answers_never_yield_a_reading(emulator: InputEmulator) -> None:
    start = _now_minute()
    fake = FakeWattTime(emulator, forecast=watttime_forecast(start, [700.0, 710.0]))
    fake.pending.extend(
        [
            watttime_forecast(start, [500.0], units="percent"),
            _unordered(start),
            watttime_forecast(start, [500.0, -1.0]),
            _partial(start),
            {"data": [], "meta": {"units": "lbs_co2_per_mwh"}},
            watttime_forecast(start, [500.0], region="PJM_DC"),
        ]
    )
    feed = _watttime(emulator, fake)
    try:
        for _ in range(len(fake.pending)):
            assert not await feed.poll_once()
            assert feed.latest() is None and feed.current() is None
        for fault in (Fault.UNAVAILABLE, Fault.HANG, Fault.TRUNCATED):
            emulator.fail_next(1, fault, path="/v3/forecast")
            assert not await feed.poll_once()
            assert feed.latest() is None
        assert feed.failures == 9
        assert await feed.poll_once()
    finally:
        await feed.aclose()
    reading = feed.latest()
    assert reading is not None and reading.g_per_kwh == pytest.approx(700.0 * LB_TO_G_PER_KWH)
    assert feed.failures == 0 and fake.issued == ["token-1"]


async def test_backoff_is_exponential_capped_and_respects_retry_after(emulator: InputEmulator) -> None:
    fake = FakeWattTime(emulator, forecast=watttime_forecast(_now_minute(), [700.0]))
    feed = _watttime(emulator, fake)
    delays = []
    try:
        emulator.fail_next(5, Fault.UNAVAILABLE, path="/v3/forecast")
        for _ in range(5):
            assert not await feed.poll_once()
            delays.append(feed.next_delay_s)
        assert delays == [0.02, 0.04, 0.08, 0.08, 0.08]
        assert await feed.poll_once()
        assert feed.next_delay_s == INTERVAL_S
    finally:
        await feed.aclose()

    emulator.serve(
        "/v3/forecast", lambda _r: Reply.json({"error": "slow down"}, status=429, headers=(("Retry-After", "3"),))
    )
    feed = _watttime(emulator, fake, max_backoff_s=10.0)
    try:
        assert not await feed.poll_once()
        assert feed.next_delay_s == 3.0
    finally:
        await feed.aclose()


# --- Electricity Maps ------------------------------------------------------------------------------------------------


def _electricity_maps(emulator: InputEmulator, fake: FakeElectricityMaps, **overrides: Any) -> ElectricityMapsFeed:
    options: dict[str, Any] = {
        "zone": "DE",
        "base_url": emulator.url,
        "interval_s": INTERVAL_S,
        "timeout_s": TIMEOUT_S,
        "min_backoff_s": 0.02,
        "max_backoff_s": 0.08,
        "jitter": 0.0,
    }
    return ElectricityMapsFeed(fake.api_key, **(options | overrides))


def _hour() -> datetime:
    return datetime.now(UTC).replace(minute=0, second=0, microsecond=0)


def _documents(fake: FakeElectricityMaps, hour: datetime, now: float, ahead: list[float]) -> None:
    fake.latest = em_latest("DE", now, hour)
    points = [(hour + timedelta(hours=i), value) for i, value in enumerate(ahead)]
    fake.forecast = em_forecast("DE", points, updated=hour)


async def test_electricitymaps_reading_and_forecast_with_the_auth_token(emulator: InputEmulator) -> None:
    hour = _hour()
    fake = FakeElectricityMaps(emulator)
    _documents(fake, hour, 302.0, [310.0, 280.0, 250.5])  # the first forecast point is the measured hour
    feed = _electricity_maps(emulator, fake)
    async with running(feed):
        await eventually(lambda: feed.latest() is not None, within=INTERVAL_S + SLACK_S, what="the first reading")
        assert feed.latest() == CarbonReading(
            region="DE",
            g_per_kwh=302.0,
            observed_at=hour,
            forecast=(
                CarbonPoint(at=hour + timedelta(hours=1), g_per_kwh=280.0),
                CarbonPoint(at=hour + timedelta(hours=2), g_per_kwh=250.5),
            ),
        )
        _documents(fake, hour, 120.0, [120.0, 110.0])
        await eventually(
            lambda: (r := feed.latest()) is not None and r.g_per_kwh == 120.0,
            within=INTERVAL_S + SLACK_S,
            what="the updated reading",
        )
    requests = emulator.requests()
    assert {r.path for r in requests} == {"/v3/carbon-intensity/latest", "/v3/carbon-intensity/forecast"}
    assert all(r.headers["auth-token"] == "em-key-123" and r.query == {"zone": "DE"} for r in requests)


async def test_electricitymaps_bad_answers_keep_the_previous_reading(emulator: InputEmulator) -> None:
    hour = _hour()
    fake = FakeElectricityMaps(emulator)
    _documents(fake, hour, 302.0, [302.0, 280.0])
    feed = _electricity_maps(emulator, fake)
    try:
        assert await feed.poll_once()
        first = feed.latest()
        assert first is not None
        later = hour + timedelta(hours=1)
        fake.pending_latest.extend(
            [
                em_latest("DE", -5.0, later),
                em_latest("DE", None, later),  # no data for the zone
                em_latest("FR", 60.0, later),
                {"zone": "DE", "carbonIntensity": 200.0},  # partial: no datetime
                em_latest("DE", 9000.0, later),
            ]
            + [em_latest("DE", 200.0, later)] * 3  # with the bad forecasts below
        )
        fake.pending_forecast.extend(
            [
                em_forecast(
                    "DE", [(later + timedelta(hours=2), 190.0), (later + timedelta(hours=1), 180.0)], updated=later
                ),
                em_forecast("DE", [(later + timedelta(hours=1), -1.0)], updated=later),
                {"zone": "DE", "updatedAt": "2025-10-28T10:00:00Z"},
            ]
        )
        bad_documents = len(fake.pending_latest)
        for _ in range(bad_documents):
            assert not await feed.poll_once()
            assert feed.latest() == first
        for fault in (Fault.UNAVAILABLE, Fault.HANG, Fault.TRUNCATED):
            emulator.fail_next(1, fault, path="/v3/carbon-intensity/forecast")
            assert not await feed.poll_once()
            assert feed.latest() == first
        assert feed.failures == bad_documents + 3
        _documents(fake, later, 150.0, [140.0])
        assert await feed.poll_once()
    finally:
        await feed.aclose()
    assert feed.latest() == CarbonReading(region="DE", g_per_kwh=150.0, observed_at=later)


async def test_wrong_key_is_a_failed_poll(emulator: InputEmulator) -> None:
    fake = FakeElectricityMaps(emulator)
    _documents(fake, _hour(), 302.0, [])
    feed = ElectricityMapsFeed("wrong-key", zone="DE", base_url=emulator.url, timeout_s=TIMEOUT_S, jitter=0.0)
    try:
        assert not await feed.poll_once()
    finally:
        await feed.aclose()
    assert feed.latest() is None and feed.last_error == "ProviderStatusError: HTTP 401 from /v3/carbon-intensity/latest"


async def test_a_stale_reading_is_not_current_and_the_curve_falls_back(
    emulator: InputEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    hour = _hour()
    fake = FakeElectricityMaps(emulator)
    _documents(fake, hour, 302.0, [])
    stale_after = 0.3
    feed = _electricity_maps(emulator, fake, stale_after_s=stale_after, forecast=False)
    fallback = StepCurve(region="DE", points=((0.0, 999.0),))
    curve = LiveCarbonCurve(feed, fallback=fallback)
    start = datetime.now(UTC)

    def offset() -> float:
        return (datetime.now(UTC) - start).total_seconds()

    async with running(feed):
        await eventually(lambda: feed.current() is not None, within=INTERVAL_S + SLACK_S, what="a fresh reading")
        assert curve.reading(start=start, offset_s=offset()).g_per_kwh == 302.0
        emulator.fail_next(10_000, Fault.UNAVAILABLE)
        await eventually(lambda: feed.stale, within=stale_after + INTERVAL_S + SLACK_S, what="staleness")
        assert feed.current() is None
        assert feed.latest() is not None  # kept, but not reported
        assert curve.reading(start=start, offset_s=offset()).g_per_kwh == 999.0
        assert any("is stale" in r.getMessage() for r in caplog.records)
        emulator.clear_faults()
        await eventually(lambda: feed.current() is not None, within=0.08 + SLACK_S, what="fresh again")
        assert curve.reading(start=start, offset_s=offset()).g_per_kwh == 302.0


def test_current_moves_along_the_forecast() -> None:
    reading = CarbonReading(
        region="DE",
        g_per_kwh=300.0,
        observed_at=T0,
        forecast=tuple(CarbonPoint(at=T0 + timedelta(minutes=5 * i), g_per_kwh=300.0 - i) for i in range(1, 4)),
    )
    assert reading_at(reading, T0 - timedelta(minutes=1)) == reading
    assert reading_at(reading, T0 + timedelta(minutes=4)) == reading
    moved = reading_at(reading, T0 + timedelta(minutes=11))
    assert (moved.g_per_kwh, moved.observed_at, len(moved.forecast)) == (298.0, T0 + timedelta(minutes=10), 1)
    end = reading_at(reading, T0 + timedelta(hours=3))
    assert (end.g_per_kwh, end.forecast) == (297.0, ())


def test_zones_must_be_public_zone_keys() -> None:
    with pytest.raises(ValueError, match="public grid zone key"):
        WattTimeFeed("u", "p", region="CAISO_NORTH", zone="CAISO_NORTH")
