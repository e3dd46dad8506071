"""The agent loop with scripted observations (torchelastic style): each test scripts what the host and the desired
state look like tick by tick and asserts the observed state and exactly what was published."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from harmonaize.desired_state import heartbeat_subject, telemetry_subject
from harmonaize.events import CongestionLevel
from harmonaize.pseudonyms import host_pseudonym
from provider_agents.agent import Agent, AgentConfig, AgentState
from provider_agents.changes import ChangeTracker
from provider_agents.clock import ManualClock
from provider_agents.projection import project
from provider_agents.telemetry import (
    CarbonReading,
    FailureSignal,
    LinkCongestion,
    RawFailureKind,
    SimulatedHost,
    parse_scenario,
)
from tests.agents.fakes import (
    START,
    RecordingRawSink,
    RecordingSink,
    ScriptedSource,
    StaticDesiredState,
    assignment,
    telemetry,
)
from tests.support import eventually

SECRET = b"loop-test-secret"
TRAIN = assignment("h1", "g1", ("acme", "train"))


def _peer_for_which_h1_reports() -> str:
    """A second host for acme's job such that h1 is the job's reporter (chosen by acme's pseudonyms)."""
    mine = host_pseudonym(SECRET, "acme", "h1")
    return next(f"h{n}" for n in range(2, 100) if host_pseudonym(SECRET, "acme", f"h{n}") > mine)


PEER = _peer_for_which_h1_reports()


def _agent(
    script: list[Any], desired: StaticDesiredState, **config: Any
) -> tuple[Agent, RecordingSink, RecordingRawSink]:
    sink, raw = RecordingSink(), RecordingRawSink()
    agent = Agent(
        AgentConfig(host="h1", **config),
        source=ScriptedSource("h1", script),
        desired=desired,
        sink=sink,
        raw=raw,
        secret=SECRET,
        clock=ManualClock(START),
    )
    return agent, sink, raw


async def _steps(agent: Agent, n: int) -> list[AgentState]:
    return [(await agent.step()).state for _ in range(n)]


def _at(tick: int, **parts: Any) -> Any:
    return telemetry("h1", at=START + timedelta(seconds=tick), **parts)


async def test_waiting_for_desired_state_tells_no_one_anything() -> None:
    desired = StaticDesiredState(None)
    agent, sink, raw = _agent([_at(0)], desired)
    assert await _steps(agent, 2) == [AgentState.WAITING, AgentState.WAITING]
    assert sink.items == []
    assert len(raw.on(".telemetry.h1")) == 2, "raw telemetry flows to the provider regardless"
    desired.put(TRAIN)
    assert (await agent.step()).state is AgentState.ASSIGNED
    assert sink.kinds() == ["topology"]


async def test_an_idle_host_publishes_nothing_and_forgets() -> None:
    desired = StaticDesiredState({"h1": assignment("h1", "g1")})
    agent, sink, _ = _agent([_at(0)], desired)
    assert await _steps(agent, 2) == [AgentState.IDLE, AgentState.IDLE]
    desired.put(TRAIN)
    await agent.step()
    desired.put(assignment("h1", "g1"))
    await agent.step()
    desired.put(TRAIN)
    await agent.step()
    assert sink.kinds() == ["topology", "topology"], "back from idle, the job is told its topology again"


async def test_a_gpu_error_is_published_once_however_long_it_lasts() -> None:
    error = FailureSignal(kind=RawFailureKind.GPU_ERROR, gpu_index=1, detected_at=START + timedelta(seconds=2))
    script = [_at(0), _at(1), _at(2, failures=(error,)), _at(3, failures=(error,)), _at(4, failures=(error,)), _at(5)]
    agent, sink, _ = _agent(script, StaticDesiredState({"h1": TRAIN}))
    assert await _steps(agent, 6) == [AgentState.ASSIGNED] * 6
    assert sink.kinds() == ["topology", "failure"]
    failure = sink.items[1].event.data
    assert failure.kind.value == "gpu_error" and failure.gpu_index == 1
    assert sink.items[1].subject == "hz.t.acme.events.failure.train"


async def test_congestion_onset_level_change_and_all_clear() -> None:
    fleet = {"h1": TRAIN, PEER: assignment(PEER, "g1", ("acme", "train"))}

    def link(slowdown: float) -> tuple[LinkCongestion, ...]:
        return (LinkCongestion(link="leaf-7", groups=("g1",), utilization=0.9, slowdown=slowdown, since=START),)

    script = [_at(0), _at(1, links=link(2.0)), _at(2, links=link(2.2)), _at(3, links=link(6.0)), _at(4), _at(5)]
    agent, sink, _ = _agent(script, StaticDesiredState(fleet))
    await _steps(agent, 6)
    levels = [item.event.data.level for item in sink.items if item.kind == "congestion"]
    assert levels == [CongestionLevel.HIGH, CongestionLevel.SEVERE, CongestionLevel.NONE]
    clear = [item.event.data for item in sink.items if item.kind == "congestion"][-1]
    assert clear.slowdown == 1.0 and clear.since == START + timedelta(seconds=4)


async def test_the_topology_follows_assignment_changes_and_departed_jobs_hear_nothing() -> None:
    desired = StaticDesiredState({"h1": TRAIN})
    error = FailureSignal(kind=RawFailureKind.DEGRADED, gpu_index=0, detected_at=START)
    agent, sink, _ = _agent([_at(0), _at(1), _at(2), _at(3, failures=(error,))], desired)
    await agent.step()
    desired.put(assignment("h1", "g1", ("acme", "train"), gpus=8, generation=2))  # more GPUs for the job here
    await agent.step()
    desired.put(assignment("h1", "g1", ("globex", "sim"), generation=3))  # acme's job leaves, globex's arrives
    await agent.step()
    await agent.step()
    assert [(item.tenant, item.kind) for item in sink.items] == [
        ("acme", "topology"),
        ("acme", "topology"),
        ("globex", "topology"),
        ("globex", "failure"),
    ]
    assert [n.gpus for n in sink.items[1].event.data.nodes] == [8]


async def test_a_failing_source_is_an_observed_state_not_a_crash() -> None:
    script = [_at(0), RuntimeError("nvml hung"), RuntimeError("nvml hung"), _at(3)]
    agent, sink, raw = _agent(script, StaticDesiredState({"h1": TRAIN}))
    states = await _steps(agent, 4)
    assert states == [AgentState.ASSIGNED, AgentState.SOURCE_FAILED, AgentState.SOURCE_FAILED, AgentState.ASSIGNED]
    assert agent.source_failures == 0 and sink.kinds() == ["topology"]
    assert len(raw.on(".telemetry.h1")) == 2


async def test_carbon_goes_out_on_change_and_every_n_ticks() -> None:
    def carbon(g: float) -> CarbonReading:
        return CarbonReading(region="US-CAL-CISO", g_per_kwh=g, observed_at=START)

    values = [300.0, 300.0, 300.0, 250.0, 250.0, 250.0, 250.0, 250.0]
    script = [_at(i, carbon=carbon(g)) for i, g in enumerate(values)]
    agent, sink, _ = _agent(script, StaticDesiredState({"h1": TRAIN}), carbon_every=3)
    await _steps(agent, len(values))
    published = [item.event.data.g_per_kwh for item in sink.items if item.kind == "carbon"]
    assert published == [300.0, 250.0, 250.0]  # first tick, the change at tick 4, the refresh 3 ticks later


async def test_raw_telemetry_and_heartbeats_are_provider_internal() -> None:
    agent, _, raw = _agent([_at(0)], StaticDesiredState({"h1": TRAIN}))
    await agent.step()
    beats = [await agent.heartbeat() for _ in range(3)]
    assert [b.seq for b in beats] == [0, 1, 2]
    subjects = {subject for subject, _ in raw.items}
    assert subjects == {telemetry_subject("h1"), heartbeat_subject("h1")}
    assert all(subject.startswith("hz.p.") for subject in subjects)
    assert raw.on(".telemetry.h1")[0]["gpus"][0]["serial"] == "SERIAL-h1-0"


async def test_run_ticks_and_beats_on_the_agents_clock_until_stopped() -> None:
    clock = ManualClock(START)
    sink, raw = RecordingSink(), RecordingRawSink()
    scenario = parse_scenario({"failures": [{"host": "h1", "at": "2.5s", "kind": "gpu_error", "gpu": 0}]})
    agent = Agent(
        AgentConfig(host="h1", tick_s=1.0, heartbeat_interval_s=0.5),
        source=SimulatedHost("h1", scenario=scenario, locality_group="g1", gpus=2, clock=clock),
        desired=StaticDesiredState({"h1": TRAIN}),
        sink=sink,
        raw=raw,
        secret=SECRET,
        clock=clock,
    )
    running = asyncio.create_task(agent.run())
    await eventually(lambda: agent.ticks == 1 and len(raw.on(".heartbeat")) == 1, what="the first tick and beat")
    for expected_ticks in range(2, 5):

        def beaten(n: int = expected_ticks) -> bool:
            return len(raw.on(".heartbeat")) == 2 * n - 2

        def ticked(n: int = expected_ticks) -> bool:
            return agent.ticks == n

        clock.advance(0.5)
        await eventually(beaten, what="a heartbeat every 0.5 s")
        clock.advance(0.5)
        await eventually(ticked, what=f"tick {expected_ticks}")
    agent.stop()
    await asyncio.wait_for(running, 2.0)
    assert agent.ticks == 4 and "failure" in sink.kinds(), "the failure at 2.5 s was seen at the 3 s tick"
    assert [b["seq"] for b in raw.on(".heartbeat")] == list(range(len(raw.on(".heartbeat"))))


def test_tracker_refreshes_carbon_every_n_ticks() -> None:
    tracker = ChangeTracker(carbon_every=3)
    published = []
    for tick, g in enumerate([300.0, 300.0, 300.0, 300.0, 250.0, 250.0]):
        snapshot = _at(tick, carbon=CarbonReading(region="US-CAL-CISO", g_per_kwh=g, observed_at=START))
        news = tracker.changes(project(snapshot, TRAIN, SECRET), jobs=[("acme", "train")], now=snapshot.sampled_at)
        published += [(tick, item.event.data.g_per_kwh) for item in news if item.slot == "carbon"]
    assert published == [(0, 300.0), (3, 300.0), (4, 250.0)]


async def test_same_seed_same_events() -> None:
    """Two agents over the same scenario, seed and clock publish the same events (ids aside: they are fresh)."""
    scenario = parse_scenario(
        {
            "congestion": [{"groups": ["g1"], "start": "2s", "duration": "2s", "slowdown": 2.5}],
            "failures": [{"host": "h1", "at": "1s", "kind": "degraded", "gpu": 1, "reason": "thermal"}],
            "predicted_failures": [{"host": "h1", "at": "1s", "eta": "60s", "confidence": 0.6}],
            "maintenance": [{"host": "h1", "kind": "live_migrate", "announce": "1s", "start": "3s", "end": "5s"}],
            "carbon": {"US-CAL-CISO": {"speedup": 3600}},
        }
    )
    fleet = {"h1": TRAIN, PEER: assignment(PEER, "g1", ("acme", "train"))}

    async def run_once() -> list[dict[str, Any]]:
        clock = ManualClock(START)
        sink = RecordingSink()
        agent = Agent(
            AgentConfig(host="h1"),
            source=SimulatedHost("h1", scenario=scenario, locality_group="g1", seed=5, clock=clock),
            desired=StaticDesiredState(fleet),
            sink=sink,
            secret=SECRET,
            clock=clock,
        )
        for _ in range(7):
            await agent.step()
            clock.advance(1.0)
        return [{"nats_subject": p.subject, **p.event.to_json_dict(), "id": None, "traceparent": None}
                for p in sink.items]

    first, second = await run_once(), await run_once()
    assert first == second
    ticks = [(event["time"], event["nats_subject"].split(".")[4]) for event in first]
    per_tick = [[kind for at, kind in ticks if at == f"2025-03-01T12:00:0{t}Z"] for t in range(7)]
    assert per_tick == [
        ["topology", "carbon"],
        ["failure", "failure", "maintenance", "carbon"],  # degraded + prediction; notice announced; next trace hour
        ["congestion", "carbon"],
        ["maintenance", "carbon"],  # started
        ["carbon", "congestion"],  # all-clears come after the current state
        ["maintenance", "carbon"],  # completed
        ["carbon"],
    ]
