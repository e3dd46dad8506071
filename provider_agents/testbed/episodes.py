"""Plays a scenario's network episodes for real on the testbed: cross-traffic, uplink rates, partitioned hosts.

On loopback a scenario only changes what the simulated hosts report; on the testbed the network itself must change,
so that what the agents measure and what a job feels is the episode. The player is level-triggered: every pass
computes what should hold now (from every layer of the scenario, offsets from the layer's start, on the wall clock)
and converges to it from what it did so far. So an episode whose start passed while nothing ran still applies, a flow
that ended early (its own time or byte bound) is started again while its episode lasts, and a failed command is tried
again on a later pass. Whatever way `run` ends (stopped, cancelled, failed), everything it did is undone: flows
killed, uplinks back at the layout's rate, links up.

What the testbed cannot play is logged once and skipped: congestion inside one group (the testbed shapes only the
uplinks between groups), groups or hosts the testbed does not have. A congestion episode's `slowdown` sets how many
bulk flows cross the uplink at once (`flows_for`): a link shared fairly by n saturating flows leaves a new one 1/(n+1)
of it, so slowdown s is played as round(s) - 1 flows (at least one, at most `MAX_FLOWS`); what a job then really
loses, and what the agents measure, is whatever those flows do to it. Its `utilization` is not used.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from harmonaize.waits import wait_set
from provider_agents.telemetry.scenario import Scenario
from provider_agents.testbed.commands import TestbedError, run
from provider_agents.testbed.layout import TestbedLayout
from provider_agents.testbed.links import shape
from provider_agents.testbed.traffic import CrossTraffic

__all__ = ["ActiveEpisodes", "EpisodePlayer"]

log = logging.getLogger(__name__)

PERIOD_S = 0.1
"""How often the player converges: an episode starts or ends within this (plus a flow's start-up) of its time."""
FLOW_SEGMENT_S = 60.0
"""The longest one flow runs: a longer (or open-ended) episode is played as flows started one after another."""
MIN_FLOW_S = 0.2
"""An episode with less left than this starts no new flow."""
RETRY_AFTER_S = 1.0
"""A failed action, or a flow that ended, is tried again no sooner than this."""

MAX_FLOWS = 8
"""The most flows one congestion episode starts (each bounded in time and bytes by itself)."""

FlowKey = tuple[int, int, int]
"""(layer, index of the congestion episode in it, which of its flows)."""


@dataclass(frozen=True)
class ActiveEpisodes:
    """What the player has applied now."""

    flows: tuple[tuple[str, str], ...] = ()
    """(source group, destination group) of each cross-traffic flow running, one per congestion episode."""
    link_rates: tuple[tuple[str, float], ...] = ()
    """(group, Mbit/s) of each uplink not at the layout's rate."""
    partitioned: tuple[str, ...] = ()
    """Hosts whose links are down."""

    @property
    def idle(self) -> bool:
        return not (self.flows or self.link_rates or self.partitioned)


@dataclass(frozen=True)
class _Wanted:
    flows: dict[FlowKey, tuple[str, str, datetime | None]]
    """key -> (source group, destination group, end or None)."""
    rates: dict[str, float]
    partitioned: frozenset[str]


class EpisodePlayer:
    """Plays `scenario` (offsets from `start`, or from the scenario's own `start` when it pins one) and any injected
    later on `layout`'s testbed, while `run` runs."""

    def __init__(self, layout: TestbedLayout, scenario: Scenario, *, start: datetime) -> None:
        self.layout = layout
        self._layers: list[tuple[Scenario, datetime]] = []
        self.inject(scenario, at=scenario.start or start)
        self._lock = threading.Lock()
        """Held by a pass and by `undo`: one at a time, and undo after a pass still running in its thread."""
        self._flows: dict[FlowKey, CrossTraffic] = {}
        self._rates: dict[str, float] = {}
        """Groups whose uplink this player set away from the layout's rate."""
        self._down: set[str] = set()
        self._retry_at: dict[str, float] = {}
        """Action -> monotonic time before which it is not tried again."""
        self._told: set[str] = set()
        self._active = ActiveEpisodes()

    def inject(self, scenario: Scenario, *, at: datetime) -> None:
        """Play `scenario` too, its offsets counted from `at`, on top of what plays already (`SimulatedHost.inject`)."""
        if at.tzinfo is None:
            raise ValueError("an episode layer needs an aware start time")
        self._layers.append((scenario, at.astimezone(UTC)))

    @property
    def active(self) -> ActiveEpisodes:
        """What is applied now, as of the last pass (or `undo`)."""
        return self._active

    async def run(self, stop: asyncio.Event) -> None:
        """Converge every `PERIOD_S` until `stop` is set; then, or on any other exit, undo everything."""
        try:
            while not stop.is_set():
                await asyncio.to_thread(self.converge)
                await wait_set(stop, PERIOD_S)
        finally:
            # shielded: a second cancellation leaves the undo running in its thread rather than half done
            await asyncio.shield(asyncio.to_thread(self.undo))

    def converge(self, now: datetime | None = None) -> None:
        """One pass (blocking): start, stop and change whatever differs from what should hold at `now`."""
        now = now or datetime.now(UTC)
        with self._lock:
            self._converge(self._wanted(now), now)
            self._publish()

    def undo(self) -> None:
        """Kill every flow of this player, restore every uplink it changed, bring up every link it took down.
        Blocking, idempotent."""
        with self._lock:
            for key, flow in sorted(self._flows.items()):
                flow.stop()
                self._say(f"stopped cross-traffic {flow.src_group}->{flow.dst_group} ({_name(key)})")
            self._flows.clear()
            for group in sorted(self._rates):
                self._set_rate(group, self.layout.uplink_mbit, force=True)
            for host in sorted(self._down):
                self._set_links(host, up=True, force=True)
            self._retry_at.clear()
            self._publish()

    # what should hold

    def _wanted(self, now: datetime) -> _Wanted:
        flows: dict[FlowKey, tuple[str, str, datetime | None]] = {}
        rates: dict[str, float] = {}
        partitioned: set[str] = set()
        for layer, (scenario, start) in enumerate(tuple(self._layers)):
            for index, congestion in enumerate(scenario.congestion):
                on, end = _window(start, congestion.start, congestion.duration, now)
                if not on:
                    continue
                where = f"congestion[{index}] of layer {layer}"
                if len(congestion.groups) == 1:
                    self._tell_once(f"{where}: inside group {congestion.groups[0]}, and intra-group links are not "
                                    "shaped in the testbed; skipped")
                    continue
                src, dst = congestion.groups
                if missing := [g for g in (src, dst) if g not in self.layout.groups]:
                    self._tell_once(f"{where}: the testbed has no group {', '.join(missing)}; skipped")
                    continue
                for flow in range(flows_for(congestion.slowdown)):
                    flows[(layer, index, flow)] = (src, dst, end)
            for index, episode in enumerate(scenario.link_rates):
                if not _window(start, episode.start, episode.duration, now)[0]:
                    continue
                where = f"link_rates[{index}] of layer {layer}"
                if episode.group not in self.layout.groups:
                    self._tell_once(f"{where}: the testbed has no group {episode.group}; skipped")
                elif len(self.layout.groups) < 2:
                    self._tell_once(f"{where}: a testbed of one group has no uplinks; skipped")
                else:  # overlapping episodes on one uplink: the slowest rate holds
                    rates[episode.group] = min(episode.mbit, rates.get(episode.group, episode.mbit))
            for index, partition in enumerate(scenario.partitions):
                if not _window(start, partition.at, partition.duration, now)[0]:
                    continue
                if partition.host not in {host.name for host in self.layout.hosts}:
                    self._tell_once(f"partitions[{index}] of layer {layer}: the testbed has no host "
                                    f"{partition.host}; skipped")
                    continue
                partitioned.add(partition.host)
        return _Wanted(flows=flows, rates=rates, partitioned=frozenset(partitioned))

    # converging

    def _converge(self, wanted: _Wanted, now: datetime) -> None:
        # links and rates first: a flow started in this pass sizes its byte bound from the rate it will meet
        for group in sorted(set(self._rates) | set(wanted.rates)):
            self._set_rate(group, wanted.rates.get(group, self.layout.uplink_mbit))
        for host in sorted(self._down - wanted.partitioned):
            self._set_links(host, up=True)
        for host in sorted(wanted.partitioned - self._down):
            self._set_links(host, up=False)
        for key in sorted(set(self._flows) - set(wanted.flows)):
            flow = self._flows.pop(key)
            flow.stop()
            self._say(f"stopped cross-traffic {flow.src_group}->{flow.dst_group}: {_name(key)} is over")
        for key, (src, dst, end) in sorted(wanted.flows.items()):
            flow_or_none = self._flows.get(key)
            if flow_or_none is not None and flow_or_none.running:
                continue
            left = FLOW_SEGMENT_S if end is None else min(FLOW_SEGMENT_S, (end - now).total_seconds())
            if left < MIN_FLOW_S:
                continue
            action = f"flow {key}"
            if not self._due(action):
                continue
            if flow_or_none is not None:
                flow_or_none.stop()  # reaps the ended processes
                del self._flows[key]
                self._say(f"cross-traffic {src}->{dst} of {_name(key)} ended, the episode still on; starting another")
            flow = CrossTraffic(self.layout, src, dst, max_seconds=left)
            self._retry_at[action] = time.monotonic() + RETRY_AFTER_S
            try:
                flow.start()
            except (TestbedError, OSError) as exc:
                self._say(f"could not start cross-traffic {src}->{dst} of {_name(key)} ({exc}); retrying", warn=True)
                continue
            self._flows[key] = flow
            self._say(f"started cross-traffic {src}->{dst} for {left:.1f} s on port {flow.port} ({_name(key)}, markers "
                      f"{flow.marker}*)")

    def _set_rate(self, group: str, mbit: float, *, force: bool = False) -> None:
        if self._rates.get(group, self.layout.uplink_mbit) == mbit:
            return
        ends = self.layout.uplink(group)

        def apply() -> None:
            for end in ends:
                shape(self.layout.fabric, end, mbit)

        if self._attempt(f"rate {group}", apply, force=force):
            if mbit == self.layout.uplink_mbit:
                self._rates.pop(group, None)
            else:
                self._rates[group] = mbit
            self._say(f"uplink of {group} ({'/'.join(ends)}) at {mbit:g} Mbit/s"
                      + (" (the layout's rate)" if mbit == self.layout.uplink_mbit else ""))

    def _set_links(self, host: str, *, up: bool, force: bool = False) -> None:
        namespace = self.layout.host(host).namespace
        state = "up" if up else "down"

        def apply() -> None:
            for interface in ("data", "mgmt"):
                run(["ip", "-n", namespace, "link", "set", interface, state])

        if self._attempt(f"links {host}", apply, force=force):
            if up:
                self._down.discard(host)
            else:
                self._down.add(host)
            self._say(f"host {host}: data and mgmt links {state}" + ("" if up else " (partitioned)"))

    def _attempt(self, action: str, apply: Callable[[], None], *, force: bool) -> bool:
        """Run `apply` unless it failed less than `RETRY_AFTER_S` ago (`force`: regardless); whether it worked."""
        if not force and not self._due(action):
            return False
        try:
            apply()
        except (TestbedError, OSError, ValueError) as exc:
            self._retry_at[action] = time.monotonic() + RETRY_AFTER_S
            self._say(f"{action} failed ({exc}); will retry", warn=True)
            return False
        self._retry_at.pop(action, None)
        return True

    def _due(self, action: str) -> bool:
        return time.monotonic() >= self._retry_at.get(action, 0.0)

    def _publish(self) -> None:
        self._active = ActiveEpisodes(
            flows=tuple((f.src_group, f.dst_group) for _, f in sorted(self._flows.items()) if f.running),
            link_rates=tuple(sorted(self._rates.items())),
            partitioned=tuple(sorted(self._down)),
        )

    def _say(self, message: str, *, warn: bool = False) -> None:
        log.log(logging.WARNING if warn else logging.INFO, "testbed %s: %s", self.layout.cloud, message)

    def _tell_once(self, message: str) -> None:
        if message not in self._told:
            self._told.add(message)
            self._say(message, warn=True)


def flows_for(slowdown: float) -> int:
    """How many saturating flows play a congestion episode of `slowdown` (fair share: a new flow gets 1/(n+1))."""
    return max(1, min(MAX_FLOWS, round(slowdown) - 1))


def _name(key: FlowKey) -> str:
    layer, index, flow = key
    return f"congestion[{index}] of layer {layer}, flow {flow + 1}"


def _window(start: datetime, offset: float, duration: float | None, now: datetime) -> tuple[bool, datetime | None]:
    """Whether an episode (at `offset` s from `start`, lasting `duration` s or forever) is on at `now`, and its end
    (None: never)."""
    begins = start + timedelta(seconds=offset)
    ends = None if duration is None else begins + timedelta(seconds=duration)
    return begins <= now and (ends is None or now < ends), ends
