"""A testbed host's telemetry: the simulation's GPUs, carbon, failures and maintenance, the network measured.

On a testbed the network is real, so what it decides is read from it rather than from the scenario: the locality
group is the host's group in the layout, the fabric's bandwidths are the links' own rates, and congestion is what the
uplinks' counters show (`monitor`); the scenario's scripted congestion is dropped (its network episodes are played on
the real links instead). Everything else comes from the inner `SimulatedHost`, and injections go to it.

Scale. The testbed is a 1:1000 model of a GPU fabric: its Mbit/s stand for Gbit/s, so a 50 Mbit/s uplink reads
50 Gbps (MEDIUM) and a 10000 Mbit/s veth 10000 Gbps (VERY_HIGH), and tenants' bandwidth classes keep their meaning.

Where the numbers come from, cheaply: the inter-group bandwidth is the bottleneck tbf rate of the group's uplink, from
the same counters the monitor reads (one `tc` call per sample, nothing more); the intra-group bandwidth is the nominal
speed of the host's `data` veth, which never changes, so it is read once. The agent runs inside its host's namespace
(`ip netns exec` mounts that namespace's /sys), so `/sys/class/net/data/speed` is read directly when this process is
in the host's namespace (same nsfs inode as /run/netns/<ns>) and that sysfs is the namespace's own (its `data`
ifindex is the one the kernel gives this process); otherwise (a test, or a process that entered the namespace
without remounting /sys) through `ip netns exec <ns> cat ...`, which always mounts the right one. A speed the kernel
does not know (-1, a link down) falls back to the scenario's nominal value, and is read again after a while.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import datetime
from pathlib import Path

from provider_agents.telemetry.model import FabricSample, HostTelemetry
from provider_agents.telemetry.scenario import Scenario
from provider_agents.telemetry.simulated import SimulatedHost
from provider_agents.testbed.commands import TestbedError, run
from provider_agents.testbed.layout import TestbedLayout
from provider_agents.testbed.monitor import UplinkMonitor

__all__ = ["DATA_INTERFACE", "GBPS_PER_TESTBED_MBIT", "TestbedSource", "data_speed_mbit", "scaled_gbps"]

DATA_INTERFACE = "data"
GBPS_PER_TESTBED_MBIT = 1.0
"""The scale model: one Mbit/s of the testbed stands for one Gbit/s of a GPU fabric."""
MAX_GBPS = 100_000.0
SPEED_RETRY_S = 30.0
"""How long an unknown data speed stands before it is read again (not every tick: a sample costs one `tc` call)."""


def scaled_gbps(mbit: float) -> float:
    """What `mbit` Mbit/s of the testbed stands for, in Gbit/s, within `FabricSample`'s range."""
    return min(MAX_GBPS, max(0.0, mbit * GBPS_PER_TESTBED_MBIT))


def _in_namespace(namespace: str) -> bool:
    try:
        own, named = os.stat("/proc/self/ns/net"), os.stat(f"/run/netns/{namespace}")
    except OSError:
        return False
    return (own.st_dev, own.st_ino) == (named.st_dev, named.st_ino)


def _own_sysfs_speed(interface: str) -> str | None:
    """The speed file's text when this process's /sys shows its own namespace's `interface`; else None."""
    base = Path("/sys/class/net") / interface
    try:
        if int((base / "ifindex").read_text()) != socket.if_nametoindex(interface):
            return None
        return (base / "speed").read_text()
    except (OSError, ValueError):
        return None


def data_speed_mbit(namespace: str, interface: str = DATA_INTERFACE) -> float | None:
    """The nominal speed of `interface` in `namespace`, Mbit/s; None when the kernel does not know it."""
    text = _own_sysfs_speed(interface) if _in_namespace(namespace) else None
    if text is None:
        try:
            text = run(["ip", "netns", "exec", namespace, "cat", f"/sys/class/net/{interface}/speed"])
        except TestbedError:
            return None  # down links answer EINVAL; a missing namespace fails the uplink read anyway
    try:
        speed = float(text.strip())
    except ValueError:
        return None
    return speed if speed > 0 else None


class TestbedSource:
    """A `TelemetrySource` for a testbed host: `inner` simulates the host, `layout` is the network it sits in."""

    def __init__(self, inner: SimulatedHost, layout: TestbedLayout, *, monitor: UplinkMonitor | None = None) -> None:
        try:
            placed = layout.host(inner.host)
        except KeyError:
            raise ValueError(f"host {inner.host!r} is not in the testbed of cloud {layout.cloud}") from None
        self.inner = inner
        self.layout = layout
        self.host = inner.host
        self.locality_group = placed.group
        self.namespace = placed.namespace
        self.monitor = monitor or UplinkMonitor(layout, placed.group, now=inner.clock.now)
        self._intra_mbit: float | None = None
        self._intra_read_at: float | None = None

    def inject(self, scenario: Scenario, *, at: datetime | None = None) -> None:
        """Passes to the simulated host (its congestion episodes are played on the links, not reported from here)."""
        self.inner.inject(scenario, at=at)

    def sample(self) -> HostTelemetry:
        links = self.monitor.sample()
        simulated = self.inner.sample()
        return HostTelemetry(
            host=self.host,
            locality_group=self.locality_group,
            sampled_at=simulated.sampled_at,
            gpus=simulated.gpus,
            fabric=self._fabric(simulated.fabric),
            links=links,
            failures=simulated.failures,
            maintenance=simulated.maintenance,
            carbon=simulated.carbon,
        )

    def _fabric(self, nominal: FabricSample) -> FabricSample:
        retry = self._intra_read_at is None or time.monotonic() - self._intra_read_at >= SPEED_RETRY_S
        if self._intra_mbit is None and retry:
            self._intra_read_at = time.monotonic()
            self._intra_mbit = data_speed_mbit(self.namespace)
        inter_bps = self.monitor.rate_bps()
        inter_mbit = inter_bps / 1e6 if inter_bps else self.layout.uplink_mbit  # one group: no uplink to read
        return FabricSample(
            intra_group_gbps=scaled_gbps(self._intra_mbit) if self._intra_mbit else nominal.intra_group_gbps,
            inter_group_gbps=scaled_gbps(inter_mbit),
        )
