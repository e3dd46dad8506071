"""An in-process event source with JetStream's semantics, for fast tests of controllers (yours and ours).

`MemoryBroker` is one tenant's stream: it stores published events in order and de-duplicates on a message id within
a window, like JetStream's `Nats-Msg-Id`. Durable consumers live in the broker, not in the source, so a second
`MemoryEventSource` opened with the same consumer name resumes where the first stopped (a restarted controller).
Unacked deliveries come back after the ack wait; `nak(delay)` and `in_progress()` behave as on the real server.

`Faults` makes the bus misbehave in the ways a real deployment can: events lost before they are stored (a provider
crash before its publish), stored twice under different message ids, delivered out of order within a batch, and acks
lost on the way back (so the event is redelivered). Faults draw from a seeded RNG, so a failing run can be replayed.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from harmonaize.events import CloudEvent
from harmonaize.subjects import InvalidSubjectError, parse_tenant_event_subject, tenant_event_subject
from harmonaize.waits import wait_set
from tenant_controllers.sources import Subscription

__all__ = ["Faults", "MemoryBroker", "MemoryDelivery", "MemoryEventSource"]


@dataclass(frozen=True)
class Faults:
    """Probabilities of each misbehaviour (0 = never)."""

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: bool = False
    lose_ack: float = 0.0
    seed: int = 0


@dataclass
class _Stored:
    seq: int
    subject: str
    data: bytes


@dataclass
class _Pending:
    deadline: float
    num_delivered: int


@dataclass
class _Consumer:
    subscription: Subscription
    next_seq: int = 1
    pending: dict[int, _Pending] = field(default_factory=dict)
    acked: set[int] = field(default_factory=set)
    terminated: set[int] = field(default_factory=set)


class MemoryBroker:
    """One tenant's event stream, in memory."""

    def __init__(self, *, tenant: str, faults: Faults | None = None, ack_wait: float = 30.0) -> None:
        self.tenant = tenant
        self.faults = faults or Faults()
        self.ack_wait = ack_wait
        self.random = random.Random(self.faults.seed)
        self._messages: list[_Stored] = []
        self._msg_ids: set[str] = set()
        self._consumers: dict[str, _Consumer] = {}
        self._changed = asyncio.Event()
        self.dropped: list[str] = []
        """Message ids the `drop` fault discarded (so a test can tell what never reached the stream)."""

    @property
    def stored(self) -> int:
        return len(self._messages)

    def publish(self, event: CloudEvent[Any], *, msg_id: str | None = None) -> None:
        """Store `event` on its subject, as a provider's `js.publish` with `Nats-Msg-Id` would (faults applied)."""
        kind = event.data.KIND
        subject = tenant_event_subject(self.tenant, kind, event.subject)
        msg_id = msg_id or event.id
        if msg_id in self._msg_ids:
            return
        self._msg_ids.add(msg_id)
        if self.random.random() < self.faults.drop:
            self.dropped.append(msg_id)
            return
        copies = 2 if self.random.random() < self.faults.duplicate else 1
        for _ in range(copies):
            self.publish_raw(subject, event.to_json_bytes())

    def publish_raw(self, subject: str, data: bytes) -> None:
        """Store bytes as they are (no faults, no de-duplication): for malformed events."""
        self._messages.append(_Stored(seq=len(self._messages) + 1, subject=subject, data=data))
        self._changed.set()

    def consumer_state(self, name: str) -> tuple[int, int]:
        """(acked, pending) message counts of a durable consumer."""
        consumer = self._consumers[name]
        return len(consumer.acked), len(consumer.pending)

    # -- the consumer side, used by MemoryEventSource ----------------------------------------------------------------

    def _ensure_consumer(self, subscription: Subscription) -> _Consumer:
        consumer = self._consumers.get(subscription.consumer)
        if consumer is None:
            consumer = _Consumer(subscription)
            self._consumers[subscription.consumer] = consumer
        else:
            consumer.subscription = subscription  # like PUT /v1/event-consumers: filters may change
        return consumer

    def _wanted(self, consumer: _Consumer, subject: str) -> bool:
        try:
            parts = parse_tenant_event_subject(subject)
        except InvalidSubjectError:
            return not consumer.subscription.kinds and not consumer.subscription.jobs
        sub = consumer.subscription
        return (not sub.kinds or parts.kind in sub.kinds) and (not sub.jobs or parts.job in sub.jobs)

    def _take(self, consumer: _Consumer, batch: int) -> list[MemoryDelivery]:
        now = time.monotonic()
        taken: list[MemoryDelivery] = []
        for seq in sorted(consumer.pending):
            if len(taken) >= batch:
                break
            entry = consumer.pending[seq]
            if entry.deadline <= now:
                entry.num_delivered += 1
                entry.deadline = now + self.ack_wait
                taken.append(MemoryDelivery(self, consumer, self._messages[seq - 1], entry.num_delivered))
        while len(taken) < batch and consumer.next_seq <= len(self._messages):
            stored = self._messages[consumer.next_seq - 1]
            consumer.next_seq += 1
            if not self._wanted(consumer, stored.subject):
                continue
            consumer.pending[stored.seq] = _Pending(deadline=now + self.ack_wait, num_delivered=1)
            taken.append(MemoryDelivery(self, consumer, stored, 1))
        if self.faults.reorder:
            self.random.shuffle(taken)
        return taken

    def _next_deadline(self, consumer: _Consumer) -> float | None:
        return min((entry.deadline for entry in consumer.pending.values()), default=None)

    def _settle(self, consumer: _Consumer, seq: int, *, acked: bool) -> None:
        if consumer.pending.pop(seq, None) is not None:
            (consumer.acked if acked else consumer.terminated).add(seq)

    def _redeliver_after(self, consumer: _Consumer, seq: int, delay: float) -> None:
        entry = consumer.pending.get(seq)
        if entry is not None:
            entry.deadline = time.monotonic() + delay
            self._changed.set()


class MemoryDelivery:
    """One delivery from a MemoryBroker; implements `Delivery`."""

    def __init__(self, broker: MemoryBroker, consumer: _Consumer, stored: _Stored, num_delivered: int) -> None:
        self._broker = broker
        self._consumer = consumer
        self._stored = stored
        self._num_delivered = num_delivered

    @property
    def data(self) -> bytes:
        return self._stored.data

    @property
    def subject(self) -> str:
        return self._stored.subject

    @property
    def num_delivered(self) -> int:
        return self._num_delivered

    async def ack(self) -> None:
        if self._broker.random.random() < self._broker.faults.lose_ack:
            return
        self._broker._settle(self._consumer, self._stored.seq, acked=True)

    async def nak(self, delay: float | None = None) -> None:
        self._broker._redeliver_after(self._consumer, self._stored.seq, delay or 0.0)

    async def in_progress(self) -> None:
        self._broker._redeliver_after(self._consumer, self._stored.seq, self._broker.ack_wait)

    async def term(self) -> None:
        self._broker._settle(self._consumer, self._stored.seq, acked=False)


class MemoryEventSource:
    """A durable pull consumer on a MemoryBroker; implements `EventSource`."""

    def __init__(self, broker: MemoryBroker) -> None:
        self._broker = broker
        self._consumer: _Consumer | None = None
        self.subscription: Subscription | None = None

    @property
    def ack_wait(self) -> float:
        return self._broker.ack_wait

    async def open(self, subscription: Subscription) -> None:
        self.subscription = subscription
        self._consumer = self._broker._ensure_consumer(subscription)

    async def fetch(self, *, batch: int, timeout: float) -> Sequence[MemoryDelivery]:
        if self._consumer is None:
            raise RuntimeError("open() the source first")
        deadline = time.monotonic() + timeout
        while True:
            self._broker._changed.clear()
            taken = self._broker._take(self._consumer, batch)
            now = time.monotonic()
            if taken or now >= deadline:
                return taken
            wake = deadline
            redelivery = self._broker._next_deadline(self._consumer)
            if redelivery is not None:
                wake = min(wake, max(redelivery, now + 0.001))
            await wait_set(self._broker._changed, wake - now)

    async def close(self) -> None:
        self._consumer = None
