"""Congestion measured from the uplinks' counters: the model on scripted counters (a saturated FIFO with a standing
queue is congested; a busy link without one, with a transient one, with one left by a congested end upstream, or a
queue at low load is not; `since` is kept while congested; counters that go backwards restart the history; a failed
read raises), then on real namespaces (an idle link and a flow at 30 % of the link are not congested, a bulk flow
from another tenant's machine is, within 2 s), and the testbed source: the layout's group, the links' rates at
scale, measured congestion instead of scripted.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from harmonaize.events import BandwidthClass, CongestionLevel
from provider_agents.projection import bandwidth_class, congestion_level
from provider_agents.telemetry.model import LinkCongestion
from provider_agents.telemetry.scenario import Scenario
from provider_agents.telemetry.simulated import SimulatedHost
from provider_agents.testbed import commands as testbed_commands
from provider_agents.testbed import layout as testbed_layout
from provider_agents.testbed import source as testbed_source
from provider_agents.testbed.links import LinkCounters, shape
from provider_agents.testbed.monitor import CLEAR_AFTER_S, UplinkMonitor, queueing_slowdown
from provider_agents.testbed.netns import build
from tests.testbed.traffic import SINK, in_namespace

pytestmark = pytest.mark.timeout(180)

T0 = datetime(2025, 1, 1, tzinfo=UTC)
UPLINK_MBIT = 40.0
RATE_BPS = UPLINK_MBIT * 1e6
HOSTS = {"h1": "g1", "h2": "g1", "h3": "g2", "h4": "g2"}
TICK_S = 0.5
POLL_S = 0.1

Links = tuple[LinkCongestion, ...]


class FakeFabric:
    """Scripted qdisc counters of every uplink end, on a clock the test moves: `load` sets what an end does per
    second, `tick` lets time pass."""

    def __init__(self, layout: testbed_layout.TestbedLayout) -> None:
        self.layout = layout
        self.t = 100.0
        self.reads = 0
        self.counters = {
            end: LinkCounters(0, 0, 0, 0, 0, RATE_BPS) for group in layout.groups for end in layout.uplink(group)
        }
        self.loads: dict[str, tuple[float, int, int]] = {}

    def load(self, end: str, rho: float, *, drops_per_s: int = 0, backlog: int = 0) -> None:
        self.loads[end] = (rho, drops_per_s, backlog)

    def tick(self, seconds: float = TICK_S) -> None:
        self.t += seconds
        for end, (rho, drops_per_s, backlog) in self.loads.items():
            c = self.counters[end]
            sent = int(rho * c.rate_bps / 8 * seconds)
            self.counters[end] = replace(
                c,
                bytes_sent=c.bytes_sent + sent,
                packets_sent=c.packets_sent + sent // 1500,
                drops=c.drops + int(drops_per_s * seconds),
                overlimits=c.overlimits + (sent // 1500 if rho > 0.5 else 0),
                backlog_bytes=backlog,
            )

    def read(self) -> dict[str, LinkCounters]:
        self.reads += 1
        return dict(self.counters)

    def clock(self) -> float:
        return self.t

    def now(self) -> datetime:
        return T0 + timedelta(seconds=self.t)

    def monitor(self, group: str = "g1", *, clear_after_s: float = 0.0) -> UplinkMonitor:
        """Without a hold by default: these tests look at each verdict; the hold has its own."""
        return UplinkMonitor(
            self.layout, group, clear_after_s=clear_after_s, clock=self.clock, now=self.now, read=self.read
        )


def _layout(hosts: dict[str, str]) -> testbed_layout.TestbedLayout:
    return testbed_layout.TestbedLayout.build("0123456789ab", hosts, uplink_mbit=UPLINK_MBIT)


@pytest.fixture
def fabric() -> FakeFabric:
    return FakeFabric(_layout({"h1": "g1", "h2": "g2"}))


def test_a_saturated_link_with_a_queue_is_congested_and_reads_severe(fabric: FakeFabric) -> None:
    monitor = fabric.monitor()
    fabric.load("u0", 0.99, drops_per_s=40, backlog=80_000)  # g1 -> spine: a bulk flow fills the FIFO
    assert monitor.sample() == (), "the first sample has no history"
    fabric.tick()
    fabric.tick()
    (link,) = monitor.sample()
    assert (link.link, link.groups) == ("uplink-g1", ("g1", "g2"))
    assert link.utilization == pytest.approx(0.99, abs=0.01)
    assert link.slowdown == pytest.approx(queueing_slowdown(0.99)) == pytest.approx(20.0)
    assert congestion_level(link.slowdown) is CongestionLevel.SEVERE
    assert link.since == fabric.now() and link.expected_until is None
    load = monitor.loads["g1"]
    assert load.outbound.congested and not load.inbound.congested and load.span_s == pytest.approx(1.0)
    assert load.outbound.drops == 40 and load.outbound.overlimits > 0
    assert fabric.reads == 2, "one counter read per sample"


@pytest.mark.parametrize(
    ("rho", "drops_per_s", "backlog", "why"),
    [
        (0.99, 0, 0, "busy but no queue: shaped upstream, it passes at full rate"),
        (0.43, 30, 20_000, "a job's own bursty all-reduces: short queues at a low average"),
        (0.79, 10, 5_000, "just under the utilisation threshold"),
        (0.0, 0, 0, "idle"),
    ],
)
def test_a_link_is_congested_only_at_capacity_with_a_standing_queue(
    fabric: FakeFabric, rho: float, drops_per_s: int, backlog: int, why: str
) -> None:
    monitor = fabric.monitor()
    fabric.load("u0", rho, drops_per_s=drops_per_s, backlog=backlog)
    fabric.load("s0", rho, drops_per_s=drops_per_s, backlog=backlog)
    for _ in range(6):
        assert monitor.sample() == (), why
        fabric.tick()
    assert monitor.loads["g1"].utilization == pytest.approx(rho, abs=0.01)


def test_a_queue_that_stands_through_the_window_is_enough_without_drops(fabric: FakeFabric) -> None:
    monitor = fabric.monitor()
    monitor.sample()
    fabric.load("s0", 0.85, backlog=3000)  # spine -> g1: a queue that holds without overflowing
    fabric.tick()
    fabric.tick()
    (link,) = monitor.sample()
    assert link.slowdown == pytest.approx(1 / 0.15) and congestion_level(link.slowdown) is CongestionLevel.SEVERE
    assert monitor.loads["g1"].inbound.standing_backlog_bytes == 3000


def test_a_transient_queue_at_full_rate_is_not_congestion(fabric: FakeFabric) -> None:
    """The far end of a path shaped upstream: full rate, a packet or two queued now and then, never a drop. At the
    testbed agents' tick (0.25 s) a window holds four samples, and a queue that drains at one of them is transient."""
    monitor = fabric.monitor()
    for tick in range(28):
        fabric.load("s1", 0.95, backlog=3028 if tick % 3 else 0)
        fabric.tick(0.25)
        links = monitor.sample()
        assert tick < 4 or links == (), f"at {tick}: a full window of history holds a drained queue"
    assert monitor.loads["g2"].inbound.utilization == pytest.approx(0.95, abs=0.01)


def test_a_queue_standing_downstream_of_a_congested_end_is_not_its_own_congestion(fabric: FakeFabric) -> None:
    """A bulk flow g1 -> g2 on a busy machine: g1's end towards the spine is the bottleneck; the end into g2, at the
    same rate, holds the burst a late bucket released and never drains it while the flow lasts. Only g1's uplink is
    congested, from both groups' side."""
    monitors = {group: fabric.monitor(group) for group in ("g1", "g2")}
    fabric.load("u0", 0.99, drops_per_s=10, backlog=60_000)
    fabric.load("s1", 0.99, backlog=20_000)
    for monitor in monitors.values():
        monitor.sample()
    fabric.tick(1.0)
    seen = {group: monitor.sample() for group, monitor in monitors.items()}
    assert [(link.link, link.groups) for link in seen["g1"]] == [("uplink-g1", ("g1", "g2"))]
    assert [(link.link, link.groups) for link in seen["g2"]] == [("uplink-g1", ("g2", "g1"))]
    inbound = monitors["g2"].loads["g2"].inbound
    assert inbound.shaped_upstream and inbound.standing_backlog_bytes == 20_000 and not inbound.congested

    fabric.counters["s1"] = replace(fabric.counters["s1"], rate_bps=RATE_BPS / 2)  # g2's end lowered: its own queue
    fabric.load("s1", 0.99, drops_per_s=10, backlog=40_000)
    monitors["g2"].sample()
    fabric.tick(1.0)
    links = monitors["g2"].sample()
    assert [(link.link, link.groups) for link in links] == [("uplink-g2", ("g2", "g1")), ("uplink-g1", ("g2", "g1"))]
    assert not monitors["g2"].loads["g2"].inbound.shaped_upstream


@pytest.mark.parametrize(
    ("g1_out", "g3_out", "why"),
    [
        ((0.5, 0), (0.5, 0), "two uncongested flows meet in g2's end: it is where they queue"),
        ((0.99, 60_000), (0.1, 0), "a congested flow and a tenth more: more than g2's end can pass"),
    ],
)
def test_an_end_fed_beyond_its_rate_is_congested_whatever_is_upstream(
    g1_out: tuple[float, int], g3_out: tuple[float, int], why: str
) -> None:
    fabric = FakeFabric(_layout({"h1": "g1", "h2": "g2", "h3": "g3"}))
    monitor = fabric.monitor("g2")
    fabric.load("u0", g1_out[0], backlog=g1_out[1])
    fabric.load("u2", g3_out[0], backlog=g3_out[1])
    fabric.load("s1", 0.99, drops_per_s=10, backlog=30_000)
    monitor.sample()
    fabric.tick(1.0)
    links = monitor.sample()
    assert ("uplink-g2", ("g2", "g1")) in [(link.link, link.groups) for link in links], why
    assert monitor.loads["g2"].inbound.congested and not monitor.loads["g2"].inbound.shaped_upstream


def test_since_is_kept_while_congested_and_reset_when_it_clears(fabric: FakeFabric) -> None:
    monitor = fabric.monitor()
    for _ in range(3):
        fabric.tick()
        monitor.sample()
    fabric.load("u0", 1.0, drops_per_s=50, backlog=100_000)
    fabric.tick()
    assert monitor.sample() == (), "half of the window at capacity is not 0.8 of it"
    fabric.tick()
    (first,) = monitor.sample()
    began = fabric.now()
    assert first.since == began
    for _ in range(4):
        fabric.tick()
        (link,) = monitor.sample()
        assert link.since == began
    fabric.load("u0", 0.0)
    fabric.tick()
    assert monitor.sample() == (), "half a window idle: under 0.8 and the queue is gone"
    fabric.load("u0", 1.0, drops_per_s=50, backlog=100_000)
    fabric.tick()
    fabric.tick()
    (again,) = monitor.sample()
    assert again.since == fabric.now() > began


def test_the_window_forgets_old_samples_and_a_too_soon_sample_keeps_the_verdict(fabric: FakeFabric) -> None:
    monitor = fabric.monitor()
    fabric.load("u0", 1.0, drops_per_s=50, backlog=100_000)
    for _ in range(10):  # five seconds saturated
        monitor.sample()
        fabric.tick()
    assert monitor.sample()
    fabric.tick(0.05)
    assert monitor.sample(), "50 ms after the last sample: too little to measure, the verdict stands"
    fabric.load("u0", 0.0)
    fabric.tick(1.0)
    assert monitor.sample() == (), "one window idle: the busy seconds before it are forgotten"


def test_counters_that_go_backwards_or_a_changed_rate_restart_the_history(fabric: FakeFabric) -> None:
    monitor = fabric.monitor()
    fabric.load("u0", 1.0, drops_per_s=50, backlog=100_000)
    monitor.sample()
    fabric.tick(1.0)
    (link,) = monitor.sample()
    fabric.counters["u0"] = LinkCounters(0, 0, 0, 0, 100_000, RATE_BPS)  # the qdisc was replaced: counts from zero
    assert monitor.sample() == (link,), "no history since the restart: the verdict stands, no negative rate"
    fabric.tick(1.0)
    (after,) = monitor.sample()
    assert after.since == link.since and monitor.loads["g1"].outbound.utilization == pytest.approx(1.0)

    fabric.counters["u0"] = replace(fabric.counters["u0"], rate_bps=RATE_BPS / 4)  # lowered in place
    fabric.load("u0", 0.3)
    monitor.sample()
    assert monitor.rate_bps() == RATE_BPS / 4
    fabric.tick(1.0)
    assert monitor.sample() == ()
    assert monitor.loads["g1"].outbound.utilization == pytest.approx(0.3, abs=0.01), "at the new rate, not the old"


def test_another_groups_uplink_is_reported_for_the_path_both_groups_share() -> None:
    fabric = FakeFabric(_layout({"h1": "g1", "h2": "g2", "h3": "g3"}))
    monitors = {group: fabric.monitor(group) for group in ("g1", "g2", "g3")}
    _, spine_end = fabric.layout.uplink("g3")
    fabric.load(spine_end, 1.0, drops_per_s=20, backlog=50_000)  # into g3: congested
    for monitor in monitors.values():
        monitor.sample()
    fabric.tick(1.0)
    seen = {group: monitor.sample() for group, monitor in monitors.items()}
    assert [(link.link, link.groups) for link in seen["g1"]] == [("uplink-g3", ("g1", "g3"))]
    assert [(link.link, link.groups) for link in seen["g2"]] == [("uplink-g3", ("g2", "g3"))]
    assert [(link.link, link.groups) for link in seen["g3"]] == [
        ("uplink-g3", ("g3", "g1")),
        ("uplink-g3", ("g3", "g2")),
    ]
    assert fabric.reads == 6, "every uplink from one read per sample"


def test_a_failed_read_raises_testbed_error(fabric: FakeFabric) -> None:
    def garbled() -> dict[str, LinkCounters]:
        raise ValueError("Expecting value: line 1 column 1")

    def failed() -> dict[str, LinkCounters]:
        raise testbed_commands.TestbedError("`tc -n x -s -j qdisc show` failed: Cannot open network namespace")

    layout = fabric.layout
    with pytest.raises(testbed_commands.TestbedError, match="could not be read"):
        UplinkMonitor(layout, "g1", read=garbled).sample()
    with pytest.raises(testbed_commands.TestbedError, match="Cannot open"):
        UplinkMonitor(layout, "g1", read=failed).sample()
    del fabric.counters["s1"]
    with pytest.raises(testbed_commands.TestbedError, match="s1 of group g2 has no qdisc"):
        fabric.monitor().sample()
    with pytest.raises(ValueError, match="no locality group"):
        UplinkMonitor(layout, "g9")


def test_one_group_has_no_uplink_to_read() -> None:
    fabric = FakeFabric(_layout({"h1": "g1", "h2": "g1"}))
    monitor = fabric.monitor()
    assert monitor.sample() == monitor.sample() == () and fabric.reads == 0
    assert monitor.rate_bps() is None


def test_a_congested_link_clears_only_after_it_stayed_clear_for_the_hold(fabric: FakeFabric) -> None:
    """Flows sharing a link back off together now and then: a moment's drain must not read as the end of it."""
    monitor = fabric.monitor(clear_after_s=3.0)
    monitor.sample()
    fabric.load("u0", 1.0, backlog=60_000)
    for _ in range(3):
        fabric.tick()
        (held,) = monitor.sample()
    fabric.load("u0", 0.3)
    for _ in range(5):  # 2.5 s measured clear: still reported, as last measured
        fabric.tick()
        (link,) = monitor.sample()
        assert (link.since, link.slowdown) == (held.since, held.slowdown)
    fabric.load("u0", 1.0, backlog=60_000)  # back before the hold ran out: the same episode
    fabric.tick()
    fabric.tick()
    (link,) = monitor.sample()
    assert link.since == held.since
    fabric.load("u0", 0.0)
    for _ in range(6):
        fabric.tick()
        monitor.sample()
    fabric.tick()
    assert monitor.sample() == (), "3 s measured clear: the congestion is over"


def test_the_source_keeps_the_simulation_and_replaces_the_network(fabric: FakeFabric) -> None:
    scripted = Scenario.model_validate(
        {"congestion": [{"groups": ["default"], "link": "leaf-x", "start": 0, "slowdown": 3.0}]}
    )
    inner = SimulatedHost("h2", scenario=scripted, start=T0)
    source = testbed_source.TestbedSource(inner, fabric.layout, monitor=fabric.monitor("g2"))
    assert (source.host, source.locality_group) == ("h2", "g2")
    first = source.sample()
    assert first.locality_group == "g2" and first.links == (), "scripted congestion is dropped"
    assert len(first.gpus) == 8 and first.carbon is not None
    assert first.fabric.inter_group_gbps == UPLINK_MBIT, "40 Mbit/s of the testbed stands for 40 Gbit/s"
    source.inject(Scenario.model_validate({"failures": [{"host": "h2", "at": 0, "kind": "gpu_error", "gpu": 1}]}))
    fabric.load("s0", 1.0, drops_per_s=20, backlog=50_000)
    fabric.tick(1.0)
    second = source.sample()
    assert [f.gpu_index for f in second.failures] == [1], "injections reach the simulated host"
    assert [(link.link, link.groups) for link in second.links] == [("uplink-g1", ("g2", "g1"))]
    assert fabric.reads == 2, "one counter read per sample"
    with pytest.raises(ValueError, match="not in the testbed"):
        testbed_source.TestbedSource(SimulatedHost("h9"), fabric.layout)


# Real namespaces from here on: flows between the groups' neighbours cross the shaped uplinks.

PACED_SOURCE = r"""
import socket, sys, time
address, port, size, mbit, limit_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), \
    float(sys.argv[5])
block = b"x" * 16384
start = time.monotonic()
with socket.create_connection((address, port), timeout=20) as conn:
    print("sending", flush=True)
    sent = 0
    while sent < size and time.monotonic() - start < limit_s:
        n = min(len(block), size - sent)
        conn.sendall(block[:n])
        sent += n
        ahead = sent * 8 / (mbit * 1e6) - (time.monotonic() - start) if mbit > 0 else 0.0
        if ahead > 0:
            time.sleep(ahead)
"""


@contextmanager
def _flow(
    layout: testbed_layout.TestbedLayout, *, size: int, mbit: float = 0.0, limit_s: float = 10.0, port: int = 5301
) -> Iterator[float]:
    """A TCP flow from g1's neighbour to g2's, `size` bytes and `limit_s` seconds at most, paced to `mbit` (0: as
    fast as the link lets it); yields when it started (connected, monotonic) and stops it on leaving."""
    n1, n2 = layout.neighbour("g1"), layout.neighbour("g2")
    sink = subprocess.Popen(
        in_namespace(n2.namespace, SINK, n2.data_address, str(port), str(size)), stdout=subprocess.PIPE, text=True
    )
    sender: subprocess.Popen[str] | None = None
    try:
        assert sink.stdout is not None and sink.stdout.readline().strip() == "listening"
        args = (n2.data_address, str(port), str(size), str(mbit), str(limit_s))
        sender = subprocess.Popen(in_namespace(n1.namespace, PACED_SOURCE, *args), stdout=subprocess.PIPE, text=True)
        assert sender.stdout is not None and sender.stdout.readline().strip() == "sending"
        yield time.monotonic()
    finally:
        for process in (sender, sink):
            if process is not None and process.poll() is None:
                process.kill()
            if process is not None:
                process.wait(timeout=10)


def _poll(monitor: UplinkMonitor, until: Callable[[Links], bool], *, deadline: float) -> Links | None:
    """Sample every `POLL_S` until `until` holds (those links) or `deadline` (monotonic) passes (None)."""
    while True:
        links = monitor.sample()
        if until(links):
            return links
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)


def _peak_utilization(monitor: UplinkMonitor, seconds: float) -> tuple[float, Links | None]:
    """Watch `monitor` for `seconds`: the highest utilisation of g1's uplink it measured, and the first congestion."""
    peak = 0.0

    def congested(links: Links) -> bool:
        nonlocal peak
        if "g1" in monitor.loads:
            peak = max(peak, monitor.loads["g1"].utilization)
        return bool(links)

    seen = _poll(monitor, congested, deadline=time.monotonic() + seconds)
    return peak, seen


def test_an_idle_link_and_a_flow_at_a_third_of_the_rate_are_not_congested(new_cloud: Callable[[], str]) -> None:
    layout = build(new_cloud(), HOSTS, uplink_mbit=UPLINK_MBIT)
    monitor = UplinkMonitor(layout, "g1")
    idle, congestion = _peak_utilization(monitor, 1.5)
    assert congestion is None and idle < 0.05, f"idle: utilisation {idle:.3f}"

    paced_mbit = 0.3 * UPLINK_MBIT
    with _flow(layout, size=int(paced_mbit * 1e6 / 8 * 3), mbit=paced_mbit, limit_s=4):
        busy, congestion = _peak_utilization(monitor, 2.5)
    assert congestion is None, f"a flow at 30 % of the link: {congestion}"
    assert 0.2 < busy < 0.5, f"the paced flow measured at utilisation {busy:.2f}"


def test_a_bulk_flow_from_another_tenant_congests_the_uplink_within_two_seconds(
    new_cloud: Callable[[], str],
) -> None:
    layout = build(new_cloud(), HOSTS, uplink_mbit=UPLINK_MBIT)
    g1, g2 = UplinkMonitor(layout, "g1"), UplinkMonitor(layout, "g2")
    assert g2.sample() == ()
    idle, congestion = _peak_utilization(g1, 1.2)  # a full window of history, as an agent's monitor has
    assert congestion is None and idle < 0.05
    with _flow(layout, size=int(RATE_BPS / 8 * 6), limit_s=8) as started:
        seen = _poll(g1, lambda links: any(link.slowdown >= 1.75 for link in links), deadline=started + 2.0)
        assert seen is not None, f"no congestion 2 s into a bulk flow: {g1.loads}"
        assert len(seen) == 1, (seen, g1.loads)
        (link,) = seen
        assert (link.link, link.groups) == ("uplink-g1", ("g1", "g2")) and link.utilization >= 0.8
        assert congestion_level(link.slowdown) is CongestionLevel.SEVERE
        load = g1.loads["g1"]
        assert load.outbound.congested, "the queue is where the flow enters the shaped link: g1 towards the spine"
        assert not load.inbound.congested
        assert not g1.loads["g2"].congested, "into g2 at full rate but shaped upstream: its queue is g1's"
        # g2's last sample is from before the flow: its window needs one window's length of samples to move past it
        shared = _poll(g2, bool, deadline=time.monotonic() + g2.window_s + 2.0)
        assert shared is not None and [(seen.link, seen.groups) for seen in shared] == [("uplink-g1", ("g2", "g1"))]
    # The queue may still hold the flow's tail at the first sample after it; from the last congested sample the
    # link is reported clear after CLEAR_AFTER_S, so the deadline is that plus a window and a busy machine's slack.
    cleared = _poll(g1, lambda links: links == (), deadline=time.monotonic() + CLEAR_AFTER_S + 3.0)
    assert cleared == (), f"the flow is over: the congestion clears {CLEAR_AFTER_S} s after it drained: {g1.loads}"
    assert g1.sample() == () and not g1.loads["g1"].congested


def test_the_source_reads_the_group_and_the_links_rates_at_scale(new_cloud: Callable[[], str]) -> None:
    layout = build(new_cloud(), HOSTS, uplink_mbit=UPLINK_MBIT)
    source = testbed_source.TestbedSource(SimulatedHost("h3"), layout)
    sample = source.sample()
    assert (sample.host, sample.locality_group, sample.links) == ("h3", "g2", ())
    assert sample.fabric.inter_group_gbps == pytest.approx(UPLINK_MBIT)
    assert bandwidth_class(sample.fabric.inter_group_gbps) is BandwidthClass.MEDIUM
    assert sample.fabric.intra_group_gbps == 10_000.0, "a veth's nominal 10000 Mbit/s"
    assert bandwidth_class(sample.fabric.intra_group_gbps) is BandwidthClass.VERY_HIGH

    group_end, spine_end = layout.uplink("g2")
    shape(layout.fabric, spine_end, 20.0)  # a scenario lowering the link into g2
    assert source.sample().fabric.inter_group_gbps == pytest.approx(20.0), "the bottleneck end's rate"
    shape(layout.fabric, spine_end, UPLINK_MBIT)

    probe = (
        "import sys\n"
        "from provider_agents.telemetry.simulated import SimulatedHost\n"
        "from provider_agents.testbed import layout, source\n"
        "tb = layout.TestbedLayout.from_json(sys.stdin.read())\n"
        "host = tb.host('h3')\n"
        "print(source._in_namespace(host.namespace), source._own_sysfs_speed('data').strip())\n"
        "print(source.TestbedSource(SimulatedHost('h3'), tb).sample().fabric.model_dump_json())\n"
    )
    inside = subprocess.run(
        in_namespace(layout.host("h3").namespace, probe), input=layout.to_json(), capture_output=True, text=True,
        timeout=60, check=True,
    )
    where, fabric = inside.stdout.splitlines()
    assert where == "True 10000", "inside the host's namespace the speed comes from its own /sys"
    assert fabric == sample.fabric.model_dump_json()
