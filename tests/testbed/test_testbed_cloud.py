"""The local cloud on the testbed, end to end: 4 hosts as namespaces in 2 groups, their agents inside them, a DDP job
training across the shaped uplinks with real gloo traffic.

- The tenant's topology event matches the layout the testbed built (groups, and the uplink's bandwidth class).
- Another tenant's bulk flow over the uplink (a congestion episode injected as `harmonaize scenario run` does):
  the agents measure it and the job's congestion event reaches the tenant within 2 s; the status quo job (no
  compression allowed) keeps clearly less of its samples/s than the cooperative one, whose compression the micro
  loop turns on.
- A partition (the host's links down, its processes alive): the host is reported down, the job goes on without it;
  when the network is back, so is the host.
- Stopping the cloud removes every namespace of it; where no testbed can be built the cloud says why and runs on
  loopback.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from harmonaize.pseudonyms import host_pseudonym, locality_pseudonym
from harmonaize.settings import Settings
from harmonaize_cli.local_cloud import launcher
from harmonaize_cli.local_cloud.congestion_trial import ArmResult, TrialShape, run_arm
from harmonaize_cli.local_cloud.fleet import LocalFleet, fleet_of
from harmonaize_cli.local_cloud.launcher import LocalCloudInfo, run_local_cloud
from harmonaize_cli.local_cloud.tenant_probe import TenantProbe, inject_scenario
from provider_agents.markers import cloud_id
from provider_agents.telemetry.scenario import PartitionEpisode, Scenario
from provider_agents.testbed.commands import run
from provider_agents.testbed.netns import build, namespaces_of
from tests.cloud.test_up import read_env_file, start_up
from tests.support import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.usefixtures("testbed_possible")]

UPLINK_MBIT = 50.0


async def _in_testbed_cloud(tmp_path: Path, story: Any) -> str:
    """Run `story(info, fleet, probe)` in a fresh testbed cloud; the cloud's id (its namespaces are gone after)."""
    settings = Settings(_env_file=None, data_dir=tmp_path / "cloud", api_port=0)
    clouds: list[str] = []

    async def run(info: LocalCloudInfo, fleet: LocalFleet | None) -> None:
        assert fleet is not None and fleet.testbed is not None, info.network
        clouds.append(fleet.testbed.layout.cloud)
        assert namespaces_of(clouds[0]) == fleet.testbed.layout.namespaces
        assert info.network.startswith("testbed: 4 host namespaces in 2 locality groups"), info.network
        probe = TenantProbe(info.data_dir)
        await probe.listen()
        try:
            await story(info, fleet, probe)
        finally:
            await probe.close()

    await asyncio.wait_for(
        run_local_cloud(settings, hosts=fleet_of(4), story=run, testbed_mbit=UPLINK_MBIT), timeout=540
    )
    return clouds[0]


def _topology_matches_layout(probe: TenantProbe, fleet: LocalFleet, job: str) -> bool:
    """Some topology event of `job` placed on all four hosts says what the layout built (a later one, after the job
    was released host by host, lists fewer nodes)."""
    assert fleet.testbed is not None
    layout = fleet.testbed.layout
    expected_nodes = {
        host_pseudonym(probe.secret, "demo", h.name): locality_pseudonym(probe.secret, "demo", h.group)
        for h in layout.hosts
    }
    for _, event in probe.events:
        if event.get("subject") != job or not str(event.get("type", "")).endswith(".topology.v1"):
            continue
        data = event["data"]
        nodes = {node["host"]: node["group"] for node in data["nodes"]}
        if len(nodes) < len(expected_nodes):
            continue
        links = [(link["a"], link["b"], link["bandwidth"]) for link in data["links"]]
        groups = {group["group"]: group["intra_bandwidth"] for group in data["groups"]}
        return (
            nodes == expected_nodes
            and len(links) == 1 and links[0][2] == "medium"  # 50 Mbit/s of the scale model: 50 Gbit/s
            and set(groups) == set(expected_nodes.values()) and set(groups.values()) == {"very_high"}
        )
    return False


async def test_congestion_is_measured_and_cooperation_keeps_the_jobs_rate(tmp_path: Path) -> None:
    results: dict[str, ArmResult] = {}
    shape = TrialShape(window_s=10.0)

    async def story(info: LocalCloudInfo, fleet: LocalFleet, probe: TenantProbe) -> None:
        for arm in ("status_quo", "cooperative"):
            if arm == "cooperative":
                await eventually(lambda: _topology_ok(probe, fleet, "congestion-status-quo"), timeout=10,
                                 what="a topology event matching the layout")
            results[arm] = await run_arm(probe, arm, shape)

    cloud = await _in_testbed_cloud(tmp_path, story)
    status_quo, cooperative = results["status_quo"], results["cooperative"]
    summary = {arm: (round(r.kept, 2), r.compression, r.detected_s, r.measured_s, r.congested.steps)
               for arm, r in results.items()}
    print(f"(kept, compression, event s, measured s, congested steps) by arm: {summary}")
    for result in results.values():
        assert result.detected_s is not None and result.detected_s <= 2.0, summary
    assert status_quo.compression == "none" and cooperative.compression != "none", summary
    assert status_quo.kept < 0.75, f"the cross-traffic did not slow the status quo job: {summary}"
    assert cooperative.congested.samples_per_s > 1.2 * status_quo.congested.samples_per_s, summary
    assert namespaces_of(cloud) == [], "the stopped cloud left namespaces behind"


async def _topology_ok(probe: TenantProbe, fleet: LocalFleet, job: str) -> bool:
    return _topology_matches_layout(probe, fleet, job)


async def test_a_partitioned_host_is_down_and_the_job_goes_on_then_it_comes_back(tmp_path: Path) -> None:
    job = {
        "id": "partitioned", "min_workers": 1, "max_workers": 4, "gpus_per_worker": 4, "initial_workers": 4,
        "entrypoint": ["-m", "workloads.examples.mlp", "--step-delay-ms", "50"],
    }

    async def host_state(probe: TenantProbe, host: str) -> dict[str, Any]:
        reply = await probe.admin.get("/v1/hosts")
        reply.raise_for_status()
        return next(item for item in reply.json() if item["id"] == host)

    async def story(info: LocalCloudInfo, fleet: LocalFleet, probe: TenantProbe) -> None:
        await probe.submit(job)
        await probe.wait_progress("partitioned", lambda p: p["world_size"] == 4 and p["step"] >= 5, timeout=180,
                                  what="training at 4")
        started = time.monotonic()
        partition = PartitionEpisode(host="h4", at=0.0, duration=25.0)
        await inject_scenario(info.nats_url, probe.secret, Scenario(partitions=(partition,)), at=datetime.now(UTC))
        progress = await probe.wait_progress(
            "partitioned", lambda p: p["world_size"] == 3, timeout=20, what="the job re-formed without h4"
        )
        assert (await host_state(probe, "h4"))["down_at"] is not None
        assert fleet.agent_running("h4"), "a partition leaves the host's processes alive"
        await probe.wait_progress("partitioned", lambda p: p["step"] >= progress["step"] + 5, timeout=30,
                                  what="stepping at 3")
        assert time.monotonic() - started < 25, "recovered only after the partition ended"
        assert probe.first_event("failure", "partitioned", lambda d: d.get("kind") == "host_down",
                                 after=started) is not None

        async def back() -> bool:
            return (await host_state(probe, "h4"))["down_at"] is None

        await eventually(back, timeout=60, interval=0.5, what="h4 up again once its network is back")

    cloud = await _in_testbed_cloud(tmp_path, story)
    assert namespaces_of(cloud) == []


async def test_without_a_testbed_the_cloud_says_why_and_runs_on_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "testbed_unavailable", lambda: "the testbed needs root; running on loopback instead")
    seen: list[LocalCloudInfo] = []

    async def story(info: LocalCloudInfo, fleet: LocalFleet | None) -> None:
        seen.append(info)
        assert fleet is not None and fleet.testbed is None

    settings = Settings(_env_file=None, data_dir=tmp_path / "cloud", api_port=0)
    await asyncio.wait_for(run_local_cloud(settings, hosts=fleet_of(1), story=story, testbed_mbit=50), timeout=120)
    assert seen and seen[0].network == "the testbed needs root; running on loopback instead"
    assert seen[0].api_url.startswith("http://127.0.0.1:")


def test_up_testbed_says_where_it_runs_and_a_restart_after_a_crash_clears_only_its_own_leftovers(
    tmp_path: Path, new_cloud: Callable[[], str]
) -> None:
    """The real command: `harmonaize up --testbed`, stopped with Ctrl-C; then a crashed run's leftovers of the same
    cloud (its namespaces, one it never finished) beside another testbed: the next start removes its own only."""
    data_dir = tmp_path / "hz"
    first = start_up(data_dir, "--testbed", "--hosts", "2", "--uplink-mbit", "30")
    secret = json.loads((data_dir / "secrets.json").read_text())["provider_secret"].encode()
    cloud = cloud_id(secret, data_dir.resolve())
    try:
        network = next(line for line in first.lines if line.strip().startswith("network"))
        assert "testbed: 2 host namespaces in 2 locality groups, uplinks 30 Mbit/s, services at 198.19." in network
        api = read_env_file(data_dir / "admin.env")["HZ_API_URL"]
        assert api.startswith("http://198.19.") and len(namespaces_of(cloud)) == 5  # 2 hosts, fabric, 2 neighbours
    finally:
        first.proc.send_signal(signal.SIGINT)
        first.proc.wait(60)
    assert namespaces_of(cloud) == [], "Ctrl-C left namespaces behind"

    other = new_cloud()
    neighbour = build(other, {"x1": "g1", "x2": "g2"}, uplink_mbit=30)
    build(cloud, {"h1": "g1", "h2": "g2"}, uplink_mbit=30)  # what a crashed run of this cloud left
    run(["ip", "netns", "add", f"hz-{cloud}-orphan"])
    second = start_up(data_dir, "--testbed", "--hosts", "2")
    try:
        assert f"hz-{cloud}-orphan" not in namespaces_of(cloud)
        assert namespaces_of(other) == neighbour.namespaces
    finally:
        second.proc.send_signal(signal.SIGINT)
        second.proc.wait(60)
    assert namespaces_of(cloud) == [] and namespaces_of(other) == neighbour.namespaces
