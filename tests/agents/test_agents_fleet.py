"""Agents over a real broker: the desired-state mirror, and four simulated hosts whose events reach exactly the
tenants whose jobs are placed there (counted on the tenant side, through durable consumers)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.js.kv import KeyValue

from broker_config.accounts import UserKeys
from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from harmonaize.desired_state import DESIRED_STATE_BUCKET, host_key
from harmonaize.events import CongestionLevel, FailureKind, MaintenanceStatus
from harmonaize.pseudonyms import host_pseudonym, locality_pseudonym
from provider_agents.agent import Agent, AgentConfig, AgentState
from provider_agents.clock import ManualClock
from provider_agents.desired import FleetView, ensure_desired_state_bucket
from provider_agents.publisher import CoreSink, JetStreamPublisher
from provider_agents.telemetry import SimulatedHost, parse_scenario
from tests.agents.conftest import event_text, put_assignment, stored_messages, tenant_reader
from tests.agents.fakes import START, assignment
from tests.support import eventually


async def test_the_bucket_is_created_once_and_bound_by_everyone_after(provider_nc: Client) -> None:
    first = await ensure_desired_state_bucket(provider_nc.jetstream())
    second = await ensure_desired_state_bucket(provider_nc.jetstream())
    status = await second.status()
    assert first._name == second._name == DESIRED_STATE_BUCKET  # noqa: SLF001
    assert status.history == 5 and status.bucket == DESIRED_STATE_BUCKET


async def test_fleet_view_mirrors_puts_updates_and_deletes(kv: KeyValue) -> None:
    await put_assignment(kv, assignment("h1", "g1", ("acme", "train")))
    view = FleetView(kv, resync_s=0.3)
    view.start()
    try:
        await eventually(lambda: "h1" in (view.snapshot() or {}), what="the initial value")
        await put_assignment(kv, assignment("h2", "g1"))
        await put_assignment(kv, assignment("h1", "g1", ("acme", "train"), ("globex", "sim"), generation=2))
        await eventually(lambda: getattr(view.assignment("h1"), "generation", 0) == 2, what="the update")
        assert view.assignment("h2") is not None
        await kv.put(host_key("h3"), b"{not json")
        await kv.delete(host_key("h2"))
        await eventually(lambda: view.assignment("h2") is None, what="the delete")
        await eventually(lambda: view.loads >= 3, what="a few resyncs")
        assert set(view.snapshot() or {}) == {"h1"}, "malformed values are ignored, resyncs change nothing"
    finally:
        await view.stop()
    restarted = FleetView(kv)
    restarted.start()
    try:
        await eventually(lambda: restarted.loaded, what="a restarted view loading")
        assert restarted.assignment("h1") == assignment("h1", "g1", ("acme", "train"), ("globex", "sim"), generation=2)
    finally:
        await restarted.stop()


async def test_an_empty_bucket_is_loaded_as_an_empty_fleet(kv: KeyValue) -> None:
    view = FleetView(kv)
    view.start()
    try:
        await eventually(lambda: view.loaded, what="the empty snapshot")
        snapshot = view.snapshot()
        assert snapshot is not None and dict(snapshot) == {}
    finally:
        await view.stop()


async def test_fleet_view_keeps_trying_to_bind_the_bucket(kv: KeyValue) -> None:
    """A process whose JetStream is not ready yet starts anyway; its view loads once the bucket can be bound."""
    await put_assignment(kv, assignment("h1", "g1", ("acme", "train")))
    attempts = 0

    async def bind() -> KeyValue:
        nonlocal attempts
        attempts += 1
        if attempts < 3:
            raise TimeoutError("JetStream not ready")
        return kv

    view = FleetView(bind, retry_s=0.01)
    view.start()
    try:
        await eventually(lambda: view.assignment("h1") is not None, what="the view after two failed binds")
        assert attempts == 3
    finally:
        await view.stop()


SCENARIO = parse_scenario(
    {
        "hosts": {
            "h1": {"locality_group": "g1", "gpus": 4},
            "h2": {"locality_group": "g1", "gpus": 4},
            "h3": {"locality_group": "g2", "gpus": 4},
            "h4": {"locality_group": "g2", "gpus": 4},
        },
        "congestion": [
            {"groups": ["g1"], "link": "leaf-g1-up3", "start": "3s", "duration": "3s", "slowdown": 2.5},
            {"groups": ["g1", "g2"], "link": "spine-7:eth1/2", "start": "2s", "slowdown": 4.0},  # no job spans both
        ],
        "failures": [{"host": "h2", "at": "2s", "kind": "gpu_error", "gpu": 3, "reason": "xid_79"}],
        "predicted_failures": [{"host": "h1", "at": "1s", "eta": "40s", "confidence": 0.9, "gpu": 0}],
        "maintenance": [
            {"host": "h3", "notice": "chg-0042", "kind": "reboot", "announce": "1s", "start": "5s", "end": "7s"},
            {"host": "h4", "notice": "chg-0043", "kind": "retire", "announce": "1s", "start": "2s", "end": "3s"},
        ],
        "carbon": {"US-CAL-CISO": {"points": [{"at": "0s", "g_per_kwh": 380}, {"at": "4s", "g_per_kwh": 210}]}},
    }
)
INTERNAL_NAMES = ["h1", "h2", "h3", "h4", "g1", "g2", "leaf-g1", "spine-7", "eth1", "chg-004", "SIM", "llm-", "sim-"]


class Fleet:
    """Four in-process agents on one manual clock, each with its own KV mirror, publisher and connection."""

    def __init__(self, nc: Client, kv: KeyValue, secret: bytes) -> None:
        self.clock = ManualClock(START)
        self.views = {host: FleetView(kv) for host in ("h1", "h2", "h3", "h4")}
        self.publishers = {host: JetStreamPublisher(nc.jetstream()) for host in self.views}
        self.agents = {
            host: Agent(
                AgentConfig(host=host, carbon_every=1000),
                source=SimulatedHost(host, scenario=SCENARIO, seed=1, clock=self.clock),
                desired=self.views[host],
                sink=self.publishers[host],
                raw=CoreSink(nc),
                secret=secret,
                clock=self.clock,
            )
            for host in self.views
        }

    def start(self) -> None:
        for view in self.views.values():
            view.start()
        for publisher in self.publishers.values():
            publisher.start()

    async def tick(self) -> dict[str, AgentState]:
        states = {host: (await agent.step()).state for host, agent in self.agents.items()}
        for publisher in self.publishers.values():
            assert await publisher.drain(5.0)
        self.clock.advance(1.0)
        return states

    async def stop(self) -> None:
        for publisher in self.publishers.values():
            await publisher.close()
        for view in self.views.values():
            await view.stop()


@pytest.fixture
async def fleet(provider_nc: Client, kv: KeyValue, provider_secret: bytes) -> AsyncIterator[Fleet]:
    running = Fleet(provider_nc, kv, provider_secret)
    running.start()
    yield running
    await running.stop()


async def test_four_hosts_two_groups_events_reach_exactly_the_tenants_placed_there(
    nats_server: NatsServer,
    tenant_broker: NatsTenantBroker,
    two_tenants: dict[str, UserKeys],
    provider_nc: Client,
    kv: KeyValue,
    fleet: Fleet,
    provider_secret: bytes,
) -> None:
    # The control plane's placement: acme's job on h1 + h2 (group g1), globex's on h3 (g2), nobody on h4.
    placements = [
        assignment("h1", "g1", ("acme", "llm-ft")),
        assignment("h2", "g1", ("acme", "llm-ft")),
        assignment("h3", "g2", ("globex", "sim-7")),
        assignment("h4", "g2"),
    ]
    for placement in placements:
        await put_assignment(kv, placement)
    await eventually(
        lambda: all(len(view.snapshot() or {}) == 4 for view in fleet.views.values()), what="every agent's mirror"
    )
    readers = {t: await tenant_reader(nats_server, tenant_broker, t, keys) for t, keys in two_tenants.items()}
    try:
        states = [await fleet.tick() for _ in range(9)]  # scenario seconds 0..8
        assert {s["h4"] for s in states} == {AgentState.IDLE}
        assert {s["h1"] for s in states} == {AgentState.ASSIGNED}
        for reader in readers.values():
            await reader.read()

        acme, globex = readers["acme"], readers["globex"]
        assert acme.kinds() == {"topology": 1, "carbon": 2, "failure": 2, "congestion": 2}
        assert globex.kinds() == {"topology": 1, "carbon": 2, "maintenance": 3}
        assert await stored_messages(provider_nc, "acme") == 7
        assert await stored_messages(provider_nc, "globex") == 6
        for reader in readers.values():
            assert await reader.read(wait=0.3) == [], "nothing more arrives"

        for tenant, reader in readers.items():
            job = {"acme": "llm-ft", "globex": "sim-7"}[tenant]
            for subject, event in reader.events:
                assert subject.startswith(f"hz.t.{tenant}.events.") and subject.endswith(f".{job}")
                assert event.subject == job
                text = event_text(subject, event)
                assert not [name for name in INTERNAL_NAMES if name in text.replace(job, "")], text
                other = "globex" if tenant == "acme" else "acme"
                assert other not in text

        by_kind = {kind: [e for s, e in acme.events if s.split(".")[4] == kind] for kind in acme.kinds()}
        failures = {e.data.kind: e.data for e in by_kind["failure"]}
        assert failures[FailureKind.GPU_ERROR].host == host_pseudonym(provider_secret, "acme", "h2")
        assert failures[FailureKind.GPU_ERROR].reason == "xid_79"
        assert failures[FailureKind.PREDICTED_FAILURE].host == host_pseudonym(provider_secret, "acme", "h1")
        assert [e.data.level for e in by_kind["congestion"]] == [CongestionLevel.HIGH, CongestionLevel.NONE]
        assert by_kind["congestion"][0].data.groups == (locality_pseudonym(provider_secret, "acme", "g1"),)
        assert [e.data.g_per_kwh for e in by_kind["carbon"]] == [380.0, 210.0]
        topology = by_kind["topology"][0].data
        assert {n.host for n in topology.nodes} == {host_pseudonym(provider_secret, "acme", h) for h in ("h1", "h2")}
        notices = [e.data for s, e in globex.events if s.split(".")[4] == "maintenance"]
        assert [n.status for n in notices] == [
            MaintenanceStatus.SCHEDULED,
            MaintenanceStatus.STARTED,
            MaintenanceStatus.COMPLETED,
        ]
        assert notices[0].hosts == (host_pseudonym(provider_secret, "globex", "h3"),)
    finally:
        for reader in readers.values():
            await reader.close()


async def test_placement_changes_are_picked_up_level_triggered(
    nats_server: NatsServer,
    tenant_broker: NatsTenantBroker,
    two_tenants: dict[str, UserKeys],
    kv: KeyValue,
    fleet: Fleet,
    provider_secret: bytes,
) -> None:
    await put_assignment(kv, assignment("h4", "g2"))
    await eventually(lambda: fleet.views["h4"].loaded, what="h4's mirror")
    reader = await tenant_reader(nats_server, tenant_broker, "globex", two_tenants["globex"])
    try:
        assert (await fleet.agents["h4"].step()).state is AgentState.IDLE
        await put_assignment(kv, assignment("h4", "g2", ("globex", "batch"), generation=2))
        await eventually(lambda: getattr(fleet.views["h4"].assignment("h4"), "jobs", ()) != (), what="the placement")
        fleet.clock.advance(2.0)  # h4's notice is announced at 1 s
        assert (await fleet.agents["h4"].step()).state is AgentState.ASSIGNED
        assert await fleet.publishers["h4"].drain(5.0)
        await reader.read()
        assert reader.kinds() == {"topology": 1, "carbon": 1, "maintenance": 1}
        notice = next(e for s, e in reader.events if ".maintenance." in s).data
        assert notice.kind.value == "retire" and notice.status is MaintenanceStatus.STARTED
    finally:
        await reader.close()
