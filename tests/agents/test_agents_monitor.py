"""The fleet monitor: missed heartbeats become one host_down per tenant job and outage; and a real agent process
killed with SIGKILL is reported to each affected tenant within 5 s."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js.kv import KeyValue

from broker_config.accounts import UserKeys
from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from harmonaize.desired_state import HEARTBEAT_INTERVAL_S, MISSED_HEARTBEATS_FOR_FAILURE, Heartbeat
from harmonaize.events import FailureKind
from harmonaize.pseudonyms import host_pseudonym
from harmonaize.subjects import tenant_events_filter
from provider_agents.clock import ManualClock
from provider_agents.desired import FleetView
from provider_agents.fleet_monitor import FleetMonitor
from provider_agents.publisher import JetStreamPublisher
from tests.agents.conftest import put_assignment, tenant_reader
from tests.agents.fakes import START, RecordingSink, StaticDesiredState, assignment
from tests.support import eventually

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"monitor-test-secret"


def _monitor(desired: StaticDesiredState) -> tuple[FleetMonitor, RecordingSink, ManualClock]:
    clock, sink = ManualClock(START), RecordingSink()
    return FleetMonitor(desired=desired, sink=sink, secret=SECRET, clock=clock), sink, clock


def _beat(host: str, seq: int = 0) -> Heartbeat:
    return Heartbeat(host=host, seq=seq, at=START)


async def test_a_silent_host_is_reported_once_per_tenant_job_per_outage() -> None:
    desired = StaticDesiredState({"h1": assignment("h1", "g1", ("acme", "train"), ("globex", "sim"))})
    monitor, sink, clock = _monitor(desired)
    monitor.observe_heartbeat(_beat("h1"))
    for _ in range(3):
        clock.advance(1.0)
        assert await monitor.check() == ()
        monitor.observe_heartbeat(_beat("h1"))
    clock.advance(HEARTBEAT_INTERVAL_S * MISSED_HEARTBEATS_FOR_FAILURE)
    assert await monitor.check() == (), "exactly the limit is not yet an outage"
    clock.advance(0.25)
    reported = await monitor.check()
    assert sorted((e.tenant, e.job) for e in reported) == [("acme", "train"), ("globex", "sim")]
    assert monitor.is_down("h1") and monitor.outages("h1") == 1
    for item in reported:
        assert item.event.data.kind is FailureKind.HOST_DOWN
        assert item.event.data.host == host_pseudonym(SECRET, item.tenant, "h1")
    clock.advance(5.0)
    assert await monitor.check() == (), "once per outage"

    desired.put(assignment("h1", "g1", ("acme", "train"), ("globex", "sim"), ("acme", "late")))
    assert [(e.tenant, e.job) for e in await monitor.check()] == [("acme", "late")], "a job placed there later is told"

    monitor.observe_heartbeat(_beat("h1", 9))
    assert monitor.is_up("h1") and await monitor.check() == ()
    clock.advance(3.5)
    assert len(await monitor.check()) == 3 and monitor.outages("h1") == 2, "a new outage is reported again"
    assert len(sink.items) == 6


async def test_an_assigned_host_that_never_beats_is_reported_after_the_grace_period() -> None:
    desired = StaticDesiredState(None)
    monitor, _, clock = _monitor(desired)
    clock.advance(10.0)
    assert await monitor.check() == (), "without desired state nobody can be told"
    desired.put(assignment("h7", "g1", ("acme", "train")))
    desired.put(assignment("h8", "g1"))
    assert await monitor.check() == ()
    clock.advance(3.1)
    assert [(e.tenant, e.job) for e in await monitor.check()] == [("acme", "train")]
    assert monitor.is_down("h8"), "an empty host is down too, with no one to tell"


async def test_hosts_that_keep_beating_are_never_reported() -> None:
    monitor, sink, clock = _monitor(StaticDesiredState({"h1": assignment("h1", "g1", ("acme", "train"))}))
    for seq in range(20):
        monitor.observe_heartbeat(_beat("h1", seq))
        clock.advance(HEARTBEAT_INTERVAL_S)
        await monitor.check()
    assert sink.items == [] and monitor.is_up("h1")


async def test_a_silent_host_whose_jobs_peers_wait_is_down_at_once_and_a_restarting_agent_is_not() -> None:
    """h1 silent for 0.6 s: down at once if acme/train's workers on h2 wait on a peer (h1 froze with its nodes); an
    agent restart on h1 (silent, its nodes running, no one waiting) gets the full window."""
    fleet = {"h1": assignment("h1", "g1", ("acme", "train")), "h2": assignment("h2", "g1", ("acme", "train"))}
    monitor, sink, clock = _monitor(StaticDesiredState(fleet))
    assert monitor.corroborated_limit_s < 0.6 < monitor.silence_limit_s

    async def beat_h2_until(seconds: float, waiting: tuple[str, ...]) -> None:
        for _ in range(round(seconds / HEARTBEAT_INTERVAL_S)):
            clock.advance(HEARTBEAT_INTERVAL_S / 2)
            await monitor.check()
            monitor.observe_heartbeat(Heartbeat(host="h2", seq=0, at=START, waiting=waiting))
            clock.advance(HEARTBEAT_INTERVAL_S / 2)
            await monitor.check()

    monitor.observe_heartbeat(_beat("h1"))
    monitor.observe_heartbeat(_beat("h2"))
    await beat_h2_until(1.0, waiting=())
    assert monitor.is_up("h1") and sink.items == [], "silent 1 s, nobody waits: an agent restart, not an outage"

    monitor.observe_heartbeat(_beat("h1", 1))
    await beat_h2_until(0.5, waiting=())
    await beat_h2_until(0.25, waiting=("acme/train",))
    assert monitor.is_down("h1") and not monitor.is_down("h2")
    assert [(e.subject.split(".")[2], e.event.data.kind) for e in sink.items] == [("acme", FailureKind.HOST_DOWN)]


async def test_the_monitor_does_not_take_its_own_stall_for_a_waiting_jobs_silent_host() -> None:
    fleet = {"h1": assignment("h1", "g1", ("acme", "train")), "h2": assignment("h2", "g1", ("acme", "train"))}
    monitor, sink, clock = _monitor(StaticDesiredState(fleet))
    monitor.observe_heartbeat(_beat("h1"))
    monitor.observe_heartbeat(Heartbeat(host="h2", seq=0, at=START, waiting=("acme/train",)))
    await monitor.check()
    clock.advance(1.0)  # the monitor itself was not scheduled for a second: h1's heartbeats wait in its socket
    monitor.observe_heartbeat(Heartbeat(host="h2", seq=1, at=START, waiting=("acme/train",)))
    assert await monitor.check() == () and monitor.is_up("h1")


@pytest.fixture
def agent_process_env(nats_server: NatsServer, provider_secret: bytes) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HZ_")}
    env.update(HZ_PROVIDER_SECRET=provider_secret.decode(), HZ_NATS_URL=nats_server.url, PYTHONUNBUFFERED="1")
    return env


@pytest.fixture
def agent_process(agent_process_env: dict[str, str], tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    log = open(tmp_path / "agent.log", "wb")
    command = [
        *(sys.executable, "-m", "provider_agents.cli", "agent"),
        *("--host-id", "h9", "--locality-group", "g1", "--gpus", "2", "--tick", "0.2", "--log-level", "WARNING"),
        "--no-launch",
    ]
    proc = subprocess.Popen(command, cwd=ROOT, env=agent_process_env, stdout=log, stderr=subprocess.STDOUT)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


async def test_sigkilled_agent_process_is_reported_to_each_affected_tenant_within_5s(
    nats_server: NatsServer,
    tenant_broker: NatsTenantBroker,
    two_tenants: dict[str, UserKeys],
    provider_nc: Client,
    kv: KeyValue,
    provider_secret: bytes,
    agent_process: subprocess.Popen[bytes],
    record_property: Callable[[str, object], None],
) -> None:
    jobs = {"acme": "llm-ft", "globex": "sim-7"}
    await put_assignment(kv, assignment("h9", "g1", *jobs.items()))
    await put_assignment(kv, assignment("h8", "g1", ("acme", "other")))  # a host nobody kills: heartbeats faked below
    only_failures = {t: (tenant_events_filter(t, kind="failure"),) for t in two_tenants}
    readers = {
        t: await tenant_reader(nats_server, tenant_broker, t, keys, name="failures", filter_subjects=only_failures[t])
        for t, keys in two_tenants.items()
    }
    view = FleetView(kv)
    publisher = JetStreamPublisher(provider_nc.jetstream())
    monitor = FleetMonitor(desired=view, sink=publisher, secret=provider_secret)
    view.start()
    publisher.start()
    running = asyncio.create_task(monitor.run(provider_nc))
    keep_h8_alive = asyncio.create_task(_beat_forever(provider_nc, "h8"))
    try:
        await eventually(
            lambda: monitor.is_up("h9") and monitor.heartbeats >= 3, timeout=30.0, what="the agent process's heartbeats"
        )
        assert agent_process.poll() is None
        killed_at = time.monotonic()
        agent_process.send_signal(signal.SIGKILL)
        agent_process.wait()

        latencies: dict[str, float] = {}

        async def every_host_down_arrived() -> bool:
            waiting = [t for t in jobs if t not in latencies]
            arrived = await asyncio.gather(*(readers[t].read(wait=0.05) for t in waiting))
            for tenant, got in zip(waiting, arrived, strict=True):
                if got:
                    latencies[tenant] = time.monotonic() - killed_at
            return len(latencies) == len(jobs)

        await eventually(every_host_down_arrived, timeout=10.0, what="a host_down for each tenant")
        record_property("kill_to_host_down_s", {t: round(v, 3) for t, v in latencies.items()})
        print(f"\nkill -> host_down latency: {latencies}")
        assert max(latencies.values()) < 5.0, latencies

        for tenant, reader in readers.items():
            ((subject, event),) = reader.events
            assert subject == f"hz.t.{tenant}.events.failure.{jobs[tenant]}"
            assert event.data.kind is FailureKind.HOST_DOWN
            assert event.data.host == host_pseudonym(provider_secret, tenant, "h9")

        checks = monitor.checks
        await eventually(lambda: monitor.checks >= checks + 8, what="two more seconds of checks")
        for reader in readers.values():
            assert await reader.read(wait=0.3) == [], "one report per outage"
        assert monitor.is_up("h8") and monitor.outages("h8") == 0
    finally:
        monitor.stop()
        keep_h8_alive.cancel()
        await asyncio.gather(running, keep_h8_alive, return_exceptions=True)
        await publisher.close()
        await view.stop()
        for reader in readers.values():
            await reader.close()


async def _beat_forever(nc: Client, host: str) -> None:
    from harmonaize.desired_state import heartbeat_subject

    seq = 0
    while True:
        await nc.publish(heartbeat_subject(host), Heartbeat(host=host, seq=seq, at=START).model_dump_json().encode())
        seq += 1
        await asyncio.sleep(HEARTBEAT_INTERVAL_S / 2)


def test_the_agent_command_names_the_bad_scenario_field(agent_process_env: dict[str, str], tmp_path: Path) -> None:
    scenario = tmp_path / "bad.yaml"
    scenario.write_text("congestion:\n  - {groups: [g1], start: 1s, slowdown: 0.5}\n")
    result = subprocess.run(
        [sys.executable, "-m", "provider_agents.cli", "agent", "--host-id", "h1", "--scenario", str(scenario)],
        cwd=ROOT,
        env=agent_process_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "congestion[0].slowdown" in result.stderr and "Traceback" not in result.stderr


class _SlowReporter:
    """A control plane whose down report is still in flight when the host's next heartbeat arrives."""

    def __init__(self, monitor_ref: list[FleetMonitor], host: str) -> None:
        self.monitor_ref, self.host = monitor_ref, host
        self.calls: list[str] = []

    async def report_host_down(self, host: str) -> list[str]:
        self.calls.append(f"down {host}")
        self.monitor_ref[0].observe_heartbeat(_beat(host, 99))  # the beat lands during the round trip
        return []

    async def report_host_up(self, host: str) -> None:
        self.calls.append(f"up {host}")


async def test_a_host_back_while_its_down_report_was_in_flight_is_reported_up() -> None:
    clock = ManualClock(START)
    ref: list[FleetMonitor] = []
    reporter = _SlowReporter(ref, "h1")
    monitor = FleetMonitor(desired=StaticDesiredState({"h1": assignment("h1", "g1", ("acme", "train"))}),
                           sink=RecordingSink(), secret=SECRET, clock=clock, reporter=reporter)
    ref.append(monitor)
    monitor.observe_heartbeat(_beat("h1"))
    clock.advance(HEARTBEAT_INTERVAL_S * MISSED_HEARTBEATS_FOR_FAILURE + 0.25)
    await monitor.check()
    assert monitor.is_up("h1")
    assert reporter.calls == ["down h1", "up h1"], "the control plane must not keep a beating host down"
    clock.advance(HEARTBEAT_INTERVAL_S * MISSED_HEARTBEATS_FOR_FAILURE + 0.25)
    await monitor.check()
    assert reporter.calls[2] == "down h1", "a later outage is reported again"
