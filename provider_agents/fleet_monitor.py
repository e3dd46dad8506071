"""The fleet monitor: turns missing heartbeats into `host_down` failure events for the tenants on that host.

A host that dies cannot report its own death, and without this a tenant's job learns of it only through a
rendezvous or collective timeout (tens of seconds to hours). The monitor listens to every agent's heartbeat
(`hz.p.agents.<host>.heartbeat`, provider-internal) and mirrors the desired state; when a host has been silent for
`MISSED_HEARTBEATS_FOR_FAILURE` heartbeat intervals it publishes a `Failure(kind=host_down)` to every tenant job the
desired state places there, under that tenant's pseudonym for the host (`projection.host_down`), through the same
acknowledged publisher the agents use.

Once per outage: the monitor remembers which tenant jobs it told about the current outage, so it does not repeat
itself every check, but a job placed on the dead host later is still told (level-triggered on the desired state).
When heartbeats resume the outage is over and the memory is cleared; the contract has no "recovered" event, so the
recovery is only logged (a returning host shows up to tenants through the control plane placing work on it again).

A silent host is declared down sooner, after `MISSED_HEARTBEATS_WHILE_PEERS_WAIT` intervals, when a job placed on it
has workers on another, beating host that stand still waiting on a peer (`Heartbeat.waiting`): a frozen or dead host
blocks its jobs' collectives at once, while an agent that is merely restarting blocks nothing (its nodes run on), so
only the full window covers that case. Both sides must be fresh, and the monitor must not itself have stalled (after
a stall of its own every host looks silent until the queued heartbeats are read).

Liveness is measured on the monitor's monotonic clock at receipt, not from the timestamps agents write, so clock
skew between hosts cannot fake or hide an outage. A host the desired state lists but that has never sent a heartbeat
is given the same grace period from the moment the monitor first sees it, then reported: that covers a host that
died while the monitor itself was restarting (a restarted monitor may repeat an outage report, a state re-assertion).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Protocol

from nats.aio.client import Client
from nats.aio.msg import Msg
from pydantic import ValidationError

from harmonaize.desired_state import (
    HEARTBEAT_INTERVAL_S,
    MISSED_HEARTBEATS_FOR_FAILURE,
    MISSED_HEARTBEATS_WHILE_PEERS_WAIT,
    Heartbeat,
)
from harmonaize.subjects import ANY, provider_filter
from harmonaize.waits import wait_set
from provider_agents.clock import Clock, SystemClock
from provider_agents.desired import DesiredState
from provider_agents.projection import TenantEvent, host_down
from provider_agents.publisher import EventSink

__all__ = ["HEARTBEAT_FILTER", "FleetMonitor"]

log = logging.getLogger(__name__)

HEARTBEAT_FILTER = provider_filter("agents", ANY, "heartbeat")


class OutageReporter(Protocol):
    """Where the monitor reports outages so the control plane takes the host's workers out of their jobs."""

    async def report_host_down(self, host: str) -> list[str]: ...

    async def report_host_up(self, host: str) -> None: ...


@dataclass
class _HostLiveness:
    last_seen: float
    down: bool = False
    outages: int = 0
    told: set[tuple[str, str]] = field(default_factory=set)
    reported_down: bool = False
    report_up: bool = False
    waiting: tuple[str, ...] = ()
    """The jobs its last heartbeat said wait on a peer."""


class FleetMonitor:
    """Watches heartbeats; reports hosts that stop sending them to the tenants placed there."""

    def __init__(
        self,
        *,
        desired: DesiredState,
        sink: EventSink,
        secret: bytes,
        clock: Clock | None = None,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        missed_heartbeats: int = MISSED_HEARTBEATS_FOR_FAILURE,
        check_interval_s: float | None = None,
        reporter: OutageReporter | None = None,
    ) -> None:
        if not secret:
            raise ValueError("the fleet monitor needs the provider secret (HZ_PROVIDER_SECRET) to make pseudonyms")
        self._desired = desired
        self._sink = sink
        self._secret = secret
        self._clock: Clock = clock or SystemClock()
        self.silence_limit_s = heartbeat_interval_s * missed_heartbeats
        self.corroborated_limit_s = min(self.silence_limit_s, heartbeat_interval_s * MISSED_HEARTBEATS_WHILE_PEERS_WAIT)
        self._last_check: float | None = None
        self.check_interval_s = check_interval_s if check_interval_s is not None else heartbeat_interval_s / 4
        self._hosts: dict[str, _HostLiveness] = {}
        self._reporter = reporter
        self._stop = asyncio.Event()
        self.checks = 0
        self.heartbeats = 0

    def is_down(self, host: str) -> bool:
        state = self._hosts.get(host)
        return state is not None and state.down

    def is_up(self, host: str) -> bool:
        state = self._hosts.get(host)
        return state is not None and not state.down

    def outages(self, host: str) -> int:
        state = self._hosts.get(host)
        return 0 if state is None else state.outages

    def observe_heartbeat(self, beat: Heartbeat) -> None:
        """Record a heartbeat as received now."""
        self.heartbeats += 1
        now = self._clock.monotonic()
        state = self._hosts.get(beat.host)
        if state is None:
            self._hosts[beat.host] = _HostLiveness(last_seen=now, waiting=beat.waiting)
            return
        state.last_seen = now
        state.waiting = beat.waiting
        if state.down:
            log.info("host %s is back after outage %d", beat.host, state.outages)
            state.down = False
            state.told.clear()
            state.report_up = state.reported_down
            state.reported_down = False

    async def check(self) -> tuple[TenantEvent, ...]:
        """One evaluation: declare silent hosts down and tell the tenant jobs on them that were not told yet."""
        self.checks += 1
        fleet = self._desired.snapshot()
        if fleet is None:
            return ()
        now = self._clock.monotonic()
        steady = self._last_check is not None and now - self._last_check < self.corroborated_limit_s
        self._last_check = now
        for host in fleet:
            self._hosts.setdefault(host, _HostLiveness(last_seen=now))
        waiting = self._waiting_jobs(now) if steady else set()
        published: list[TenantEvent] = []
        for host, state in list(self._hosts.items()):  # heartbeats may add hosts while we await the sink
            silent = now - state.last_seen
            if silent <= self.corroborated_limit_s:
                continue
            blocked = sorted(
                f"{job.tenant}/{job.job}" for job in (fleet[host].jobs if host in fleet else ())
                if f"{job.tenant}/{job.job}" in waiting
            )
            if silent <= self.silence_limit_s and not blocked:
                continue
            if not state.down:
                state.down = True
                state.outages += 1
                if blocked:
                    log.warning("host %s missed its heartbeats for %.1f s while %s wait on a peer elsewhere: down",
                                host, silent, ", ".join(blocked))
                else:
                    log.warning("host %s missed its heartbeats for %.1f s: down", host, silent)
            await self._report_down(host, state)
            assignment = fleet.get(host)
            if assignment is None:
                continue
            for item in host_down(assignment, self._secret, detected_at=self._clock.now()):
                if (item.tenant, item.job) in state.told:
                    continue
                await self._sink.submit(item.subject, item.event)
                state.told.add((item.tenant, item.job))
                published.append(item)
        await self._report_recoveries()
        return tuple(published)

    def _waiting_jobs(self, now: float) -> set[str]:
        """Jobs that fresh heartbeats (of hosts not silent themselves) say wait on a peer."""
        return {
            job
            for state in self._hosts.values()
            if not state.down and now - state.last_seen <= self.corroborated_limit_s
            for job in state.waiting
        }

    async def _report_down(self, host: str, state: _HostLiveness) -> None:
        """Tell the control plane once per outage (retried on the next check if it could not be reached)."""
        if self._reporter is None or state.reported_down:
            return
        try:
            shrunk = await self._reporter.report_host_down(host)
        except Exception as exc:
            log.warning("could not report host %s down to the control plane: %r", host, exc)
            return
        if state.down:
            state.reported_down = True
            log.warning("host %s reported down; jobs shrunk: %s", host, ", ".join(shrunk) or "none")
        else:  # a heartbeat came while the report was in flight: the control plane must hear it is back
            state.report_up = True
            log.warning("host %s reported down (jobs shrunk: %s) and came back meanwhile: reporting it up",
                        host, ", ".join(shrunk) or "none")

    async def _report_recoveries(self) -> None:
        if self._reporter is None:
            return
        for host, state in list(self._hosts.items()):
            if not state.report_up:
                continue
            try:
                await self._reporter.report_host_up(host)
            except Exception as exc:
                log.warning("could not report host %s up to the control plane: %r", host, exc)
                continue
            state.report_up = False

    async def run(self, nc: Client) -> None:
        """Listen to heartbeats and check every `check_interval_s` until `stop()`."""
        subscription = await nc.subscribe(HEARTBEAT_FILTER, cb=self._on_heartbeat)
        try:
            while not self._stop.is_set():
                await self.check()
                await wait_set(self._stop, self.check_interval_s)
        finally:
            await subscription.unsubscribe()

    def stop(self) -> None:
        self._stop.set()

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            beat = Heartbeat.model_validate_json(msg.data)
        except ValidationError:
            log.warning("ignoring a malformed heartbeat on %s", msg.subject)
            return
        if msg.subject.split(".")[3:4] != [beat.host]:
            log.warning("ignoring a heartbeat for %s sent on %s", beat.host, msg.subject)
            return
        self.observe_heartbeat(beat)
