"""Publishing: tenant events through JetStream until acknowledged; provider-internal chatter best effort.

Tenant events matter (a lost `failure` means a job hangs on a rendezvous timeout), so each one is published with
`js.publish` and retried, with capped exponential backoff, until its PubAck arrives. A core-NATS publish during a
reconnect can be silently lost (docs/building-blocks.md); a JetStream publish without an ack is simply retried.
Each attempt carries `Nats-Msg-Id` = the CloudEvent id, so an attempt that was stored but whose ack was lost is not
stored twice (within the stream's duplicate window; consumers also dedup by id, since delivery is at-least-once).

An event that carries a W3C `traceparent` (a CloudEvents extension; `tracestate` with it) is published with the
same values as NATS headers too, so a trace that starts at the agent reaches the tenant's controller without the
controller decoding the body first.

Between the agent and the broker sits a bounded queue. When the broker is away the queue fills and `submit` waits:
the agent's sampling loop stops instead of buffering without limit (back-pressure). The backlog is at most the queue;
once it drains, the next tick compares the world with what tenants were last told and sends only the difference, so
an outage costs a bounded delay, not a flood. One worker publishes in order, so a tenant sees a job's congestion rise
and fall in the order it happened. (Heartbeats run in their own loop and keep going meanwhile: see `agent.py`.)

A request that the server refuses as malformed (JetStream 400, or larger than max_payload) can never succeed and is
dropped with an error log; everything else (timeouts, no responders while a stream leader moves, disconnects) is
retried for as long as the publisher runs. A tenant whose stream does not exist yet gets "no responders", which is
retried too and holds back the events behind it: the control plane creates a tenant's stream before placing its jobs.

Heartbeats and raw telemetry are different: they are superseded by the next one within seconds, so `CoreSink` sends
them with a plain core publish and drops them when the connection cannot take them.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any, Protocol

import nats.errors
from nats.aio.client import Client
from nats.js.api import PubAck
from nats.js.errors import BadRequestError

from harmonaize.events import CONTENT_TYPE, CloudEvent

__all__ = ["Backoff", "CoreSink", "EventSink", "JetStreamLike", "JetStreamPublisher", "RawSink"]

log = logging.getLogger(__name__)


class EventSink(Protocol):
    async def submit(self, subject: str, event: CloudEvent[Any]) -> None:
        """Hand over a tenant event; returns once it is queued (it will be published until acknowledged)."""
        ...


class RawSink(Protocol):
    async def publish_raw(self, subject: str, payload: bytes) -> bool:
        """Best-effort provider-internal publish; False when it was dropped."""
        ...


class JetStreamLike(Protocol):
    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,
        stream: str | None = None,
        headers: dict[str, Any] | None = None,
    ) -> PubAck: ...


@dataclass(frozen=True)
class Backoff:
    """Capped exponential backoff with jitter, so agents that lost the broker together do not return in lockstep."""

    initial_s: float = 0.05
    factor: float = 2.0
    max_s: float = 2.0
    jitter: float = 0.2

    def delay(self, attempt: int) -> float:
        base = min(self.max_s, self.initial_s * self.factor ** max(0, attempt - 1))
        return base * (1.0 + self.jitter * (2.0 * random.random() - 1.0))


@dataclass(frozen=True)
class _Pending:
    subject: str
    payload: bytes
    msg_id: str
    traceparent: str | None = None
    tracestate: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        trace = {"traceparent": self.traceparent, "tracestate": self.tracestate}
        return {"Nats-Msg-Id": self.msg_id, "Content-Type": CONTENT_TYPE,
                **{name: value for name, value in trace.items() if value}}


class JetStreamPublisher:
    """Publishes tenant events in order, each until its PubAck; `submit` waits while the queue is full."""

    def __init__(
        self,
        js: JetStreamLike,
        *,
        max_pending: int = 1024,
        ack_timeout_s: float = 2.0,
        backoff: Backoff = Backoff(),
    ) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        self._js = js
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=max_pending)
        self._ack_timeout_s = ack_timeout_s
        self._backoff = backoff
        self._worker: asyncio.Task[None] | None = None
        self._in_flight = False
        self.published = 0
        self.duplicates = 0
        self.retries = 0
        self.dropped = 0

    @property
    def pending(self) -> int:
        """Events queued and not yet acknowledged (the one in flight included)."""
        return self._queue.qsize() + (1 if self._in_flight else 0)

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="hz-publisher")

    async def submit(self, subject: str, event: CloudEvent[Any]) -> None:
        pending = _Pending(subject, event.to_json_bytes(), event.id, event.traceparent, event.tracestate)
        await self._queue.put(pending)

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is acknowledged (or dropped); False on timeout."""
        try:
            await asyncio.wait_for(self._queue.join(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self, *, drain_timeout: float = 2.0) -> None:
        """Give queued events `drain_timeout` to go out, then stop; what is left is lost with the process anyway."""
        if self._worker is None:
            return
        if not await self.drain(drain_timeout):
            log.warning("publisher closing with %d unacknowledged events", self.pending)
        self._worker.cancel()
        try:
            await self._worker
        except asyncio.CancelledError:
            pass
        self._worker = None

    async def _run(self) -> None:
        while True:
            item = await self._queue.get()
            self._in_flight = True
            try:
                await self._publish_until_acked(item)
            finally:
                self._in_flight = False
                self._queue.task_done()

    async def _publish_until_acked(self, item: _Pending) -> None:
        attempt = 0
        while True:
            attempt += 1
            try:
                ack = await self._js.publish(
                    item.subject, item.payload, timeout=self._ack_timeout_s, headers=item.headers
                )
            except (BadRequestError, nats.errors.MaxPayloadError) as exc:
                self.dropped += 1
                log.error("broker refused event %s on %s, dropping it: %s", item.msg_id, item.subject, exc)
                return
            except Exception as exc:  # timeouts, no responders, disconnects: all worth another try
                self.retries += 1
                if attempt in (1, 10) or attempt % 100 == 0:
                    log.warning(
                        "publish of %s on %s failed (attempt %d), retrying: %r", item.msg_id, item.subject, attempt, exc
                    )
                await asyncio.sleep(self._backoff.delay(attempt))
                continue
            self.published += 1
            if ack.duplicate:
                self.duplicates += 1
            return


class CoreSink:
    """Best-effort core-NATS publishing for heartbeats and raw telemetry."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self.dropped = 0

    async def publish_raw(self, subject: str, payload: bytes) -> bool:
        try:
            await self._nc.publish(subject, payload)
        except nats.errors.Error:  # buffer full while reconnecting, closed, ...: the next one will do
            self.dropped += 1
            return False
        return True
