"""Each real change is published once: a condition that persists, or is reported twice, is not news.

The agent loop runs over a simulated host into which scenarios are injected while it runs (what
`harmonaize scenario run` does), on a manual clock; the tenant's events are counted tick by tick, once in memory and
once through a real broker. A property test drives random sequences of injections and ticks and compares every
published failure and maintenance event with an independent model of what the tenant may see.
"""

from __future__ import annotations

import asyncio
import json
import random
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.js.kv import KeyValue

from broker_config.accounts import UserKeys
from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from harmonaize.events import FailureKind, MaintenanceKind, MaintenanceStatus, Severity
from harmonaize.pseudonyms import host_pseudonym
from provider_agents.agent import Agent, AgentConfig
from provider_agents.changes import ChangeTracker
from provider_agents.clock import ManualClock
from provider_agents.desired import FleetView
from provider_agents.projection import notice_pseudonym, project
from provider_agents.publisher import JetStreamPublisher
from provider_agents.runtime import _accept_injections
from provider_agents.telemetry import FailureSignal, MaintenanceNotice, RawFailureKind, SimulatedHost, parse_scenario
from provider_agents.telemetry.scenario import SCENARIO_INJECT_SUBJECT, ScenarioInjection
from tests.agents.conftest import put_assignment, stored_messages, tenant_reader
from tests.agents.fakes import START, Published, RecordingSink, StaticDesiredState, assignment, telemetry
from tests.support import eventually

SECRET = b"changes-test-secret"
TRAIN = assignment("h1", "g1", ("acme", "train"))
STEADY_CARBON = {"US-CAL-CISO": {"points": [{"at": "0s", "g_per_kwh": 300}]}}
"""A carbon curve that never changes, so that only the injected conditions make news."""


def _failure(gpu: int | None, reason: str | None, *, kind: str = "gpu_error", **extra: Any) -> dict[str, Any]:
    return {"failures": [{"host": "h1", "at": "0s", "kind": kind, "gpu": gpu, "reason": reason, **extra}]}


class LoopHarness:
    """One agent over a simulated h1 on a manual clock, publishing into memory; one tick per simulated second."""

    def __init__(self) -> None:
        self.clock = ManualClock(START)
        self.host = SimulatedHost(
            "h1", scenario=parse_scenario({"carbon": STEADY_CARBON}), locality_group="g1", gpus=2, clock=self.clock
        )
        self.sink = RecordingSink()
        self.agent = Agent(
            AgentConfig(host="h1"),
            source=self.host,
            desired=StaticDesiredState({"h1": TRAIN}),
            sink=self.sink,
            secret=SECRET,
            clock=self.clock,
        )

    def inject(self, scenario: dict[str, Any]) -> None:
        self.host.inject(parse_scenario(scenario), at=self.clock.now())

    async def ticks(self, n: int, kind: str = "failure") -> list[list[Published]]:
        """Run `n` ticks; what each published of `kind`."""
        per_tick = []
        for _ in range(n):
            published = [Published(item.subject, item.event) for item in (await self.agent.step()).published]
            per_tick.append([item for item in published if item.kind == kind])
            self.clock.advance(1.0)
        return per_tick


async def test_the_same_gpu_error_injected_twice_is_published_once() -> None:
    loop = LoopHarness()
    await loop.ticks(2)
    loop.inject(_failure(0, "xid_79"))
    first = await loop.ticks(3)
    loop.inject(_failure(0, "xid_79"))  # the same condition, reported again while it persists
    later = await loop.ticks(30)
    counts = [len(tick) for tick in first + later]
    assert counts == [1] + [0] * 32, f"failure events per tick: {counts}"
    (event,) = first[0]
    assert event.event.data.detected_at == START + timedelta(seconds=2), "the condition dates from its first report"


async def test_two_distinct_failures_of_one_kind_are_one_condition_until_the_first_recovers() -> None:
    loop = LoopHarness()
    loop.inject(_failure(0, "fan tray 3 stalled", duration="10s"))  # private reasons: the tenant sees no reason
    per_tick = await loop.ticks(2)
    loop.inject(_failure(0, "psu 2 brownout"))
    loop.inject(_failure(1, "xid_48"))  # another GPU: another condition
    per_tick += await loop.ticks(40)
    published = [(tick, e.event.data.gpu_index, e.event.data.reason) for tick, got in enumerate(per_tick) for e in got]
    assert published == [(0, 0, None), (2, 1, "xid_48"), (10, 0, None)], published
    detected = [e.event.data.detected_at for items in per_tick for e in items if e.event.data.gpu_index == 0]
    assert detected == [START, START + timedelta(seconds=2)], "after the first recovers, the second is the news"


async def test_a_maintenance_notice_reported_twice_moves_forward_once_per_status() -> None:
    loop = LoopHarness()
    notice = {"host": "h1", "notice": "tkt-4711", "kind": "reboot", "announce": "0s", "start": "3s", "end": "5s"}
    loop.inject({"maintenance": [notice]})
    per_tick = await loop.ticks(1, kind="maintenance")
    loop.inject({"maintenance": [notice]})  # the same ticket again, its window a second later
    per_tick += await loop.ticks(20, kind="maintenance")
    published = [
        (tick, e.event.data.status, e.event.data.window.not_before) for tick, got in enumerate(per_tick) for e in got
    ]
    window = START + timedelta(seconds=3)
    assert published == [
        (0, MaintenanceStatus.SCHEDULED, window),
        (3, MaintenanceStatus.STARTED, window),
        (5, MaintenanceStatus.COMPLETED, window),
    ], published


async def test_over_a_real_broker_the_tenant_receives_each_condition_once(
    nats_server: NatsServer,
    tenant_broker: NatsTenantBroker,
    two_tenants: dict[str, UserKeys],
    provider_nc: Client,
    kv: KeyValue,
    provider_secret: bytes,
) -> None:
    """Scenarios reach the running agent the way `harmonaize scenario run` sends them: over the broker."""
    clock = ManualClock(START)
    host = SimulatedHost(
        "h1", scenario=parse_scenario({"carbon": STEADY_CARBON}), locality_group="g1", gpus=2, clock=clock
    )
    view, publisher = FleetView(kv), JetStreamPublisher(provider_nc.jetstream())
    agent = Agent(
        AgentConfig(host="h1"), source=host, desired=view, sink=publisher, secret=provider_secret, clock=clock
    )
    await _accept_injections(provider_nc, host, "h1")
    await put_assignment(kv, TRAIN)
    view.start()
    publisher.start()
    reader = await tenant_reader(nats_server, tenant_broker, "acme", two_tenants["acme"])
    scenario = {
        "failures": [
            {"host": "h1", "at": "0s", "kind": "gpu_error", "gpu": 0, "reason": "xid_79"},
            {"host": "h1", "at": "0s", "kind": "gpu_error", "gpu": 1, "reason": "fan tray 3 stalled"},
        ]
    }

    async def inject(extra: dict[str, Any] | None = None) -> None:
        body = {**scenario, **(extra or {})}
        injection = ScenarioInjection(scenario=parse_scenario(body), at=clock.now())
        reply = await provider_nc.request(SCENARIO_INJECT_SUBJECT, injection.model_dump_json().encode(), timeout=5)
        assert json.loads(reply.data) == {"host": "h1", "applied": True}

    async def ticks(n: int) -> None:
        for _ in range(n):
            await agent.step()
            assert await publisher.drain(5.0)
            clock.advance(1.0)

    try:
        await eventually(lambda: view.assignment("h1") is not None, what="h1's mirror")
        await ticks(2)
        await inject()
        await ticks(3)
        await inject()  # the same two failures again
        await inject({"failures": [{"host": "h1", "at": "0s", "kind": "gpu_error", "gpu": 1, "reason": "psu 2"}]})
        await ticks(25)
        await reader.read()
        assert reader.kinds() == {"topology": 1, "carbon": 1, "failure": 2}, reader.kinds()
        failures = [event.data for subject, event in reader.events if ".failure." in subject]
        at = START + timedelta(seconds=2)
        assert sorted((f.gpu_index, f.reason, f.detected_at) for f in failures) == [(0, "xid_79", at), (1, None, at)]
        assert {(f.kind, f.severity) for f in failures} == {(FailureKind.GPU_ERROR, Severity.CRITICAL)}
        assert await stored_messages(provider_nc, "acme") == 4
        assert await reader.read(wait=0.3) == [], "nothing more arrives"
    finally:
        await reader.close()
        await publisher.close()
        await view.stop()


# -- property: events published == distinct tenant-visible changes ---------------------------------------------------

HOSTS = ("h1", "h2", "h3")  # acme's job runs on h1 and h2; what happens on h3 is none of its business
JOB_HOSTS = ("h1", "h2")
PUBLIC = {"xid_79", "xid_48", "thermal"}
REASONS = (*sorted(PUBLIC), "fan tray 3", "psu 2", None)
URGENT = timedelta(minutes=15)
LIFECYCLE = {"completed": 2, "cancelled": 2, "started": 1, "scheduled": 0}

_failures = st.fixed_dictionaries(
    {
        "host": st.sampled_from(HOSTS),
        "kind": st.sampled_from(["gpu_error", "degraded"]),
        "gpu": st.sampled_from([0, 1, None]),
        "reason": st.sampled_from(REASONS),
        "duration": st.sampled_from([None, 1, 5, 60, 900]),
    }
).map(lambda spec: {"failures": [{"at": 0, **spec}]})
_predictions = st.fixed_dictionaries(
    {
        "host": st.sampled_from(HOSTS),
        "gpu": st.sampled_from([0, 1, None]),
        "reason": st.sampled_from(REASONS),
        "eta": st.sampled_from([5, 600, 1200, 3600]),
        "confidence": st.sampled_from([0.5, 0.9]),
    }
).map(lambda spec: {"predicted_failures": [{"at": 0, **spec}]})
_notices = st.builds(
    lambda host, notice, kind, announce, lead, length, early: {
        "maintenance": [
            {
                "host": host,
                "notice": notice,
                "kind": kind,
                "announce": announce,
                "start": announce + lead,
                "end": announce + lead + length,
                "early_approval": early,
            }
        ]
    },
    st.sampled_from(HOSTS),
    st.sampled_from(["tkt-1", "tkt-2", None]),
    st.sampled_from(["reboot", "live_migrate"]),
    st.sampled_from([0, 5, 600]),
    st.sampled_from([0, 5, 600]),
    st.sampled_from([1, 600]),
    st.booleans(),
)
_actions = st.lists(
    st.one_of(
        st.tuples(st.just("inject"), st.one_of(_failures, _predictions, _notices)),
        st.tuples(st.just("repeat"), st.integers(0, 20)),
        st.tuples(st.just("tick"), st.sampled_from([1, 5, 60, 400])),
    ),
    min_size=10,
    max_size=40,
)


def _expected_view(injected: list[tuple[dict[str, Any], datetime, int]], now: datetime) -> dict[tuple[Any, ...], Any]:
    """What acme may see of h1 and h2 at `now`: per condition it can tell apart, the one it is told about.

    Of several failures it cannot tell apart it hears of the most urgent, then the oldest; of notices listed under
    one id, of the one furthest along, then the earliest.
    """
    shown: dict[tuple[Any, ...], Any] = {}

    def offer(key: tuple[Any, ...], rank: tuple[Any, ...], content: tuple[Any, ...]) -> None:
        if key not in shown or rank < shown[key][0]:
            shown[key] = (rank, content)

    key: tuple[Any, ...]  # a failure's and a notice's keys and ranks differ in shape
    rank: tuple[Any, ...]
    for scenario, start, layer in injected:
        for failure in scenario.get("failures", []):
            ends = None if failure["duration"] is None else start + timedelta(seconds=failure["duration"])
            if failure["host"] in JOB_HOSTS and (ends is None or now < ends):
                severity = "critical" if failure["kind"] == "gpu_error" else "warning"
                reason = failure["reason"] if failure["reason"] in PUBLIC else None
                key = ("failure", failure["host"], failure["kind"], failure["gpu"], reason)
                offer(key, (severity != "critical", start), (start, severity, None, None))
        for predicted in scenario.get("predicted_failures", []):
            eta = start + timedelta(seconds=predicted["eta"])
            if predicted["host"] in JOB_HOSTS and now < eta:
                urgent = predicted["confidence"] >= 0.8 and eta - now <= URGENT
                severity = "critical" if urgent else "warning"
                reason = predicted["reason"] if predicted["reason"] in PUBLIC else None
                key = ("failure", predicted["host"], "predicted_failure", predicted["gpu"], reason)
                rank = (not urgent, eta, -predicted["confidence"], start)
                offer(key, rank, (start, severity, eta, predicted["confidence"]))
        for notice in scenario.get("maintenance", []):
            at = {name: start + timedelta(seconds=notice[name]) for name in ("announce", "start", "end")}
            if notice["host"] in JOB_HOSTS and now >= at["announce"]:
                status = "scheduled" if now < at["start"] else "started" if now < at["end"] else "completed"
                notice_id = notice["notice"] or f"sim-notice-{layer}-0"
                key = ("maintenance", notice["host"], notice_pseudonym(SECRET, "acme", notice_id))
                window = (at["start"], at["end"])
                rank = (-LIFECYCLE[status], status, *window, notice["kind"], notice["early_approval"])
                offer(key, rank, (notice["kind"], status, *window, notice["early_approval"]))
    return {key: content for key, (_, content) in shown.items()}


def _seen(item: Published, hosts: dict[str, str]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """A published failure or notice as (condition, content), in the model's terms."""
    key: tuple[Any, ...]
    data = item.event.data
    if item.kind == "failure":
        key = ("failure", hosts[data.host], data.kind.value, data.gpu_index, data.reason)
        return key, (data.detected_at, data.severity.value, data.eta, data.confidence)
    key = ("maintenance", hosts[data.hosts[0]], data.notice_id)
    return key, (data.kind.value, data.status.value, data.window.not_before, data.window.not_after, data.early_approval)


async def _play(actions: list[tuple[str, Any]]) -> tuple[list[list[Any]], list[list[Any]], RecordingSink]:
    """Run the actions against two real agents; (published per tick, expected per tick, everything published)."""
    clock = ManualClock(START)
    fleet = {"h1": TRAIN, "h2": assignment("h2", "g1", ("acme", "train"))}
    base = parse_scenario({"carbon": STEADY_CARBON})
    sources = {h: SimulatedHost(h, scenario=base, locality_group="g1", gpus=2, clock=clock) for h in JOB_HOSTS}
    sink = RecordingSink()
    agents = [
        Agent(
            AgentConfig(host=h),
            source=sources[h],
            desired=StaticDesiredState(fleet),
            sink=sink,
            secret=SECRET,
            clock=clock,
        )
        for h in JOB_HOSTS
    ]
    hosts = {host_pseudonym(SECRET, "acme", h): h for h in JOB_HOSTS}
    injected: list[tuple[dict[str, Any], datetime, int]] = []
    published: list[list[Any]] = []
    expected: list[list[Any]] = []
    before: dict[tuple[Any, ...], Any] = {}

    async def tick() -> None:
        nonlocal before
        seen = []
        for agent in agents:
            seen += [Published(e.subject, e.event) for e in (await agent.step()).published]
        news = [_seen(item, hosts) for item in seen if item.kind in ("failure", "maintenance")]
        published.append(sorted(news, key=repr))
        now = _expected_view(injected, clock.now())
        expected.append(sorted(((key, value) for key, value in now.items() if before.get(key) != value), key=repr))
        before = now

    await tick()
    for action, value in actions:
        if action == "repeat" and injected:
            action, value = "inject", injected[value % len(injected)][0]
        if action == "inject":
            injected.append((value, clock.now(), len(injected) + 1))
            for source in sources.values():
                source.inject(parse_scenario(value), at=clock.now())
        elif action == "tick":
            clock.advance(value)
            await tick()
    clock.advance(1)
    await tick()
    return published, expected, sink


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_actions)
def test_events_published_are_the_distinct_changes_a_tenant_can_see(actions: list[tuple[str, Any]]) -> None:
    """Failures (some recovering), predictions, maintenance and repeats of any of them, on hosts of the job and
    elsewhere, between ticks of 1 s to minutes: every tick publishes exactly what changed in the model's view."""
    published, expected, sink = asyncio.run(_play(actions))
    assert published == expected
    assert sum(map(len, published)) == sum(map(len, expected))
    assert sink.kinds().count("topology") == 1 and sink.kinds().count("carbon") == 1, sink.kinds()
    ids = [item.event.id for item in sink.items]
    assert len(ids) == len(set(ids)), "no event is sent twice"


# -- the parts: one value per slot in the projection, and a tracker that refuses two ------------------------------


_signals = st.lists(
    st.builds(
        lambda kind, gpu, reason, seconds, eta, confidence: FailureSignal(
            kind=kind,
            gpu_index=gpu,
            detected_at=START + timedelta(seconds=seconds),
            reason=reason,
            eta=START + timedelta(seconds=seconds + eta) if kind is RawFailureKind.PREDICTED_FAILURE else None,
            confidence=confidence if kind is RawFailureKind.PREDICTED_FAILURE else None,
        ),
        st.sampled_from(list(RawFailureKind)),
        st.sampled_from([0, 1, None]),
        st.sampled_from(REASONS),
        st.integers(0, 3),
        st.sampled_from([0, 600, 3600]),
        st.sampled_from([0.5, 0.9]),
    ),
    max_size=8,
)
_raw_notices = st.lists(
    st.builds(
        lambda notice, status, start, kind: MaintenanceNotice(
            notice_id=notice,
            kind=kind,
            status=status,
            not_before=START + timedelta(seconds=start),
            not_after=START + timedelta(seconds=start + 60),
        ),
        st.sampled_from(["tkt-1", "tkt-2"]),
        st.sampled_from(list(MaintenanceStatus)),
        st.integers(0, 2),
        st.sampled_from(list(MaintenanceKind)),
    ),
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(_signals, _raw_notices, st.randoms(use_true_random=False))
def test_the_projection_has_one_value_per_slot_whatever_the_order_of_the_signals(
    failures: list[FailureSignal], notices: list[MaintenanceNotice], rnd: random.Random
) -> None:
    def projected(failures: list[FailureSignal], notices: list[MaintenanceNotice]) -> list[tuple[str, object]]:
        snapshot = telemetry("h1", failures=tuple(failures), maintenance=tuple(notices))
        events = project(snapshot, TRAIN, SECRET)
        return [(e.slot, e.event.data) for e in events if e.slot.startswith(("failure", "maintenance"))]

    first = projected(failures, notices)
    assert len({slot for slot, _ in first}) == len(first), "one event per slot"
    assert len(first) == len({(f.kind, f.gpu_index, f.reason in PUBLIC and f.reason) for f in failures}) + len(
        {n.notice_id for n in notices}
    )
    rnd.shuffle(failures)
    rnd.shuffle(notices)
    assert projected(failures, notices) == first, "the same conditions in another order are the same state"


def test_the_tracker_refuses_two_events_for_one_slot_and_remembers_nothing_of_that_tick() -> None:
    tracker = ChangeTracker()
    error = FailureSignal(kind=RawFailureKind.GPU_ERROR, gpu_index=0, detected_at=START, reason="xid_79")
    (item,) = [e for e in project(telemetry("h1", failures=(error,)), TRAIN, SECRET) if e.slot.startswith("failure")]
    with pytest.raises(ValueError, match="two events for slot 'failure:gpu_error:0:xid_79' of acme/train"):
        tracker.changes([item, item], jobs=[("acme", "train")], now=START)
    assert tracker.changes([item], jobs=[("acme", "train")], now=START) == [item]
