"""Which data model a CloudEvents `type` string decodes into.

The registry is immutable: `parse_event` must give the same answer everywhere in a process, and a test that
needs an extra model builds its own registry (`DEFAULT_REGISTRY.with_models(MyModel)`) instead of mutating a
global one that other tests share. Several versions of a kind may be registered side by side; that is how a
consumer keeps reading v1 while producers move to v2.

Lookups distinguish three failures, because each calls for a different fix: a type outside our namespace (wrong
producer or stream), a kind this build does not know (a newer producer), and a known kind at an unknown version
(upgrade `harmonaize`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType

from harmonaize.events.base import EVENT_TYPE_PREFIX, EventData, split_event_type
from harmonaize.events.capacity import Capacity
from harmonaize.events.carbon import CarbonIntensity
from harmonaize.events.congestion import Congestion
from harmonaize.events.directive import DirectiveUpdate
from harmonaize.events.errors import UnknownEventTypeError
from harmonaize.events.failure import Failure
from harmonaize.events.job import JobUpdate
from harmonaize.events.kinds import EventKind
from harmonaize.events.maintenance import Maintenance
from harmonaize.events.negotiation import NegotiationUpdate
from harmonaize.events.topology import Topology

__all__ = ["DEFAULT_REGISTRY", "EventRegistry"]


class EventRegistry:
    """An immutable mapping from CloudEvents `type` to the pydantic model of its `data`."""

    def __init__(self, models: Iterable[type[EventData]]) -> None:
        by_type: dict[str, type[EventData]] = {}
        for model in models:
            if not (isinstance(model, type) and issubclass(model, EventData)):
                raise TypeError(f"not an EventData model: {model!r}")
            event_type = model.event_type()
            if event_type in by_type and by_type[event_type] is not model:
                raise ValueError(f"two models for {event_type}: {by_type[event_type].__name__} and {model.__name__}")
            by_type[event_type] = model
        self._by_type: Mapping[str, type[EventData]] = MappingProxyType(by_type)

    def with_models(self, *models: type[EventData]) -> EventRegistry:
        """A new registry holding this one's models plus `models`."""
        return EventRegistry([*self._by_type.values(), *models])

    @property
    def types(self) -> tuple[str, ...]:
        """Every registered `type` string, sorted."""
        return tuple(sorted(self._by_type))

    def versions(self, kind: EventKind | str) -> tuple[int, ...]:
        """The registered versions of `kind`, ascending (empty when the kind is unknown)."""
        return tuple(sorted(model.VERSION for model in self._by_type.values() if model.KIND == kind))

    def model_for(self, event_type: object) -> type[EventData]:
        """The data model for `event_type`, or UnknownEventTypeError explaining what is wrong with it."""
        if isinstance(event_type, str) and event_type in self._by_type:
            return self._by_type[event_type]
        if not isinstance(event_type, str):
            raise UnknownEventTypeError(event_type, "type must be a string")
        parts = split_event_type(event_type)
        if parts is None:
            raise UnknownEventTypeError(
                event_type, f"HarmonAIze types look like {EVENT_TYPE_PREFIX}<kind>.v<version>; known: {self._known()}"
            )
        kind, version = parts
        known_versions = self.versions(kind)
        if not known_versions:
            known_kinds = sorted({model.KIND.value for model in self._by_type.values()})
            raise UnknownEventTypeError(event_type, f"unknown kind {kind!r}; known kinds: {', '.join(known_kinds)}")
        shown = ", ".join(f"v{known}" for known in known_versions)
        raise UnknownEventTypeError(
            event_type, f"unsupported version v{version} of {kind!r} events; this build knows {shown}"
        )

    def __contains__(self, event_type: object) -> bool:
        return event_type in self._by_type

    def __iter__(self) -> Iterator[type[EventData]]:
        return iter(self._by_type.values())

    def __len__(self) -> int:
        return len(self._by_type)

    def _known(self) -> str:
        return ", ".join(self.types) or "(none)"


DEFAULT_REGISTRY = EventRegistry(
    [Topology, Congestion, Failure, Maintenance, CarbonIntensity, Capacity, NegotiationUpdate,
     DirectiveUpdate, JobUpdate]
)
"""Every event type this version of the contract publishes."""
