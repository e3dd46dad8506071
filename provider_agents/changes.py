"""Change detection: the agent samples every tick but tells a tenant only what is new.

The projection describes the current state of each tenant job every tick; publishing all of it would be a firehose
that buries the few events a controller must act on. `ChangeTracker` remembers, per (tenant, job, slot), the last
state it let through and passes an event only when it is news:

| kind        | news when                                                                  |
|-------------|-----------------------------------------------------------------------------|
| topology    | the job's placement (nodes, groups, bandwidth classes) changed              |
| congestion  | a new episode on a path, or its level changed; when it ends, an all-clear   |
| failure     | a failure or prediction appears or changes (ETA, confidence, severity)       |
| maintenance | a notice appears or its status or window changes                           |
| carbon      | the intensity changed, or `carbon_every` ticks passed since the last one    |

Only carbon is ever re-sent unchanged, as a deliberate refresh every `carbon_every` ticks. A failure or notice
that persists, or that the source reports again, is never re-sent: the projection gives each slot one value per
tick that depends only on the conditions present (see `projection`), so a repeat compares equal. The tracker
refuses a tick with two events for one slot: it keeps one value per slot, so each of the two would look new on
every tick. A failure that ends is not announced.

The all-clear (`level: none`, slowdown 1.0) is made here because the projection cannot see a link that is no longer
congested; it reuses the ended event's source, job and group pseudonyms, so it too contains only tenant-facing values.
When a job leaves the host its memory is dropped without a word: the job is no longer this host's business.

The tracker lives in memory: a restarted agent re-announces the current state once, which a level-triggered consumer
treats as a no-op.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from harmonaize.events import CarbonIntensity, Congestion, CongestionLevel, EventData, Maintenance, make_event
from harmonaize.tracing import new_traceparent
from provider_agents.projection import TenantEvent

__all__ = ["DEFAULT_CARBON_EVERY", "ChangeTracker"]

DEFAULT_CARBON_EVERY = 300


def _change_key(data: EventData) -> object:
    """The part of a payload whose change is news; for most kinds, all of it."""
    if isinstance(data, Congestion):
        return (data.level, data.since, data.groups)
    if isinstance(data, CarbonIntensity):
        return (data.region, data.g_per_kwh)
    if isinstance(data, Maintenance):
        return (data.kind, data.status, data.window, data.early_approval)
    return data


@dataclass(frozen=True)
class _Published:
    key: object
    tick: int
    event: TenantEvent


class ChangeTracker:
    """What each tenant job was last told, so that only changes go out."""

    def __init__(self, *, carbon_every: int = DEFAULT_CARBON_EVERY) -> None:
        if carbon_every < 1:
            raise ValueError("carbon_every must be at least 1 tick")
        self.carbon_every = carbon_every
        self._tick = 0
        self._published: dict[tuple[str, str, str], _Published] = {}

    def changes(
        self, current: Sequence[TenantEvent], *, jobs: Iterable[tuple[str, str]], now: datetime
    ) -> list[TenantEvent]:
        """The events to publish this tick, given the full current state of the `jobs` on this host."""
        _one_event_per_slot(current)
        self._tick += 1
        here = set(jobs)
        self._published = {k: v for k, v in self._published.items() if (k[0], k[1]) in here}
        news: list[TenantEvent] = []
        present = set()
        for item in current:
            slot = (item.tenant, item.job, item.slot)
            present.add(slot)
            key = _change_key(item.event.data)
            previous = self._published.get(slot)
            due = (
                previous is None
                or previous.key != key
                or (isinstance(item.event.data, CarbonIntensity) and self._tick - previous.tick >= self.carbon_every)
            )
            if due:
                news.append(item)
                self._published[slot] = _Published(key, self._tick, item)
        for slot in [s for s in self._published if s not in present]:
            ended = self._published.pop(slot).event
            if isinstance(ended.event.data, Congestion) and ended.event.data.level is not CongestionLevel.NONE:
                news.append(_all_clear(ended, now))
        return news

    def forget(self) -> None:
        """Drop all memory (nothing is on this host any more, or the agent wants to re-announce)."""
        self._published.clear()


def _one_event_per_slot(current: Sequence[TenantEvent]) -> None:
    seen: set[tuple[str, str, str]] = set()
    for item in current:
        slot = (item.tenant, item.job, item.slot)
        if slot in seen:
            raise ValueError(f"two events for slot {item.slot!r} of {item.tenant}/{item.job} in one tick")
        seen.add(slot)


def _all_clear(ended: TenantEvent, now: datetime) -> TenantEvent:
    previous = ended.event.data
    assert isinstance(previous, Congestion)
    data = Congestion(
        level=CongestionLevel.NONE, slowdown=1.0, scope=previous.scope, groups=previous.groups, since=now
    )
    event = make_event(
        data, source=ended.event.source, subject=ended.event.subject, time=now, traceparent=new_traceparent()
    )
    return TenantEvent(ended.tenant, ended.job, ended.slot, event)
