"""A tenant's events, read from the broker as the provider, for the console's feed (`GET /v1/events/stream`).

Why from NATS and not from the outbox: most events (failures, carbon, congestion, maintenance) are published by the
host agents straight into the tenant's stream and never pass through the control plane's database; the broker is
the one place that sees all of them. Each feed is an ordered consumer (ephemeral, unacknowledged, in the server's
memory only) on the tenant's own stream, in the provider's account, filtered on `hz.t.<tenant>.events.*.*`
(`harmonaize.subjects`), so a feed can only ever carry that tenant's events; each message's subject is parsed again
on arrival as a second check. Reading the stream rather than the live subjects gives every event its stream
sequence, which makes the feed resumable: it starts after a sequence the reader already has (`after`, what a
reconnecting console sends), or with the last `backlog` messages of the stream, so a page opened now shows what just
happened, and a reconnect loses nothing that the stream still holds.

One connection serves every open feed of the process (opened on first use, so an API without a broker starts and
serves everything else); each feed is one subscription, dropped when its reader stops. `close()` ends every open
feed and the connection (the app calls it on shutdown).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Final

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from api.services.errors import BrokerUnavailableError
from broker_config.keys import ProviderKeys
from broker_config.render import tenant_stream_name
from harmonaize.subjects import InvalidSubjectError, parse_tenant_event_subject, tenant_events_filter

__all__ = ["BACKLOG", "MAX_BACKLOG", "FeedEvent", "FeedReader", "TenantEventFeed"]

_log = logging.getLogger(__name__)

QUEUE_LIMIT: Final = 1000
BACKLOG: Final = 50
"""A new feed's replay: the stream's last this many messages (its events among them)."""
MAX_BACKLOG: Final = QUEUE_LIMIT
INACTIVE_S: Final = 30.0
"""A feed's consumer outlives a vanished API process (no unsubscribe) by this long on the server, no longer."""
"""Events a slow reader may fall behind by before the oldest are dropped (counted in `FeedEvent.dropped`)."""


@dataclass(frozen=True, slots=True)
class FeedEvent:
    """One tenant event as published on NATS: its kind and job (from the subject) and the CloudEvent bytes."""

    kind: str
    job: str
    payload: bytes
    sequence: int
    """Its sequence in the tenant's stream: the feed resumes after it."""
    dropped: int = 0
    """Events dropped before this one because the reader fell behind."""


_CLOSED: Final = object()


class TenantEventFeed:
    """Live per-tenant subscriptions over one shared provider connection."""

    def __init__(self, servers: Sequence[str], *, provider_secret: bytes, connect_timeout: float = 2.0) -> None:
        self._servers = list(servers)
        self._seed = ProviderKeys(provider_secret).provider.seed
        self._connect_timeout = connect_timeout
        self._client: Client | None = None
        self._lock = asyncio.Lock()
        self._queues: set[asyncio.Queue[FeedEvent | object]] = set()
        self._closed = False

    @property
    def open_feeds(self) -> int:
        """How many feeds are reading now (tests check that a reader that left is gone)."""
        return len(self._queues)

    async def _connected(self) -> Client:
        async with self._lock:
            if self._closed:
                raise BrokerUnavailableError("the API is shutting down")
            if self._client is not None and not self._client.is_closed:
                return self._client
            try:
                self._client = await asyncio.wait_for(
                    nats.connect(
                        servers=self._servers,
                        nkeys_seed_str=self._seed,
                        connect_timeout=self._connect_timeout,
                        allow_reconnect=True,
                        max_reconnect_attempts=-1,
                        reconnect_time_wait=0.2,
                        error_cb=_log_error,
                    ),
                    self._connect_timeout * 2,
                )
            except Exception as exc:  # nats-py raises several types for an unreachable or refusing server
                raise BrokerUnavailableError("the event broker is unreachable; retry shortly") from exc
            return self._client

    async def start_of(self, tenant_id: str, *, after: int | None = None, backlog: int = BACKLOG) -> int:
        """The stream sequence a feed of `tenant_id` starts at: after `after`, or else at the stream's last `backlog`
        messages; `BrokerUnavailableError` when the broker or the tenant's stream cannot be reached (so the caller
        can refuse before it starts a response)."""
        if after is not None and after < 0 or not 0 <= backlog <= MAX_BACKLOG:
            raise ValueError(f"after must be >= 0 and backlog in 0..{MAX_BACKLOG}, got {after}, {backlog}")
        client = await self._connected()
        if after is not None:
            return after + 1
        try:
            state = (await self._js(client).stream_info(tenant_stream_name(tenant_id))).state
        except NotFoundError:
            raise BrokerUnavailableError("this tenant's event stream is not there yet; retry shortly") from None
        except Exception as exc:  # timeouts, no responders while the broker restarts
            raise BrokerUnavailableError("the event broker did not answer; retry shortly") from exc
        return max(1, state.last_seq + 1 - backlog)

    def _js(self, client: Client) -> JetStreamContext:
        return client.jetstream(timeout=max(1.0, self._connect_timeout))

    @contextlib.asynccontextmanager
    async def subscribe(self, tenant_id: str, *, start: int) -> AsyncIterator[FeedReader]:
        """Read `tenant_id`'s events from stream sequence `start` on (`start_of`); the consumer exists on the
        broker when this enters. `BrokerUnavailableError` when it cannot be made."""
        if start < 1:
            raise ValueError(f"a stream sequence starts at 1, got {start}")
        client = await self._connected()
        js = self._js(client)
        stream = tenant_stream_name(tenant_id)
        queue: asyncio.Queue[FeedEvent | object] = asyncio.Queue(maxsize=QUEUE_LIMIT)
        dropped = 0

        async def deliver(msg: Msg) -> None:
            nonlocal dropped
            try:
                subject = parse_tenant_event_subject(msg.subject)
            except InvalidSubjectError:
                return
            if subject.tenant != tenant_id:  # cannot happen with the filter below; a second lock on the same door
                return
            if queue.full():
                queue.get_nowait()
                dropped += 1
            queue.put_nowait(FeedEvent(kind=subject.kind.value, job=subject.job, payload=msg.data,
                                       sequence=msg.metadata.sequence.stream, dropped=dropped))
            dropped = 0

        try:
            subscription = await js.subscribe(
                tenant_events_filter(tenant_id), stream=stream, cb=deliver, ordered_consumer=True,
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE, config=ConsumerConfig(opt_start_seq=start),
                inactive_threshold=INACTIVE_S,
            )
        except Exception as exc:
            raise BrokerUnavailableError("the event broker did not answer; retry shortly") from exc
        self._queues.add(queue)
        try:
            yield FeedReader(queue, start=start)
        finally:
            self._queues.discard(queue)
            with contextlib.suppress(Exception):  # the connection may be closing or gone; nothing left to undo then
                await subscription.unsubscribe()

    async def close(self) -> None:
        """End every open feed and drop the connection; later subscriptions are refused."""
        async with self._lock:
            self._closed = True
            for queue in self._queues:
                if queue.full():
                    queue.get_nowait()
                queue.put_nowait(_CLOSED)
            client, self._client = self._client, None
        if client is not None and not client.is_closed:
            with contextlib.suppress(Exception):
                await client.close()


class FeedReader:
    """One open feed: the next event, waiting at most so long (so the caller can send keep-alives meanwhile)."""

    def __init__(self, queue: asyncio.Queue[FeedEvent | object], *, start: int) -> None:
        self._queue = queue
        self.start = start
        """The stream sequence the feed began at (its first event's, or a later one's if that was no event)."""
        self.closed = False
        """The feed was closed (the API is shutting down): no event will come."""

    async def next(self, timeout: float) -> FeedEvent | None:
        """The next event, or None after `timeout` seconds without one or once the feed is closed."""
        if self.closed:
            return None
        try:
            async with asyncio.timeout(timeout):  # not wait_for: it can lose a cancellation (harmonaize.waits)
                item = await self._queue.get()
        except TimeoutError:
            return None
        if isinstance(item, FeedEvent):
            return item
        self.closed = True
        return None


async def _log_error(exc: Exception) -> None:
    _log.debug("event feed connection: %r", exc)
