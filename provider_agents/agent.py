"""The host agent: every tick, observe the host and its desired state, branch on what was observed, publish news.

The loop is shaped like torchelastic's `_invoke_run`: sleep one interval, take an observation, classify it into a
state, and let one branch per state decide what to do. Observing is the only thing that touches the outside world
on the way in, so tests script the observations (a telemetry source returning HEALTHY, HEALTHY, GPU ERROR; a desired
state that is missing, then assigns a job, then removes it) and call `step()` directly with a manual clock.

| observed state  | meaning                                   | what the agent does                               |
|-----------------|-------------------------------------------|---------------------------------------------------|
| `waiting`       | the desired state has not been loaded yet | nothing: it cannot know whose jobs run here       |
| `idle`          | no tenant job is placed on this host      | forget what tenants were told (no one to tell)    |
| `assigned`      | tenant jobs run here                      | project telemetry per tenant job, publish changes |
| `source_failed` | the telemetry source raised this tick     | count it, keep running; next tick tries again     |

Level-triggered: each tick reads the current desired state from the `FleetView` mirror and projects the current
telemetry; nothing depends on having seen an earlier update, so a restarted agent converges to the same place
(it re-announces the current state once, because its change memory starts empty).

Heartbeats run in their own small loop, so that a slow tick (back-pressure from a broker outage, a slow source) does
not make a live host look dead to the fleet monitor, which would tell tenants their host is down. Raw telemetry goes
to the provider-internal `telemetry_subject(host)` for the provider's own loops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from harmonaize.desired_state import (
    HEARTBEAT_INTERVAL_S,
    Heartbeat,
    HostAssignment,
    heartbeat_subject,
    telemetry_subject,
)
from provider_agents.changes import DEFAULT_CARBON_EVERY, ChangeTracker
from provider_agents.clock import Clock, SystemClock
from provider_agents.desired import DesiredState
from provider_agents.projection import TenantEvent, project
from provider_agents.publisher import EventSink, RawSink
from provider_agents.telemetry.model import HostTelemetry
from provider_agents.telemetry.source import TelemetrySource

__all__ = ["Agent", "AgentConfig", "AgentState", "Observation", "StepResult", "classify"]

log = logging.getLogger(__name__)


class AgentState(StrEnum):
    WAITING = "waiting"
    IDLE = "idle"
    ASSIGNED = "assigned"
    SOURCE_FAILED = "source_failed"


@dataclass(frozen=True)
class AgentConfig:
    host: str
    tick_s: float = 1.0
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    carbon_every: int = DEFAULT_CARBON_EVERY
    publish_telemetry: bool = True

    def __post_init__(self) -> None:
        if self.tick_s <= 0 or self.heartbeat_interval_s <= 0:
            raise ValueError("tick and heartbeat intervals must be positive")


@dataclass(frozen=True)
class Observation:
    """What one tick saw: the host's telemetry (None when the source failed) and the fleet's desired state."""

    telemetry: HostTelemetry | None
    fleet: Mapping[str, HostAssignment] | None
    error: str | None = None


@dataclass(frozen=True)
class StepResult:
    state: AgentState
    published: tuple[TenantEvent, ...] = ()


def classify(observation: Observation, host: str) -> AgentState:
    """The state an observation puts this host in."""
    if observation.telemetry is None:
        return AgentState.SOURCE_FAILED
    if observation.fleet is None:
        return AgentState.WAITING
    assignment = observation.fleet.get(host)
    if assignment is None or not assignment.jobs:
        return AgentState.IDLE
    return AgentState.ASSIGNED


class Agent:
    """One host's agent. `run()` loops until `stop()`; `step()` is one tick (what tests drive)."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        source: TelemetrySource,
        desired: DesiredState,
        sink: EventSink,
        secret: bytes,
        raw: RawSink | None = None,
        clock: Clock | None = None,
        waiting: Callable[[], tuple[str, ...]] | None = None,
    ) -> None:
        """`waiting`: the jobs whose workers here wait on a peer (the node launcher's), sent in every heartbeat."""
        if not secret:
            raise ValueError("the agent needs the provider secret (HZ_PROVIDER_SECRET) to make pseudonyms")
        self.config = config
        self.host = config.host
        self._source = source
        self._desired = desired
        self._sink = sink
        self._secret = secret
        self._raw = raw
        self._clock: Clock = clock or SystemClock()
        self._tracker = ChangeTracker(carbon_every=config.carbon_every)
        self._stop = asyncio.Event()
        self._heartbeat_seq = 0
        self._waiting = waiting
        self._warned_group: str | None = None
        self.state: AgentState | None = None
        self.telemetry: HostTelemetry | None = None
        """The latest sample taken (what the host's tenants were last told of, e.g. its maintenance notices)."""
        self.source_failures = 0
        self.ticks = 0

    async def step(self) -> StepResult:
        """Observe once and act on the observed state."""
        self.ticks += 1
        observation = await self._observe()
        state = classify(observation, self.host)
        if state is not self.state:
            log.info("host %s: %s -> %s", self.host, self.state, state)
            self.state = state
        if state is AgentState.SOURCE_FAILED:
            self.source_failures += 1
            return StepResult(state)
        self.source_failures = 0
        if state is AgentState.WAITING:
            return StepResult(state)
        if state is AgentState.IDLE:
            self._tracker.forget()
            return StepResult(state)
        assert observation.telemetry is not None and observation.fleet is not None
        return StepResult(state, await self._publish_changes(observation.telemetry, observation.fleet))

    async def _observe(self) -> Observation:
        fleet = self._desired.snapshot()
        try:
            telemetry = self._source.sample()
        except Exception as exc:  # a source may fail in any way; the loop must survive it
            log.warning("host %s: telemetry source failed: %r", self.host, exc)
            return Observation(None, fleet, repr(exc))
        self.telemetry = telemetry
        if self._raw is not None and self.config.publish_telemetry:
            await self._raw.publish_raw(telemetry_subject(self.host), telemetry.model_dump_json().encode())
        return Observation(telemetry, fleet)

    async def _publish_changes(
        self, telemetry: HostTelemetry, fleet: Mapping[str, HostAssignment]
    ) -> tuple[TenantEvent, ...]:
        assignment = fleet[self.host]
        if assignment.locality_group != telemetry.locality_group and self._warned_group != assignment.locality_group:
            self._warned_group = assignment.locality_group
            log.warning(
                "host %s: desired state puts it in group %r, its telemetry says %r; the desired state wins",
                self.host,
                assignment.locality_group,
                telemetry.locality_group,
            )
        current = project(telemetry, assignment, self._secret, fleet=fleet)
        jobs = [(job.tenant, job.job) for job in assignment.jobs]
        news = self._tracker.changes(current, jobs=jobs, now=telemetry.sampled_at)
        for item in news:
            await self._sink.submit(item.subject, item.event)
        return tuple(news)

    async def heartbeat(self) -> Heartbeat:
        """Publish one heartbeat (provider-internal, best effort)."""
        waiting = self._waiting() if self._waiting is not None else ()
        beat = Heartbeat(host=self.host, seq=self._heartbeat_seq, at=self._clock.now(), waiting=waiting)
        self._heartbeat_seq += 1
        if self._raw is not None:
            await self._raw.publish_raw(heartbeat_subject(self.host), beat.model_dump_json().encode())
        return beat

    async def run(self) -> None:
        """Tick and heartbeat until `stop()`."""
        heartbeats = asyncio.get_running_loop().create_task(self._heartbeat_loop(), name=f"hz-heartbeat-{self.host}")
        try:
            while not self._stop.is_set():
                await self.step()
                await self._pause(self.config.tick_s)
        finally:
            heartbeats.cancel()
            try:
                await heartbeats
            except asyncio.CancelledError:
                pass

    def stop(self) -> None:
        self._stop.set()

    async def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            await self.heartbeat()
            await self._pause(self.config.heartbeat_interval_s)

    async def _pause(self, seconds: float) -> None:
        """Sleep on the agent's clock, waking early when stopped."""
        sleeper = asyncio.ensure_future(self._clock.sleep(seconds))
        stopper = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sleeper, stopper):
                task.cancel()
            await asyncio.gather(sleeper, stopper, return_exceptions=True)
