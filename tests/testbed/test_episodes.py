"""Scenario episodes played for real on a 4-host, 2-group testbed: cross-traffic saturates the uplink while its
episode lasts and is gone after; a lowered uplink slows a transfer across and is restored; a partitioned host reaches
nothing and comes back; stopping (or cancelling) the player mid-episode undoes everything; a flow that ends before
its episode is started again; `stop_all` kills one cloud's flows only, and a flow ends by itself at its byte bound.

The player runs on its own event loop in a thread, as it would beside the local cloud; every wait is a poll with a
deadline. Measuring a rate needs a window of time: those are the only timed waits."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import pytest

from provider_agents.markers import host_prefix
from provider_agents.processes import marked_processes
from provider_agents.telemetry.scenario import (
    CongestionEpisode,
    LinkRateEpisode,
    PartitionEpisode,
    Scenario,
    ScenarioError,
    parse_scenario,
)
from provider_agents.testbed import episodes
from provider_agents.testbed import layout as testbed_layout
from provider_agents.testbed.commands import run
from provider_agents.testbed.episodes import EpisodePlayer
from provider_agents.testbed.links import LinkCounters, all_counters
from provider_agents.testbed.netns import build
from provider_agents.testbed.traffic import CrossTraffic, stop_all, traffic_prefix
from tests.testbed.traffic import in_namespace, transfer_mbit

pytestmark = pytest.mark.timeout(180)

HOSTS = {"h1": "g1", "h2": "g1", "h3": "g2", "h4": "g2"}
UPLINK_MBIT = 40.0
SIZE = 1_000_000  # bytes per transfer: 0.2 s at 40 Mbit/s, 0.8 s at 10


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def _flow_pids(cloud: str) -> list[int]:
    return marked_processes(traffic_prefix(cloud), prefix=True)


def _qdisc(layout: testbed_layout.TestbedLayout, interface: str) -> LinkCounters:
    return all_counters(layout.fabric)[interface]


def _sent_mbit(layout: testbed_layout.TestbedLayout, group: str, window_s: float) -> float:
    """What `group`'s uplink sent out of the group over `window_s`, in Mbit/s."""
    end = layout.uplink(group)[0]
    before, started = _qdisc(layout, end).bytes_sent, time.monotonic()
    time.sleep(window_s)
    after, elapsed = _qdisc(layout, end).bytes_sent, time.monotonic() - started
    return (after - before) * 8 / elapsed / 1e6


def _links_up(namespace: str) -> bool:
    links = {link["ifname"]: link for link in json.loads(run(["ip", "-n", namespace, "-j", "link", "show"]))}
    return all("UP" in links[name]["flags"] for name in ("data", "mgmt"))


def _reaches(namespace: str, address: str, port: int) -> bool:
    probe = "import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)\n" \
            "except OSError:\n    sys.exit(1)\n"
    return subprocess.run(in_namespace(namespace, probe, address, str(port)), timeout=10).returncode == 0


@contextmanager
def playing(player: EpisodePlayer) -> Iterator[Callable[[bool], None]]:
    """Runs `player` on an event loop in a thread; yields `end(cancel)`: set its stop event (or cancel its task) and
    wait until `run` returned, its undo done."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    stop = asyncio.Event()
    finished = threading.Event()

    async def play() -> None:
        try:
            await player.run(stop)
        finally:
            finished.set()

    future = asyncio.run_coroutine_threadsafe(play(), loop)

    def end(cancel: bool = False) -> None:
        if cancel:
            future.cancel()
        else:
            loop.call_soon_threadsafe(stop.set)
        assert finished.wait(30), "the player did not return"

    try:
        yield end
    finally:
        if not finished.is_set():
            end()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_a_congestion_episode_saturates_the_uplink_while_it_lasts(new_cloud: Callable[[], str]) -> None:
    cloud = new_cloud()
    layout = build(cloud, HOSTS, uplink_mbit=UPLINK_MBIT)
    intra = CongestionEpisode(groups=("g2",), start=0, duration=3, slowdown=2)
    across = CongestionEpisode(groups=("g1", "g2"), start=0, duration=3, slowdown=2)
    player = EpisodePlayer(layout, Scenario(congestion=(intra, across)), start=datetime.now(UTC))
    with playing(player):
        _until(lambda: player.active.flows == (("g1", "g2"),), "the flow runs (the intra-group episode skipped)")
        assert len(_flow_pids(cloud)) == 2, "a sink and a source, both marked"
        time.sleep(0.3)  # past TCP's slow start
        rate = _sent_mbit(layout, "g1", 1.5)
        assert rate >= 0.8 * UPLINK_MBIT, f"the g1 uplink carried {rate:.1f} Mbit/s during the episode"
        _until(lambda: player.active.flows == () and _flow_pids(cloud) == [], "the flow is gone after the episode")
    assert _sent_mbit(layout, "g1", 0.5) < 1, "the uplink is quiet again"


def test_a_link_rate_episode_slows_transfers_across_and_is_restored(new_cloud: Callable[[], str]) -> None:
    cloud = new_cloud()
    layout = build(cloud, HOSTS, uplink_mbit=UPLINK_MBIT)
    h1, h3 = layout.host("h1"), layout.host("h3")
    episode = LinkRateEpisode(group="g1", start=0, duration=6, mbit=10)
    player = EpisodePlayer(layout, Scenario(link_rates=(episode,)), start=datetime.now(UTC))
    with playing(player):
        _until(lambda: player.active.link_rates == (("g1", 10.0),), "the uplink is lowered")
        for end in layout.uplink("g1"):
            assert _qdisc(layout, end).rate_bps == pytest.approx(10e6, rel=0.01), end
        slowed = transfer_mbit(h1.namespace, h3.namespace, h3.data_address, size=SIZE)
        assert slowed < 0.4 * UPLINK_MBIT, f"{slowed:.1f} Mbit/s across a 10 Mbit/s uplink"
        _until(lambda: player.active.link_rates == (), "the uplink is restored after the episode")
        for end in layout.uplink("g1"):
            assert _qdisc(layout, end).rate_bps == pytest.approx(UPLINK_MBIT * 1e6, rel=0.01), end
        restored = transfer_mbit(h1.namespace, h3.namespace, h3.data_address, size=SIZE, port=5202)
        assert restored > 0.6 * UPLINK_MBIT, f"{restored:.1f} Mbit/s after the episode"


def test_a_partitioned_host_reaches_nothing_until_it_comes_back(new_cloud: Callable[[], str]) -> None:
    cloud = new_cloud()
    layout = build(cloud, HOSTS, uplink_mbit=UPLINK_MBIT)
    h1, h3 = layout.host("h1"), layout.host("h3")
    listener = subprocess.Popen(in_namespace(h3.namespace, LISTENER, h3.data_address, "60"), stdout=subprocess.PIPE,
                                text=True)
    try:
        assert listener.stdout is not None
        port = int(listener.stdout.readline())
        with socket.create_server((layout.services_address, 0)) as services:
            services_port = services.getsockname()[1]
            assert _reaches(h1.namespace, h3.data_address, port), "h3 before"
            player = EpisodePlayer(layout, Scenario(partitions=(PartitionEpisode(host="h1", at=0, duration=4),)),
                                   start=datetime.now(UTC))
            with playing(player):
                _until(lambda: player.active.partitioned == ("h1",), "h1 is partitioned")
                assert not _links_up(h1.namespace)
                assert not _reaches(h1.namespace, h3.data_address, port), "h3 from a partitioned h1"
                assert not _reaches(h1.namespace, layout.services_address, services_port), "the services, likewise"
                assert _reaches(layout.host("h2").namespace, h3.data_address, port), "the others are not cut off"
                _until(lambda: player.active.partitioned == (), "h1 comes back after the episode")
                assert _links_up(h1.namespace)
                _until(lambda: _reaches(h1.namespace, h3.data_address, port), "h3 from h1 again")
                assert _reaches(h1.namespace, layout.services_address, services_port), "the services from h1 again"
    finally:
        listener.kill()
        listener.wait()


LISTENER = r"""
import socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
end = time.monotonic() + float(sys.argv[2])
while (left := end - time.monotonic()) > 0:
    server.settimeout(left)
    try:
        server.accept()[0].close()
    except OSError:
        break
"""


@pytest.mark.parametrize("cancel", [False, True], ids=["stopped", "cancelled"])
def test_ending_the_player_mid_episode_undoes_everything(new_cloud: Callable[[], str], cancel: bool) -> None:
    cloud = new_cloud()
    layout = build(cloud, HOSTS, uplink_mbit=UPLINK_MBIT)
    scenario = Scenario(  # started 5 s ago, episodes from 2 s on: they apply though their start passed unplayed
        congestion=(CongestionEpisode(groups=("g1", "g2"), start=2, duration=60, slowdown=2),),
        link_rates=(LinkRateEpisode(group="g2", start=2, duration=60, mbit=10),),
        partitions=(PartitionEpisode(host="h2", at=2),),
    )
    player = EpisodePlayer(layout, scenario, start=datetime.now(UTC) - timedelta(seconds=5))
    player.inject(Scenario(link_rates=(LinkRateEpisode(group="g1", start=0, mbit=20),)), at=datetime.now(UTC))
    with playing(player) as end:
        _until(lambda: player.active.flows == (("g1", "g2"),), "the flow runs")
        assert player.active.link_rates == (("g1", 20.0), ("g2", 10.0)) and player.active.partitioned == ("h2",)
        assert _flow_pids(cloud) and not _links_up(layout.host("h2").namespace)
        end(cancel)
    assert player.active.idle
    assert _flow_pids(cloud) == [], "the flow is killed"
    for group in layout.groups:
        for interface in layout.uplink(group):
            assert _qdisc(layout, interface).rate_bps == pytest.approx(UPLINK_MBIT * 1e6, rel=0.01)
    assert _links_up(layout.host("h2").namespace)


def test_stop_all_kills_one_clouds_flows_only_and_a_flow_is_bounded(new_cloud: Callable[[], str]) -> None:
    ours, theirs = new_cloud(), new_cloud()
    two = {"h1": "g1", "h2": "g2"}
    mine, other = build(ours, two, uplink_mbit=UPLINK_MBIT), build(theirs, two, uplink_mbit=UPLINK_MBIT)
    flows = [CrossTraffic(layout, "g1", "g2", mbit=8, max_seconds=60) for layout in (mine, other)]
    try:
        for flow in flows:
            flow.start()
        time.sleep(0.3)
        paced = _sent_mbit(other, "g1", 1.0)
        assert 5 < paced < 12, f"a flow paced at 8 Mbit/s sent {paced:.1f}"
        assert marked_processes(host_prefix(ours, "h1"), prefix=True) == [], "no host's prefix matches a flow"
        assert len(stop_all(ours)) == 2
        _until(lambda: _flow_pids(ours) == [] and not flows[0].running, "our flow is gone")
        assert flows[1].running and len(_flow_pids(theirs)) == 2, "theirs runs on"
    finally:
        for flow in flows:
            flow.stop()
    assert _flow_pids(theirs) == []

    bounded = CrossTraffic(mine, "g2", "g1", max_seconds=60, max_bytes=200_000)
    bounded.start()
    try:
        _until(lambda: not bounded.running, "a flow ends by itself at its byte bound", timeout_s=5)
    finally:
        bounded.stop()
    with pytest.raises(ValueError, match="two different groups"):
        CrossTraffic(mine, "g1", "g1", max_seconds=1)


def test_a_flow_that_ends_before_its_episode_is_started_again(
    new_cloud: Callable[[], str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cloud = new_cloud()
    layout = build(cloud, {"h1": "g1", "h2": "g2"}, uplink_mbit=UPLINK_MBIT)
    monkeypatch.setattr(episodes, "FLOW_SEGMENT_S", 1.0)  # an open-ended episode is played as flows of 1 s
    monkeypatch.setattr(episodes, "RETRY_AFTER_S", 0.5)
    scenario = Scenario(congestion=(CongestionEpisode(groups=("g2", "g1"), start=0, slowdown=2),))
    player = EpisodePlayer(layout, scenario, start=datetime.now(UTC))
    caplog.set_level(logging.INFO, logger=episodes.__name__)
    with playing(player):
        _until(lambda: "ended, the episode still on; starting another" in caplog.text, "a second flow")
        _until(lambda: player.active.flows == (("g2", "g1"),), "the second flow runs")
    assert _flow_pids(cloud) == []


def test_the_testbed_only_episodes_parse_and_name_their_fields() -> None:
    scenario = parse_scenario({
        "link_rates": [{"group": "g1", "start": "1s", "duration": "500ms", "mbit": 10}],
        "partitions": [{"host": "h1", "at": 2}],
    })
    assert scenario.link_rates == (LinkRateEpisode(group="g1", start=1.0, duration=0.5, mbit=10.0),)
    assert scenario.partitions == (PartitionEpisode(host="h1", at=2.0, duration=None),)
    with pytest.raises(ScenarioError) as bad:
        parse_scenario({
            "link_rates": [{"group": "g1", "start": 0, "mbit": 0}],
            "partitions": [{"host": "H 1", "at": 0}],
        })
    assert bad.value.fields == ["link_rates[0].mbit", "partitions[0].host"]


def test_a_congestion_episodes_slowdown_sets_how_many_flows_share_the_uplink() -> None:
    """Fair sharing leaves a new flow 1/(n+1) of a link n saturating flows cross: slowdown s is s - 1 flows."""
    assert [episodes.flows_for(s) for s in (1.0, 2.0, 3.0, 4.0, 100.0)] == [1, 1, 2, 3, episodes.MAX_FLOWS]
