"""A continuous pull on a JetStream consumer: demand is always outstanding, so an event flows the moment it is stored.

nats-py 2.16 offers only `fetch()`: each batch is a request/response round trip (a no-wait probe, then a long poll),
and an event stored while no request is waiting sits on the server until the next one. Under load that round trip is
where the time goes (the broker answers pull requests from the same lock its fsyncing publishers hold). The newer NATS
clients (Go's `Consume`, .NET's `ConsumeAsync`; NATS ADR-37) keep pull requests outstanding instead and top them up
as messages arrive; this is the same protocol, on nats-py's core client:

* a request `{"batch": n, "expires": E, "idle_heartbeat": H}` to `<api prefix>.CONSUMER.MSG.NEXT.<stream>.<consumer>`
  with our inbox as reply; the server delivers up to n messages there as they are stored;
* `requested` counts what is still owed to us; when what is owed plus what is buffered falls to half the window, we
  ask for the difference (so the server never runs dry while we are busy);
* status messages: 100 is an idle heartbeat (liveness only); 408 (request expired) and 409 (e.g. a leader change)
  end a request, and their `Nats-Pending-Messages` header says how much of it went unserved; an expiry is re-asked
  at once, anything else (a deleted consumer, no responders while a leader is elected) after a backoff that doubles
  up to 5 s, so a consumer that is gone costs a few requests a second, not a hot loop;
* a request can vanish silently (a broker restart, a reconnect): no message and no heartbeat for three heartbeat
  intervals, or a reconnect, and we assume nothing is owed and ask again. Asking twice only buffers a few more.

The window is the caller's: `take(batch)` asks for at most `batch` in flight from the server (the runtime asks for
what it has room for), and an expired request is renewed from the callback only while a `take` is waiting, so a
runtime that is full stops asking. What is already buffered then waits: `extend_buffered` keeps its ack deadline
from passing (the runtime's heartbeat calls it), and `stop` hands it back to the broker. Nothing is asked while the
connection is down: nats-py would queue the request and send it on reconnect, after which the reconnect forgets what
was owed and asks again, so requests would pile up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription

__all__ = ["PullStream"]

_log = logging.getLogger("tenant_controllers.nats")

_PENDING_MESSAGES = "Nats-Pending-Messages"
_BACKOFF_FIRST, _BACKOFF_MAX = 0.25, 5.0
_STATUS = "Status"
_DESCRIPTION = "Description"


class PullStream:
    """Outstanding pull requests on one durable consumer, and the messages they brought."""

    def __init__(
        self,
        nc: Client,
        *,
        api_prefix: str,
        stream: str,
        consumer: str,
        expires: float = 30.0,
        heartbeat: float = 2.0,
    ) -> None:
        if not 0 < heartbeat <= expires / 2:
            raise ValueError("the idle heartbeat must be positive and at most half of expires")
        self._nc = nc
        self._request_subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._expires_ns = int(expires * 1e9)
        self._heartbeat = heartbeat
        self._inbox = nc.new_inbox()
        self._sub: NatsSubscription | None = None
        self._buffer: deque[Msg] = deque()
        self._arrived = _Signal()
        self._requested = 0
        self._window = 0
        self._waiting = False  # a `take` is waiting for messages
        self._last_heard = time.monotonic()
        self._quiet_until = 0.0
        self._backoff = _BACKOFF_FIRST
        self.requests_sent = 0
        """Pull requests sent (instrumentation: a test or benchmark reads it)."""
        self.problems: deque[str] = deque(maxlen=100)
        """The latest status messages that were neither heartbeats nor expiries (a deleted consumer, a leader
        change...); bounded, since a consumer that stays gone produces one every few seconds."""
        self.problems_count = 0
        """How many such status messages came in all (`problems` keeps only the latest)."""

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._inbox, cb=self._on_message)

    async def stop(self) -> None:
        """Stop asking, and hand what is buffered back to the broker (it is redelivered at once, not after ack_wait)."""
        sub, self._sub = self._sub, None
        self._window = 0
        self._arrived.set()
        if sub is not None:
            try:
                await sub.unsubscribe()
            except (nats.errors.Error, OSError):
                pass
        buffered, self._buffer = list(self._buffer), deque()
        for msg in buffered:
            try:
                await msg.nak()
            except (nats.errors.Error, OSError):  # the broker redelivers after the ack wait instead
                break

    async def extend_buffered(self) -> None:
        """Tell the broker we are still working on what is buffered but not yet taken (the runtime is full)."""
        for msg in list(self._buffer):
            try:
                await msg.in_progress()
            except (nats.errors.Error, OSError):
                return

    def forget_requests(self) -> None:
        """Our requests died with the connection (a reconnect): nothing is owed any more."""
        self._requested = 0
        self._arrived.set()  # wake a waiting `take`, which asks again

    async def take(self, batch: int, timeout: float) -> list[Msg]:
        """Up to `batch` messages; waits at most `timeout` for the first. Never raises for a broker outage."""
        if batch < 1:
            return []
        self._window = batch
        deadline = time.monotonic() + timeout
        while not self._buffer:
            if self._sub is None:
                return []
            self._arrived.clear()  # before asking: a wake-up during the publish below is not lost
            await self._top_up()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            if self._buffer:
                break
            wait = min(remaining, self._heartbeat)
            quiet = self._quiet_until - time.monotonic()
            if quiet > 0:
                wait = min(wait, quiet)
            self._waiting = True
            try:
                if not await self._arrived.wait(wait):
                    self._check_liveness()
            finally:
                self._waiting = False
        taken = [self._buffer.popleft() for _ in range(min(batch, len(self._buffer)))]
        if self._sub is not None:
            await self._top_up()
        return taken

    # -- demand ------------------------------------------------------------------------------------------------------

    async def _top_up(self) -> None:
        owed = self._requested + len(self._buffer)
        want = self._window - owed
        if want <= 0 or (self._requested > 0 and owed > self._window // 2) or time.monotonic() < self._quiet_until:
            return
        if not self._nc.is_connected:  # it would be queued and sent on reconnect, on top of what we ask then
            return
        request = {"batch": want, "expires": self._expires_ns, "idle_heartbeat": int(self._heartbeat * 1e9)}
        if self._requested == 0:
            self._last_heard = time.monotonic()  # the liveness clock starts with the first request outstanding
        self._requested += want  # before the await: a top-up from the callback meanwhile must see this demand
        try:
            await self._nc.publish(self._request_subject, json.dumps(request).encode(), reply=self._inbox)
        except (nats.errors.Error, OSError) as exc:  # closed or reconnecting: ask again on the next take
            self._requested = max(0, self._requested - want)
            _log.debug("pull request not sent (%s)", exc)
            return
        self.requests_sent += 1

    def _check_liveness(self) -> None:
        silent = time.monotonic() - self._last_heard
        if self._requested > 0 and silent > 3 * self._heartbeat and self._nc.is_connected:
            _log.info("no message or heartbeat for %.1f s: re-issuing the pull request", silent)
            self._requested = 0

    # -- arrivals ----------------------------------------------------------------------------------------------------

    async def _on_message(self, msg: Msg) -> None:
        self._last_heard = time.monotonic()
        status = msg.headers.get(_STATUS) if msg.headers else None
        if not status:
            self._requested = max(0, self._requested - 1)
            self._backoff = _BACKOFF_FIRST
            self._buffer.append(msg)
            self._arrived.set()
            return
        if status == "100":  # idle heartbeat
            return
        unserved = _pending_of(msg)
        self._requested = max(0, self._requested - unserved) if unserved is not None else 0
        if status in ("408", "404"):  # expired (or nothing left): ask again now, if someone is waiting
            self._backoff = _BACKOFF_FIRST
            if self._waiting:
                await self._top_up()
        else:
            description = msg.headers.get(_DESCRIPTION, "") if msg.headers else ""
            self.problems.append(f"{status} {description}".strip())
            self.problems_count += 1
            _log.warning("pull request ended by the broker: %s %s; asking again in %.2f s", status, description,
                         self._backoff)
            self._quiet_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, _BACKOFF_MAX)
        self._arrived.set()


class _Signal:
    """`asyncio.Event` with a timed wait that costs a future and a timer, not a Task: `asyncio.wait_for` (3.11) wraps
    the wait in a Task, extra work on every take that finds the buffer empty, i.e. on most events."""

    def __init__(self) -> None:
        self._set = False
        self._waiters: set[asyncio.Future[bool]] = set()

    def set(self) -> None:
        self._set = True
        for waiter in self._waiters:
            _resolve(waiter, True)

    def clear(self) -> None:
        self._set = False

    async def wait(self, timeout: float) -> bool:
        """True once set (even if cleared again before this waiter resumed), False if `timeout` seconds passed first."""
        if self._set:
            return True
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        timer = loop.call_later(timeout, _resolve, waiter, False)
        self._waiters.add(waiter)
        try:
            return await waiter
        finally:
            timer.cancel()
            self._waiters.discard(waiter)


def _resolve(waiter: asyncio.Future[bool], value: bool) -> None:
    if not waiter.done():
        waiter.set_result(value)


def _pending_of(msg: Msg) -> int | None:
    try:
        return int(msg.headers[_PENDING_MESSAGES]) if msg.headers and _PENDING_MESSAGES in msg.headers else None
    except ValueError:
        return None
