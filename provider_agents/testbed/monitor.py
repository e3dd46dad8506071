"""Whether the uplinks on a locality group's paths are congested, measured from their qdisc counters: the testbed's
network monitoring, in place of a scenario's scripted congestion.

The model. Each end of an uplink is a shaped FIFO (`tbf`, `links`). A link is *congested* when it runs at capacity
with a standing queue: over the last `window_s`, in one direction, its utilisation rho = bytes / (rate * dt) is at
least 0.8, and its queue was non-empty at every sample inside the window (after the one its bytes are counted from,
up to now). Neither half alone is enough, and drops are no sign: a job's own all-reduces fill the queue in bursts,
and drop from it, at a lower average (measured: a 4-rank DDP job all-reducing 2 MB per step over a 50 Mbit/s uplink
ran at rho 0.4-0.9 per half second with drops in most of them, but its queue drains between steps; a bulk TCP flow
from another namespace holds rho at 0.99 and the queue never empties), and the far end of a path already shaped
upstream passes the flow at full rate with only a transient queue (measured at 40 Mbit/s under a bulk flow: the
bottleneck end's queue was never empty, median 33 KB; the downstream end's was empty in 76 % of samples and never
dropped, so "a backlog now" alone would flag it about one tick in four). On a busy machine that downstream queue can
stand: the upstream bucket, its timer late, releases a burst the downstream end, busy at the same rate, never
catches up with while the flow lasts. So an end into a group is not congested while its inflow is bounded upstream:
some other group's end towards the spine is congested, and those ends' rates plus what the uncongested ones sent fit
its own rate (2 % slack for a bucket's burst). The spine joins only uplinks, so that sum bounds everything that can
reach it; a flow limited at this end instead drains the congested end upstream, and the bound no longer holds.
Communication crossing a congested link waits behind its queue; the queueing (M/M/1) estimate of that factor is 1 /
(1 - rho), rho capped at 0.95, so a saturated link reads ~20 (SEVERE) and one at 0.8 reads 5. A link that is not
congested is not reported (its slowdown would be 1.0).

What a group's agents see: the path from group A to group B crosses A's uplink (`u<a>` out, `s<a>` in) and B's, all
four ends in the fabric namespace, so one `tc` call per sample reads every uplink. A congested uplink of A or of B is
reported for the pair (A, B) under the link's own name (`uplink-<group>`): both groups' hosts see congestion on a path
they share, whichever of them the projection picks to report it. `since` is the wall-clock time the link was first
seen congested, kept while it stays so and reset once it clears; it clears only after `CLEAR_AFTER_S` measured
uncongested (reporting its last congested reading meanwhile), so a moment's drain of a shared queue does not flap
the tenant's plan.

The first sample has no history and reports nothing; a sample too soon after the last one (under a quarter of the
window of history) keeps the previous verdict. Counters that go backwards, or a rate that changed (a scenario lowering
a link replaces its qdisc), restart the history rather than yield negative or mixed rates. A failed `tc` call, or an
uplink without its qdisc, raises `TestbedError`: the agent reports its source as failed for that tick.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from provider_agents.telemetry.model import LinkCongestion
from provider_agents.testbed.commands import TestbedError
from provider_agents.testbed.layout import TestbedLayout
from provider_agents.testbed.links import LinkCounters, all_counters

__all__ = [
    "CONGESTED_UTILIZATION",
    "MAX_UTILIZATION",
    "DirectionLoad",
    "UplinkLoad",
    "UplinkMonitor",
    "link_name",
    "queueing_slowdown",
]

CONGESTED_UTILIZATION = 0.8
"""A direction at or above this utilisation over the window, with a standing queue, is congested."""
MAX_UTILIZATION = 0.95
"""The queueing estimate's cap on rho: 1 / (1 - 0.95) = 20, the factor a saturated link reads."""
UPSTREAM_SLACK = 1.02
"""An inflow bounded upstream may exceed the end's rate by this factor (a bucket's burst, counter timing)."""
MIN_SPAN_FRACTION = 0.25
"""Less history than this fraction of the window measures noise: the previous verdict stands."""

CounterReader = Callable[[], Mapping[str, LinkCounters]]


def link_name(group: str) -> str:
    """The name a group's uplink is reported under (provider-internal: the projection never shows it)."""
    return f"uplink-{group}"


def queueing_slowdown(utilization: float) -> float:
    """The expected factor on communication through a FIFO at `utilization`: 1 / (1 - rho), rho capped at 0.95."""
    return 1.0 / (1.0 - min(max(utilization, 0.0), MAX_UTILIZATION))


@dataclass(frozen=True)
class DirectionLoad:
    """One end of an uplink (what it sends) over the window: utilisation, what grew in it, and the queue now."""

    interface: str
    utilization: float
    """rho = bytes / (rate * dt); slightly above 1 is possible (the bucket's burst, counter timing)."""
    drops: int
    overlimits: int
    backlog_bytes: int
    """The queue now."""
    standing_backlog_bytes: int
    """The smallest queue seen at the samples inside the window (now included): > 0 when it never drained."""
    rate_bps: float
    shaped_upstream: bool = False
    """An end into a group whose inflow is bounded by congested ends upstream: its queue is theirs, not its own."""

    @property
    def congested(self) -> bool:
        return (
            self.utilization >= CONGESTED_UTILIZATION
            and self.standing_backlog_bytes > 0
            and not self.shaped_upstream
        )


@dataclass(frozen=True)
class UplinkLoad:
    """A group's uplink over the window: towards the spine (`outbound`) and towards the group (`inbound`)."""

    group: str
    outbound: DirectionLoad
    inbound: DirectionLoad
    span_s: float

    @property
    def congested(self) -> bool:
        return self.outbound.congested or self.inbound.congested

    @property
    def utilization(self) -> float:
        """The busier direction's rho, within [0, 1] (what `LinkCongestion.utilization` holds)."""
        return min(1.0, max(self.outbound.utilization, self.inbound.utilization))

    @property
    def slowdown(self) -> float:
        """The queueing estimate from the busiest congested direction; 1.0 when neither is congested."""
        congested = [d.utilization for d in (self.outbound, self.inbound) if d.congested]
        return queueing_slowdown(max(congested)) if congested else 1.0


CLEAR_AFTER_S = 3.0
"""A congested link is reported clear only after this long measured uncongested: TCP flows sharing a link back off
together now and then, and the queue drains for a moment; a tenant that repartitions on congestion must not be sent
back and forth by it."""


def _utc_now() -> datetime:
    return datetime.now(UTC)


class UplinkMonitor:
    """Samples the fabric's uplink counters once per call and reports the congested links on `group`'s paths."""

    def __init__(
        self,
        layout: TestbedLayout,
        group: str,
        *,
        window_s: float = 1.0,
        clear_after_s: float = CLEAR_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime] = _utc_now,
        read: CounterReader | None = None,
    ) -> None:
        """`clock`: monotonic seconds, for the window; `now`: aware wall-clock time, for `since`; `read`: every
        interface's root qdisc counters in the fabric (default: one `tc -s -j qdisc show` there)."""
        if group not in layout.groups:
            raise ValueError(f"no locality group {group!r} in the testbed")
        if window_s <= 0:
            raise ValueError(f"the window must be positive, got {window_s}")
        self.layout = layout
        self.group = group
        self.window_s = window_s
        self.clear_after_s = clear_after_s
        self._clock = clock
        self._now = now
        self._read: CounterReader = read or (lambda: all_counters(layout.fabric))
        self._others = tuple(g for g in layout.groups if g != group)
        self._ends = {g: layout.uplink(g) for g in (group, *self._others)} if self._others else {}
        self._history: deque[tuple[float, dict[str, LinkCounters]]] = deque()
        self._since: dict[str, datetime] = {}
        self._last_congested: dict[str, tuple[float, UplinkLoad]] = {}
        self._reported: tuple[LinkCongestion, ...] = ()
        self.loads: dict[str, UplinkLoad] = {}
        """The last measurement of each uplink on the group's paths, by group (empty until one was made)."""
        self.latest: dict[str, LinkCounters] = {}
        """The last counters read, by fabric interface."""

    def rate_bps(self, group: str | None = None) -> float | None:
        """The bottleneck rate of `group`'s uplink (default: this group's) as last read; None before any reading."""
        ends = self._ends.get(group or self.group)
        if ends is None or any(end not in self.latest for end in ends):
            return None
        return min(self.latest[end].rate_bps for end in ends)

    def sample(self) -> tuple[LinkCongestion, ...]:
        """The congested uplinks on this group's paths now (none when nothing is congested)."""
        if not self._others:
            return ()  # one group: no uplink, nothing between groups to measure
        current = self._read_ends()
        t = self._clock()
        if self._history and _restarted(self._history[-1][1], current):
            self._history.clear()
        self._history.append((t, current))
        while len(self._history) > 1 and self._history[1][0] <= t - self.window_s:
            self._history.popleft()  # keep one sample at or before the window's start: dt >= window when possible
        base_t, _ = self._history[0]
        span = t - base_t
        if span < MIN_SPAN_FRACTION * self.window_s:
            return self._reported
        window = [counters for _, counters in self._history]
        self.loads = {
            g: UplinkLoad(
                group=g,
                outbound=_direction(ends[0], window, span),
                inbound=_direction(ends[1], window, span),
                span_s=span,
            )
            for g, ends in self._ends.items()
        }
        self.loads = _bound_upstream(self.loads)
        for g, load in self.loads.items():
            if load.congested:
                self._since.setdefault(g, self._now())
                self._last_congested[g] = (t, load)
            elif g in self._last_congested and t - self._last_congested[g][0] >= self.clear_after_s:
                self._since.pop(g, None)
                del self._last_congested[g]
        self._reported = tuple(
            LinkCongestion(
                link=link_name(g),
                groups=(self.group, other),
                utilization=self._last_congested[g][1].utilization,
                slowdown=self._last_congested[g][1].slowdown,
                since=self._since[g],
            )
            for other in self._others
            for g in (self.group, other)
            if g in self._since
        )
        return self._reported

    def _read_ends(self) -> dict[str, LinkCounters]:
        try:
            found = self._read()
        except ValueError as exc:  # unparseable output: as failed as a failed command
            raise TestbedError(f"the fabric's qdisc counters could not be read: {exc}") from exc
        wanted: dict[str, LinkCounters] = {}
        for g, ends in self._ends.items():
            for end in ends:
                if end not in found:
                    raise TestbedError(f"uplink end {end} of group {g} has no qdisc in {self.layout.fabric}")
                wanted[end] = found[end]
        self.latest = wanted
        return wanted


def _restarted(before: Mapping[str, LinkCounters], now: Mapping[str, LinkCounters]) -> bool:
    """Whether any end's counters went backwards or its rate changed since `before` (a replaced qdisc)."""
    for end, new in now.items():
        old = before.get(end)
        if old is None or new.rate_bps != old.rate_bps:
            return True
        grown = (
            (new.bytes_sent, old.bytes_sent),
            (new.packets_sent, old.packets_sent),
            (new.drops, old.drops),
            (new.overlimits, old.overlimits),
        )
        if any(n < o for n, o in grown):
            return True
    return False


def _bound_upstream(loads: dict[str, UplinkLoad]) -> dict[str, UplinkLoad]:
    """`loads` with each group's inbound end marked `shaped_upstream` where its inflow is bounded by congested ends
    of the other groups (see the module's docstring)."""
    bounded: dict[str, UplinkLoad] = {}
    for g, load in loads.items():
        feeders = [other.outbound for h, other in loads.items() if h != g]
        inflow_bound = sum(f.rate_bps if f.congested else f.utilization * f.rate_bps for f in feeders)
        upstream = any(f.congested for f in feeders) and inflow_bound <= load.inbound.rate_bps * UPSTREAM_SLACK
        bounded[g] = replace(load, inbound=replace(load.inbound, shaped_upstream=True)) if upstream else load
    return bounded


def _direction(interface: str, window: list[dict[str, LinkCounters]], span_s: float) -> DirectionLoad:
    """One end over the window's samples, oldest first."""
    before, now = window[0][interface], window[-1][interface]
    capacity = now.rate_bps / 8 * span_s
    return DirectionLoad(
        interface=interface,
        utilization=(now.bytes_sent - before.bytes_sent) / capacity if capacity > 0 else 0.0,
        drops=now.drops - before.drops,
        overlimits=now.overlimits - before.overlimits,
        backlog_bytes=now.backlog_bytes,
        standing_backlog_bytes=min(sample[interface].backlog_bytes for sample in window[1:] or window),
        rate_bps=now.rate_bps,
    )
