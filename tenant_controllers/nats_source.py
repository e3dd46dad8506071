"""Events from the provider's broker: a durable JetStream pull consumer, created for us over REST.

Tenants cannot create consumers on the broker (a push consumer could deliver into another tenant's subjects, see
broker_config/render.py), so `open` asks the control plane (`PUT /v1/event-consumers/{name}` with our kinds and jobs)
and then pulls from it through the JetStream API the tenant account imports under `js_api_prefix`, with a continuous
pull (`PullStream`: demand always outstanding) rather than nats-py's request-per-batch `fetch`.

Traps handled here (docs/building-blocks.md): the broker reports permission problems only through `error_cb`, so
errors are logged, never silently dropped; acks are plain publishes to `$JS.ACK...` (allowed for tenant users), so an
ack can be lost and the event redelivered, which the runtime's de-duplication absorbs; the connection reconnects
forever, a reconnect re-issues the pull requests (the old ones died with the connection), and `fetch` turns every
transient broker failure into "nothing arrived yet" so the pull loop keeps going across broker restarts.

Who keeps the consumer's position (`position`, the provider's `PUT` field): by default the reader ("reader"). The
broker then holds the consumer in memory only, which spares it rewriting an fsync'd state file up to 10 times a second
per consumer (at 100 tenants, ~40 % of its CPU: bench/HISTORY.md), but a whole-broker restart loses the consumer. So
`position()` reads the broker's ack floor (every event at or below that stream sequence is acked, hence recorded by
the runtime's store before it was acked), the runtime records it, and when the consumer turns out to be gone (checked
after every reconnect and whenever the broker ends a pull request with an error) the source asks the provider for it
again from just after the highest floor it knows. Events acked after that floor come again; de-duplication absorbs
them. "broker" keeps the consumer on the broker's disk, as a plain JetStream reader would have it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Literal

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo

from tenant_controllers.api_client import EventConsumerInfo, ProviderApi
from tenant_controllers.errors import PermanentError, TemporaryError
from tenant_controllers.pull_stream import PullStream
from tenant_controllers.sources import StreamPosition, Subscription

__all__ = ["NatsDelivery", "NatsEventSource"]

_log = logging.getLogger("tenant_controllers.nats")

_INFO_TIMEOUT = 2.0
"""Seconds to wait for the broker's answer about the consumer (its ack floor, or that it is gone)."""
_RECHECK_AFTER = 0.5
"""Seconds before asking again whether the consumer exists, when the broker could not say (JetStream still starting
after a restart) or the provider could not re-create it yet."""


class NatsDelivery:
    """One JetStream message; implements `Delivery`."""

    def __init__(self, msg: Msg) -> None:
        self._msg = msg

    @property
    def data(self) -> bytes:
        return self._msg.data

    @property
    def subject(self) -> str:
        return self._msg.subject

    @property
    def num_delivered(self) -> int:
        try:
            return int(self._msg.metadata.num_delivered)
        except Exception:  # not a JetStream message (cannot happen on a pull consumer)
            return 1

    async def ack(self) -> None:
        await self._quietly(self._msg.ack)

    async def nak(self, delay: float | None = None) -> None:
        await self._quietly(lambda: self._msg.nak(delay=delay) if delay else self._msg.nak())

    async def in_progress(self) -> None:
        await self._quietly(self._msg.in_progress)

    async def term(self) -> None:
        await self._quietly(self._msg.term)

    async def _quietly(self, action: Any) -> None:
        """An ack that cannot be sent (broker down) only means a redelivery later, which de-duplication absorbs."""
        try:
            await action()
        except (nats.errors.Error, OSError) as exc:
            _log.warning("could not settle %s with the broker (%s); it will be redelivered", self._msg.subject, exc)


class NatsEventSource:
    """A tenant's durable pull consumer on the provider's broker; implements `EventSource`."""

    def __init__(
        self,
        *,
        servers: str | Sequence[str],
        seed: str,
        api: ProviderApi,
        reconnect_wait: float = 0.5,
        connect_timeout: float = 2.0,
        ack_wait: float | None = None,
        position: Literal["broker", "reader"] = "reader",
    ) -> None:
        if position not in ("broker", "reader"):
            raise ValueError(f"position must be 'broker' or 'reader', not {position!r}")
        self._servers = [servers] if isinstance(servers, str) else list(servers)
        self._seed = seed
        self._api = api
        self._reconnect_wait = reconnect_wait
        self._connect_timeout = connect_timeout
        self._nc: Client | None = None
        self._pull: PullStream | None = None
        self._ack_wait: float | None = None
        self._requested_ack_wait = ack_wait
        """Asked of the provider when the consumer is created; None: the provider's default."""
        self._position = position
        self._subscription: Subscription | None = None
        self._info: EventConsumerInfo | None = None
        self._js: JetStreamContext | None = None
        self._floor: StreamPosition | None = None
        """The highest ack floor known (the broker's, or recorded by the runtime): a lost consumer resumes after it."""
        self._check_due = False
        """The consumer may be gone (a reconnect, a pull ended by an error): `fetch` asks the broker first."""
        self._check_at = 0.0
        self._problems_seen = 0
        self.recreated = 0
        """Times the consumer was found lost with the broker and asked for again (a test or an exporter reads it)."""
        self.errors: list[str] = []
        """Asynchronous errors the broker reported (permission violations arrive only this way)."""

    @property
    def ack_wait(self) -> float | None:
        return self._ack_wait

    async def open(self, subscription: Subscription) -> None:
        self._subscription = subscription
        self._raise_floor(subscription.resume_after)
        await self._bind(subscription)

    async def _bind(self, subscription: Subscription) -> None:
        """Have the provider create (or update) the consumer, then pull from it."""
        info = await self._api.put_event_consumer(
            subscription.consumer,
            kinds=subscription.kinds,
            jobs=subscription.jobs,
            ack_wait_s=self._requested_ack_wait,
            position=self._position,
            start_after=self._floor if self._position == "reader" else None,
        )
        if self._floor is not None and self._floor.stream_created != info.stream_created:
            self._floor = None  # recorded in a stream that has been re-created since
        if self._nc is None or self._nc.is_closed:
            self._nc = await self._connect()
        js = self._nc.jetstream(prefix=info.js_api_prefix)
        try:
            consumer = await js.consumer_info(info.stream, info.name)
        except (TimeoutError, nats.errors.Error) as exc:
            raise TemporaryError(f"cannot bind to consumer {info.name}: {exc}") from exc
        self._info, self._js = info, js
        self._ack_wait = consumer.config.ack_wait
        self._raise_floor(self._ack_floor(consumer))
        if self._pull is not None:
            await self._pull.stop()
        self._pull = PullStream(self._nc, api_prefix=info.js_api_prefix, stream=info.stream, consumer=info.name)
        self._problems_seen = 0
        self._check_due = False
        await self._pull.start()
        _log.info("pulling %s from stream %s (filters %s)", info.name, info.stream, ", ".join(info.filter_subjects))

    async def position(self) -> StreamPosition | None:
        """Where every event is acked up to, as far as we know (None: nothing yet)."""
        if self._position == "reader" and await self._consumer_state() == "lost":
            self._check_due = True
        return self._floor

    async def _consumer_state(self) -> Literal["present", "lost", "unknown"]:
        """Ask the broker for the consumer; its ack floor raises ours."""
        if self._js is None or self._info is None:
            return "unknown"
        try:
            consumer = await self._js.consumer_info(self._info.stream, self._info.name, timeout=_INFO_TIMEOUT)
        except nats.js.errors.NotFoundError:
            return "lost"
        except (TimeoutError, nats.errors.Error, OSError):
            return "unknown"
        self._raise_floor(self._ack_floor(consumer))
        return "present"

    def _ack_floor(self, consumer: ConsumerInfo) -> StreamPosition | None:
        if consumer.ack_floor is None or self._info is None or self._info.stream_created is None:
            return None
        return StreamPosition(consumer.ack_floor.stream_seq, self._info.stream_created)

    def _raise_floor(self, floor: StreamPosition | None) -> None:
        if floor is not None and floor.supersedes(self._floor):
            self._floor = floor

    async def _check_consumer(self) -> None:
        """Called by `fetch` once the consumer may be gone: if it is, ask the provider for it again after our floor."""
        if time.monotonic() < self._check_at or self._subscription is None:
            return
        state = await self._consumer_state()
        if state == "present":
            self._check_due = False
            return
        self._check_at = time.monotonic() + _RECHECK_AFTER
        if state == "unknown":
            return
        try:
            await self._bind(self._subscription)
        except PermanentError:
            raise
        except (TemporaryError, TimeoutError, nats.errors.Error, OSError) as exc:
            _log.warning("consumer %s is gone and cannot be re-created yet (%s); retrying", self._subscription.consumer,
                         exc)
            return
        self.recreated += 1
        _log.warning(
            "consumer %s was lost with the broker's restart; re-created after stream sequence %s",
            self._subscription.consumer, self._floor.sequence if self._floor else 0,
        )

    async def _connect(self) -> Client:
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))
            _log.warning("broker error: %s", exc)

        client = Client()

        async def on_disconnect() -> None:
            if client.is_closed:  # nats-py calls this on our own close() too: a stop, not a lost broker
                return
            _log.warning("disconnected from the broker; reconnecting")

        async def on_reconnect() -> None:
            _log.info("reconnected to the broker")
            self._check_due = self._position == "reader"  # a restarted broker has lost a consumer kept in memory
            if self._pull is not None:
                self._pull.forget_requests()

        try:
            await client.connect(
                servers=self._servers,
                nkeys_seed_str=self._seed,
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                # nats-py annotates these seconds as int but uses them as float (asyncio.sleep, wait_for).
                reconnect_time_wait=self._reconnect_wait,  # type: ignore[arg-type]
                connect_timeout=self._connect_timeout,  # type: ignore[arg-type]
            )
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            raise TemporaryError(f"cannot connect to the broker at {', '.join(self._servers)}: {exc!r}") from exc
        except asyncio.CancelledError:  # stopped before the broker came up: leave no client tasks behind
            await client.close()
            raise
        return client

    async def fetch(self, *, batch: int, timeout: float) -> Sequence[NatsDelivery]:
        if self._pull is None:
            raise RuntimeError("open() the source first")
        if self._position == "reader" and self._pull.problems_count > self._problems_seen:
            self._problems_seen = self._pull.problems_count  # the broker ended a pull: a deleted consumer, perhaps
            self._check_due = True
        if self._check_due:
            await self._check_consumer()
        return [NatsDelivery(msg) for msg in await self._pull.take(batch, timeout)]

    async def keep_alive(self) -> None:
        """Extend the ack deadline of events pulled but not yet handed to the runtime (it is full)."""
        if self._pull is not None:
            await self._pull.extend_buffered()

    async def close(self) -> None:
        nc, pull, self._nc, self._pull, self._js = self._nc, self._pull, None, None, None
        if pull is not None:
            await pull.stop()
        if nc is None or nc.is_closed:
            return
        # Not drain(): nats-py's drain waits on a pull subscription's pending queue that fetch() never marks done,
        # so it always sits out its full timeout. A flush gets the last acks to the server; close() sends the rest.
        try:
            await nc.flush(timeout=1)
        except (TimeoutError, nats.errors.Error, OSError):
            pass
        await nc.close()
