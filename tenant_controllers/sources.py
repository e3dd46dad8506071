"""The transport seam: where a controller's events come from, and how it tells the source it is done with one.

The runtime speaks only to these two protocols. `NatsEventSource` (a durable JetStream pull consumer the provider
created for us) and `MemoryEventSource` (a real in-process transport with the same at-least-once semantics, for
fast tests) both implement them, in the spirit of httpx's transports: tests swap the transport, not the code under test.

Semantics every source must keep (JetStream's):
* a delivery not acked within the ack wait is delivered again (`num_delivered` counts); `in_progress` extends it;
* `nak(delay)` asks for redelivery after `delay` seconds; `term` drops the message for good (unparseable events);
* `fetch` returns an empty list when nothing arrived within `timeout`, and never raises for a transient outage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from harmonaize.events import EventKind

__all__ = ["Delivery", "EventSource", "StreamPosition", "Subscription"]


@dataclass(frozen=True)
class StreamPosition:
    """Every event at or below `sequence` of the stream is acked. `stream_created` (as the provider's reply gives it)
    names one incarnation of the stream, so a position never carries over to a stream re-created since."""

    sequence: int
    stream_created: str

    def supersedes(self, other: StreamPosition | None) -> bool:
        """Whether this is news beside `other`: further on in the same stream, or in another (re-created) stream."""
        return other is None or other.stream_created != self.stream_created or self.sequence > other.sequence


@dataclass(frozen=True)
class Subscription:
    """What a controller wants: its durable consumer's name, the kinds it handles and its jobs, and the stream
    position its store recorded as acked (where a consumer lost with the broker starts again; None: none recorded)."""

    consumer: str
    kinds: tuple[EventKind, ...]
    jobs: tuple[str, ...]
    resume_after: StreamPosition | None = None


@runtime_checkable
class Delivery(Protocol):
    """One delivery of one stored message."""

    @property
    def data(self) -> bytes: ...

    @property
    def subject(self) -> str: ...

    @property
    def num_delivered(self) -> int: ...

    async def ack(self) -> None: ...

    async def nak(self, delay: float | None = None) -> None: ...

    async def in_progress(self) -> None: ...

    async def term(self) -> None: ...


@runtime_checkable
class EventSource(Protocol):
    """A durable, at-least-once stream of a tenant's events."""

    @property
    def ack_wait(self) -> float | None:
        """Seconds before an unacked delivery comes again (None: unknown); the runtime heartbeats well within it."""
        ...

    async def open(self, subscription: Subscription) -> None:
        """Create or resume the durable consumer; raise TemporaryError to be called again, PermanentError to stop."""
        ...

    async def fetch(self, *, batch: int, timeout: float) -> Sequence[Delivery]: ...

    async def close(self) -> None:
        """Stop; anything received but not yet returned by `fetch` goes back to the broker."""
        ...

    # Optional: `async def keep_alive(self) -> None`, called with the runtime's heartbeat, for a source that holds
    # deliveries it has not returned yet (a prefetch buffer): it extends their ack deadline as `in_progress` does.
    # Optional: `async def position(self) -> StreamPosition | None`, called with the heartbeat too, for a source whose
    # consumer the broker may lose: where every event is acked up to (None: unknown). The runtime records it in its
    # store and passes it back as `Subscription.resume_after` on the next start.
