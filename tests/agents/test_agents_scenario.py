"""Scenario files: valid ones load, invalid ones fail with an error that names the field (or the YAML line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from provider_agents.telemetry.scenario import ScenarioError, load_scenario, parse_duration, parse_scenario

EXAMPLE = """
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
  - {host: h1, at: 1s, eta: 30s, confidence: 0.9, gpu: 0}
maintenance:
  - {host: h3, notice: tkt-4711, kind: reboot, announce: 1s, start: 5s, end: 7s}
carbon:
  US-CAL-CISO: {trace: caiso, speedup: 3600}
  DE: {points: [{at: 0s, g_per_kwh: 380}, {at: 4s, g_per_kwh: 210}]}
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(text)
    return path


def test_the_documented_example_loads(tmp_path: Path) -> None:
    scenario = load_scenario(_write(tmp_path, EXAMPLE))
    assert scenario.seed == 7
    assert scenario.congestion[0].start == 3.0 and scenario.congestion[0].duration == 3.0
    assert scenario.predicted_failures[0].eta == 30.0
    assert scenario.host("h1").gpus == 8
    assert scenario.carbon_for("US-CAL-CISO").speedup == 3600
    assert scenario.carbon_for("FR").trace is None  # unlisted regions replay the default trace


def test_the_module_docstring_example_is_the_same_format() -> None:
    import provider_agents.telemetry.scenario as module

    doc = module.__doc__ or ""
    block = doc[doc.index("    version: 1") :]
    text = "\n".join(line[4:] for line in block.splitlines())
    assert parse_scenario(__import__("yaml").safe_load(text)).maintenance[0].notice == "tkt-4711"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("congestion: [{groups: [g1], start: 1s, slowdown: 0.5}]", "congestion[0].slowdown"),
        ("congestion: [{groups: [g1, g2, g3], start: 1s, slowdown: 2}]", "congestion[0].groups"),
        ("congestion: [{groups: [g1], start: 5 parsecs, slowdown: 2}]", "congestion[0].start"),
        ("failures: [{host: h1, at: 1s, kind: gpu_error}, {host: h2, at: 1s, kind: exploded}]", "failures[1].kind"),
        ("failures: [{host: h1, at: 1s, kind: gpu_error, colour: red}]", "failures[0].colour"),
        ("failures: [{host: H1, at: 1s, kind: gpu_error}]", "failures[0].host"),
        ("predicted_failures: [{host: h1, at: 10s, eta: 5s, confidence: 0.5}]", "predicted_failures[0]"),
        ("predicted_failures: [{host: h1, at: 1s, eta: 5s, confidence: 1.5}]", "predicted_failures[0].confidence"),
        ("maintenance: [{host: h1, kind: reboot, announce: 9s, start: 5s, end: 7s}]", "maintenance[0]"),
        ("maintenance: [{host: h1, kind: nap, announce: 1s, start: 5s, end: 7s}]", "maintenance[0].kind"),
        ("hosts: {h1: {gpus: 65}}", "hosts.h1.gpus"),
        ("carbon: {us-west: {speedup: 10}}", "carbon.us-west"),
        ("carbon: {DE: {speedup: 0}}", "carbon.DE.speedup"),
        ("carbon: {DE: {trace: caiso, points: [{at: 0s, g_per_kwh: 1}]}}", "carbon.DE"),
        ("carbon: {DE: {points: [{at: 2s, g_per_kwh: 1}, {at: 1s, g_per_kwh: 2}]}}", "carbon.DE"),
        ("version: 2", "version"),
        ("flavour: spicy", "flavour"),
    ],
)
def test_errors_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        load_scenario(_write(tmp_path, text))
    assert field in caught.value.fields, caught.value.fields
    assert f"{field}:" in str(caught.value)
    assert str(tmp_path / "scenario.yaml") in str(caught.value)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    text = "seed: x\nfailures: [{host: h1, at: -1, kind: gpu_error}]\n"
    with pytest.raises(ScenarioError) as caught:
        load_scenario(_write(tmp_path, text))
    assert {"seed", "failures[0].at"} <= set(caught.value.fields)


def test_yaml_syntax_errors_name_the_line(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match=r"line 2, column \d+: not valid YAML"):
        load_scenario(_write(tmp_path, "seed: 1\n\tfailures: []\n"))


def test_a_scenario_must_be_a_mapping_and_readable(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="must be a mapping"):
        load_scenario(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ScenarioError, match="cannot be read"):
        load_scenario(tmp_path / "missing.yaml")
    assert load_scenario(_write(tmp_path, "")).congestion == ()


def test_trace_paths_are_relative_to_the_scenario_file(tmp_path: Path) -> None:
    scenario = load_scenario(_write(tmp_path, "carbon: {DE: {trace: traces/de.csv}}"))
    assert scenario.carbon["DE"].trace == str(tmp_path / "traces" / "de.csv")
    assert load_scenario(_write(tmp_path, "carbon: {DE: {trace: caiso}}")).carbon["DE"].trace == "caiso"


@pytest.mark.parametrize(
    ("text", "seconds"), [("3s", 3.0), ("250ms", 0.25), ("2m", 120.0), ("1.5h", 5400.0), (4, 4.0), (0.5, 0.5)]
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["3 days", "-1s", -2, True, "s", None])
def test_bad_durations(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


async def test_the_shipped_demo_scenario_plays_through() -> None:
    """The demo fleet's file loads and, over its 6 minutes, tells each tenant what the demo's story needs."""
    from provider_agents.agent import Agent, AgentConfig
    from provider_agents.clock import ManualClock
    from provider_agents.telemetry import SimulatedHost
    from tests.agents.fakes import START, RecordingSink, StaticDesiredState, assignment

    scenario = load_scenario(Path(__file__).resolve().parents[2] / "provider_agents" / "scenarios" / "demo.yaml")
    fleet = {
        "h1": assignment("h1", "g1", ("demo", "llm")),
        "h2": assignment("h2", "g1", ("demo", "llm")),
        "h3": assignment("h3", "g2", ("demo", "llm")),
        "h4": assignment("h4", "g2", ("other", "batch")),
    }
    clock, sink = ManualClock(START), RecordingSink()
    agents = [
        Agent(
            AgentConfig(host=host),
            source=SimulatedHost(host, scenario=scenario, clock=clock),
            desired=StaticDesiredState(fleet),
            sink=sink,
            secret=b"demo-secret",
            clock=clock,
        )
        for host in fleet
    ]
    for _ in range(0, 360, 5):
        for agent in agents:
            await agent.step()
        clock.advance(5.0)
    demo = sink.kinds("demo")
    assert demo.count("topology") == 1 and demo.count("congestion") == 2 and "maintenance" not in demo
    assert demo.count("failure") == 2 and demo.count("carbon") >= 30
    assert sink.kinds("other").count("maintenance") == 3
    lows = [p.event.data.g_per_kwh for p in sink.items if p.kind == "carbon" and p.tenant == "demo"]
    assert min(lows) < 210.0 < max(lows)
