"""The testbed's shaped links: a token bucket (`tbf`) on each end of a group's uplink, and what its counters say.

`tbf` shapes bandwidth on these kernels (`netem`, delay injection, is not available, and not needed: the question is
whether a job's traffic fits through the link). The bucket holds a few milliseconds at the rate, so a burst passes at
line speed only that long; the queue holds 20 ms of traffic before the kernel drops, so a saturated link shows both
a backlog and drops, which is what the agent reads (`counters`) to tell a congested link from a busy one.

Every data-plane endpoint's route says which TCP congestion control its connections use (`data_route`): CUBIC, the
kernel's own default, whatever the machine running the testbed picked. A testbed that inherits the machine's choice
measures the machine: under BBR, which paces at the delivery rate it last saw, a job's flow that sends a burst through
the bucket at the veth's line speed estimates hundreds of Mbit/s on a 50 Mbit/s link, and its next all-reduce loses
a sixth of its bytes to the 20 ms queue (seen here: 16 % of the cross-group bytes retransmitted, steps of several
seconds); under CUBIC the same trial retransmits about 1 %, and the bulk flows and the job share the link as TCP does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from provider_agents.testbed.commands import run

__all__ = ["CONGESTION_CONTROL", "LinkCounters", "all_counters", "counters", "data_route", "shape"]

MTU_BYTES = 1514
QUEUE_S = 0.02
BURST_S = 0.004
CONGESTION_CONTROL = "cubic"


def _tc(namespace: str, *args: str) -> str:
    return run(["tc", "-n", namespace, *args])


def _tbf(mbit: float) -> list[str]:
    if not 0 < mbit <= 10_000:
        raise ValueError(f"a link rate must be in (0, 10000] Mbit/s, got {mbit}")
    bytes_per_s = mbit * 1e6 / 8
    burst = max(4 * MTU_BYTES, int(bytes_per_s * BURST_S))
    limit = max(2 * burst, int(bytes_per_s * QUEUE_S))
    return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "limit", str(limit)]


def shape(namespace: str, interface: str, mbit: float) -> None:
    """Shape what `interface` (in `namespace`) sends to `mbit` Mbit/s; again on a shaped link, change its rate in
    place (a scenario lowering a link, then restoring it)."""
    _tc(namespace, "qdisc", "replace", "dev", interface, "root", *_tbf(mbit))


def data_route(namespace: str, interface: str, *, network: str, source: str) -> None:
    """Route `network` over `interface` (in `namespace`) from `source`, its TCP connections under
    `CONGESTION_CONTROL` (the route's own `congctl`, so neither the machine's default nor the agents' settings
    change it)."""
    run(["ip", "-n", namespace, "route", "replace", network, "dev", interface, "src", source,
         "congctl", CONGESTION_CONTROL])


@dataclass(frozen=True)
class LinkCounters:
    """One end of a link as its qdisc counts it, since it was made: sent, dropped, queued now, and its rate."""

    bytes_sent: int
    packets_sent: int
    drops: int
    overlimits: int
    backlog_bytes: int
    rate_bps: float


def counters(namespace: str, interface: str) -> LinkCounters:
    """The root qdisc's counters of `interface` in `namespace` (`tc -s -j qdisc show`)."""
    found = _root_counters(_tc(namespace, "-s", "-j", "qdisc", "show", "dev", interface), device=interface)
    if interface not in found:
        raise ValueError(f"{interface} in {namespace} has no root qdisc")
    return found[interface]


def all_counters(namespace: str) -> dict[str, LinkCounters]:
    """Every interface's root qdisc counters in `namespace`, from one `tc` call: both ends of an uplink are read at
    the same instant, and a monitor sampling every tick costs one process, not one per interface."""
    return _root_counters(_tc(namespace, "-s", "-j", "qdisc", "show"))


def _root_counters(output: str, *, device: str | None = None) -> dict[str, LinkCounters]:
    """Root qdiscs by interface; `device`: the one asked for (tc leaves `dev` out when a command names it)."""
    found: dict[str, LinkCounters] = {}
    for entry in json.loads(output or "[]"):
        dev = entry.get("dev", device)
        if not entry.get("root") or dev is None:
            continue
        rate = float(entry.get("options", {}).get("rate", 0) or 0)
        found[str(dev)] = LinkCounters(
            bytes_sent=int(entry.get("bytes", 0)),
            packets_sent=int(entry.get("packets", 0)),
            drops=int(entry.get("drops", 0)),
            overlimits=int(entry.get("overlimits", 0)),
            backlog_bytes=int(entry.get("backlog", 0)),
            rate_bps=rate * 8 if rate else 0.0,
        )
    return found
