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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from tenant_controllers.api_client import ProviderApi
from tenant_controllers.errors import TemporaryError
from tenant_controllers.pull_stream import PullStream
from tenant_controllers.sources import Subscription

__all__ = ["NatsDelivery", "NatsEventSource"]

_log = logging.getLogger("tenant_controllers.nats")


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
    ) -> None:
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
        self.errors: list[str] = []
        """Asynchronous errors the broker reported (permission violations arrive only this way)."""

    @property
    def ack_wait(self) -> float | None:
        return self._ack_wait

    async def open(self, subscription: Subscription) -> None:
        info = await self._api.put_event_consumer(
            subscription.consumer, kinds=subscription.kinds, jobs=subscription.jobs, ack_wait_s=self._requested_ack_wait
        )
        if self._nc is None or self._nc.is_closed:
            self._nc = await self._connect()
        js = self._nc.jetstream(prefix=info.js_api_prefix)
        try:
            consumer = await js.consumer_info(info.stream, info.name)
        except nats.errors.Error as exc:
            raise TemporaryError(f"cannot bind to consumer {info.name}: {exc}") from exc
        self._ack_wait = consumer.config.ack_wait
        if self._pull is not None:
            await self._pull.stop()
        self._pull = PullStream(self._nc, api_prefix=info.js_api_prefix, stream=info.stream, consumer=info.name)
        await self._pull.start()
        _log.info("pulling %s from stream %s (filters %s)", info.name, info.stream, ", ".join(info.filter_subjects))

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
        return [NatsDelivery(msg) for msg in await self._pull.take(batch, timeout)]

    async def keep_alive(self) -> None:
        """Extend the ack deadline of events pulled but not yet handed to the runtime (it is full)."""
        if self._pull is not None:
            await self._pull.extend_buffered()

    async def close(self) -> None:
        nc, pull, self._nc, self._pull = self._nc, self._pull, None, None
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
