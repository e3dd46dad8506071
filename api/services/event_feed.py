"""A tenant's live events, read from the broker as the provider, for the console's feed (`GET /v1/events/stream`).

Why from NATS and not from the outbox: most events (failures, carbon, congestion, maintenance) are published by the
host agents straight into the tenant's stream and never pass through the control plane's database; the broker is
the one place that sees all of them. The feed subscribes (core NATS, live only: no replay, no consumer on the
tenant's stream) in the provider's account to `hz.t.<tenant>.events.*.*`, built by `harmonaize.subjects`, so a feed
can only ever carry that tenant's events; each message's subject is parsed again on arrival as a second check.

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

from api.services.errors import BrokerUnavailableError
from broker_config.keys import ProviderKeys
from harmonaize.subjects import InvalidSubjectError, parse_tenant_event_subject, tenant_events_filter

__all__ = ["FeedEvent", "FeedReader", "TenantEventFeed"]

_log = logging.getLogger(__name__)

QUEUE_LIMIT: Final = 1000
"""Events a slow reader may fall behind by before the oldest are dropped (counted in `FeedEvent.dropped`)."""


@dataclass(frozen=True, slots=True)
class FeedEvent:
    """One tenant event as published on NATS: its kind and job (from the subject) and the CloudEvent bytes."""

    kind: str
    job: str
    payload: bytes
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

    async def ensure_connected(self) -> None:
        """Connect now, so a caller can refuse (503) before it starts a response; `BrokerUnavailableError` if not."""
        await self._connected()

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

    @contextlib.asynccontextmanager
    async def subscribe(self, tenant_id: str) -> AsyncIterator[FeedReader]:
        """Subscribe to `tenant_id`'s events; the subscription is live on the broker when this enters."""
        client = await self._connected()
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
            queue.put_nowait(FeedEvent(kind=subject.kind.value, job=subject.job, payload=msg.data, dropped=dropped))
            dropped = 0

        subscription = await client.subscribe(tenant_events_filter(tenant_id), cb=deliver)
        self._queues.add(queue)
        try:
            # the server has the interest before the caller says "ready"
            await client.flush(timeout=max(1, round(self._connect_timeout)))
            yield FeedReader(queue)
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

    def __init__(self, queue: asyncio.Queue[FeedEvent | object]) -> None:
        self._queue = queue
        self.closed = False
        """The feed was closed (the API is shutting down): no event will come."""

    async def next(self, timeout: float) -> FeedEvent | None:
        """The next event, or None after `timeout` seconds without one or once the feed is closed."""
        if self.closed:
            return None
        try:
            item = await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None
        if isinstance(item, FeedEvent):
            return item
        self.closed = True
        return None


async def _log_error(exc: Exception) -> None:
    _log.debug("event feed connection: %r", exc)
