"""The runtime: pulls a controller's events from an `EventSource`, runs its handlers, and acks only when done.

Structure (kopf's reactor, reduced to what a tenant controller needs):

* one pull loop fetches batches, decodes each CloudEvent and routes it to its job's lane; an event that cannot be
  decoded is terminated (it would fail the same way forever), one for another job or with no handler is acked;
* one lane per job runs that job's events *and* its resyncs one at a time, in arrival order, so a handler never races
  another handler or a resync of the same job; different jobs proceed independently;
* a resync ticker enqueues a resync in each lane at start and then every `resync_interval` (at most one queued per
  lane: resync reads current state, so two in a row are one);
* for each event: skip handlers already recorded as finished for this CloudEvent id (de-duplication across
  redeliveries and restarts), run the others with their retry policy, record each outcome, then ack once the
  records are committed (one commit and one burst of acks for the events finished in a turn of the loop:
  `group_commit`). While a
  event is held (queued in its lane or being handled), its ack deadline is extended, so a slow or retrying handler
  does not get its event, or the events queued behind it, redelivered meanwhile. At most `max_in_flight` events are
  held at once: prefetching more than the lanes can handle only ties events to a process that might die;
* for a source whose consumer the broker may lose (`NatsEventSource`, consumers kept by their reader), a position
  ticker records the broker's ack floor in the store every `heartbeat_interval`, and once more at the stop; the next
  start hands it back (`Subscription.resume_after`), so a consumer lost while nobody ran resumes there.

Stopping (`stop` set): the pull loop ends, handlers that are running finish their current attempt (up to
`drain_timeout`), and every event not finished is handed back to the broker (nak) for the next run.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

from harmonaize.events import CloudEvent, EventData, EventError, Failure, parse_event
from harmonaize.events.kinds import EventKind
from harmonaize.tracing import child_traceparent
from harmonaize.waits import wait_set
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.controller import Controller
from tenant_controllers.errors import PermanentError
from tenant_controllers.execution import Done, GaveUp, Interrupted, run_with_retries
from tenant_controllers.group_commit import CommitThenAck
from tenant_controllers.handlers import EventHandler, ResyncHandler, call_handler
from tenant_controllers.idempotency import HandlerInvocation, invocation
from tenant_controllers.job import Job
from tenant_controllers.sources import Delivery, EventSource, Subscription
from tenant_controllers.store import HandledStore, Status

__all__ = ["JOB_CHANGING_KINDS", "ControllerRuntime", "RuntimeStats"]

_log = logging.getLogger("tenant_controllers.runtime")

JOB_CHANGING_KINDS = frozenset({EventKind.NEGOTIATION, EventKind.JOB, EventKind.FAILURE})
"""Events that say the job's record at the provider changed or is about to (agreed workers or plan, a restart at a
new shape, a host lost: re-placement): their handlers get the job re-read first. They are rare; the frequent kinds
(congestion, carbon, topology, capacity) get the view at hand without waiting (see `job`). Maintenance notices and
micro-loop directives change nothing in the job's record, so they are not in it. A failure may arrive before the
provider has re-placed the job: that read can still show the old shape, and the `job` event of the restart that
follows re-reads it again (for a controller that handles `job` events)."""

_STOP = object()
_RESYNC = object()


@dataclass
class RuntimeStats:
    """Counters a test (or a metrics exporter) can read."""

    received: int = 0
    handled: int = 0  # handler runs that finished (returned)
    gave_up: int = 0  # handler runs that gave up
    stale: int = 0  # latest_only handlers skipped for an older event
    duplicates: int = 0  # deliveries whose handlers had all finished before
    terminated: int = 0  # undecodable events
    ignored: int = 0  # other jobs, or no handler for the type
    resyncs: int = 0  # resync passes completed
    handed_back: int = 0  # events nak'ed at shutdown


@dataclass
class _EventItem:
    envelope: CloudEvent[Any]
    delivery: Delivery


@dataclass
class _Lane:
    job: Job
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    resync_queued: bool = False
    task: asyncio.Task[None] | None = None


class ControllerRuntime:
    """Runs one Controller against one EventSource until `stop` is set."""

    def __init__(
        self,
        controller: Controller,
        *,
        source: EventSource,
        api: ProviderApi,
        store: HandledStore,
        resync_interval: float | None = 60.0,
        batch: int = 16,
        fetch_timeout: float = 1.0,
        heartbeat_interval: float = 5.0,
        drain_timeout: float = 30.0,
        max_in_flight: int = 64,
        job_max_age: float = 5.0,
        job_stale_limit: float = 60.0,
    ) -> None:
        self.controller = controller
        self.source = source
        self.api = api
        self.store = store
        self.resync_interval = resync_interval
        self.batch = batch
        self.fetch_timeout = fetch_timeout
        self.heartbeat_interval = heartbeat_interval
        self.drain_timeout = drain_timeout
        self.max_in_flight = max_in_flight
        self.job_max_age = job_max_age
        """How old a handler's view of its job may be (seconds), unless a negotiation by this controller or an event of
        `JOB_CHANGING_KINDS` made it re-read sooner."""
        self.job_stale_limit = max(job_stale_limit, job_max_age)
        """A view older than this (the job was quiet) is re-read before the handler instead of in the background."""
        self.stats = RuntimeStats()
        self.ready = asyncio.Event()
        """Set once the durable consumer is open and events are being pulled."""
        self._log = _log.getChild(controller.name)
        self._handler_log = logging.getLogger(f"tenant_controllers.handlers.{controller.name}")
        self._latest: dict[tuple[str, str], EventData] = {}
        self._lanes: dict[str, _Lane] = {}
        self._in_flight = 0
        self._held: set[Delivery] = set()
        self._capacity = asyncio.Condition()
        self._stop = asyncio.Event()
        self._acks = CommitThenAck(store, self._log)

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Open the consumer, run until `stop` is set, then drain and close."""
        self._stop = stop
        self._load_latest()
        subscription = Subscription(
            consumer=self.controller.consumer,
            kinds=self.controller.kinds,
            jobs=self.controller.jobs,
            resume_after=self.store.position(self.controller.name, self.controller.consumer),
        )
        if not await self._open(subscription):
            await self.source.close()
            return
        self._start_lanes()
        ticker = asyncio.create_task(self._resync_ticker(), name="hz-resync") if self._resyncs_enabled else None
        heartbeat = asyncio.create_task(self._keep_alive(), name="hz-heartbeat")
        positions = asyncio.create_task(self._position_ticker(), name="hz-position")
        self.ready.set()
        self._log.info(
            "controller %s running: jobs %s, kinds %s, consumer %s",
            self.controller.name, ", ".join(self.controller.jobs),
            ", ".join(self.controller.kinds) or "(resync only)", subscription.consumer,
        )
        patience = self.drain_timeout
        try:
            await self._pull_loop()
        except asyncio.CancelledError:  # told to stop at once (a second signal): do not wait for handlers
            patience = 0.0
            raise
        finally:
            stop.set()
            if ticker is not None:
                ticker.cancel()
                await asyncio.gather(ticker, return_exceptions=True)
            await self._drain(patience)
            await self._acks.drain()  # what the lanes finished is committed and acked before the source closes
            heartbeat.cancel()
            positions.cancel()
            await asyncio.gather(heartbeat, positions, return_exceptions=True)
            await self._record_position()
            await self.source.close()
            self._log.info("controller %s stopped (%s)", self.controller.name, self.stats)

    def _start_lanes(self) -> None:
        """One lane per job. Each job's first read starts now if an event handler will want it: the first event's
        handler would otherwise wait for it, and its lane behind it. With resyncs the first resync, queued at the head
        of every lane, reads the job anyway."""
        self._lanes = {
            job_id: _Lane(job=Job(job_id, api=self.api, latest=self._lookup_latest)) for job_id in self.controller.jobs
        }
        prefetch = not self._resyncs_enabled and any(h.binder.takes("job") for h in self.controller.handlers)
        for lane in self._lanes.values():
            if prefetch:
                lane.job.prefetch()
            lane.task = asyncio.create_task(self._run_lane(lane), name=f"hz-lane-{lane.job.id}")

    @property
    def _resyncs_enabled(self) -> bool:
        return bool(self.controller.resync_handlers) and self.resync_interval is not None

    async def _open(self, subscription: Subscription) -> bool:
        """Open the consumer, retrying transient failures until it works or `stop` is set (False then)."""
        delay = 0.2
        while not self._stop.is_set():
            opening = asyncio.create_task(self.source.open(subscription), name="hz-open")
            stopping = asyncio.create_task(self._stop.wait())
            await asyncio.wait({opening, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not opening.done():  # stopped while waiting for the provider or the broker
                opening.cancel()
                await asyncio.gather(opening, stopping, return_exceptions=True)
                return False
            await asyncio.gather(stopping, return_exceptions=True)
            try:
                opening.result()
                return True
            except PermanentError:
                raise
            except Exception as exc:
                self._log.warning(
                    "cannot open consumer %s yet (%s); retrying in %.1f s", subscription.consumer, exc, delay
                )
            await wait_set(self._stop, delay)
            delay = min(delay * 2, 5.0)
        return False

    async def _drain(self, patience: float) -> None:
        lanes = [lane for lane in self._lanes.values() if lane.task is not None]
        for lane in lanes:
            lane.queue.put_nowait(_STOP)
        tasks = [lane.task for lane in lanes if lane.task is not None]
        if not tasks:
            return
        _, late = await asyncio.wait(tasks, timeout=patience) if patience > 0 else (set(), set(tasks))
        for task in late:
            if not task.done():
                self._log.warning("a handler did not finish within %.0f s of the stop; cancelling it", patience)
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for lane in lanes:
            await lane.job.aclose()

    # -- pulling and routing -----------------------------------------------------------------------------------------

    async def _pull_loop(self) -> None:
        while not self._stop.is_set():
            room = await self._wait_for_room()
            deliveries = await self.source.fetch(batch=min(self.batch, room), timeout=self.fetch_timeout)
            for delivery in deliveries:
                self.stats.received += 1
                if self._stop.is_set():
                    self.stats.handed_back += 1
                    await delivery.nak()
                    continue
                await self._route(delivery)

    async def _wait_for_room(self) -> int:
        async with self._capacity:
            await self._capacity.wait_for(lambda: self._in_flight < self.max_in_flight)
            return self.max_in_flight - self._in_flight

    async def _release(self) -> None:
        async with self._capacity:
            self._in_flight -= 1
            self._capacity.notify_all()

    async def _route(self, delivery: Delivery) -> None:
        try:
            envelope = parse_event(delivery.data)
        except EventError as exc:
            self.stats.terminated += 1
            self._log.warning("dropping an undecodable event on %s: %s", delivery.subject, exc)
            await delivery.term()
            return
        lane = self._lanes.get(envelope.subject)
        if lane is None or not self.controller.handlers_for(envelope.data):
            self.stats.ignored += 1
            await delivery.ack()
            return
        self._in_flight += 1
        self._held.add(delivery)
        lane.queue.put_nowait(_EventItem(envelope, delivery))

    # -- lanes -------------------------------------------------------------------------------------------------------

    async def _run_lane(self, lane: _Lane) -> None:
        while True:
            item = await lane.queue.get()
            if item is _STOP:
                return
            if item is _RESYNC:
                lane.resync_queued = False
                if not self._stop.is_set():
                    await self._guarded(self._resync(lane.job), what=f"resync of {lane.job.id}")
                continue
            try:
                if self._stop.is_set():
                    self.stats.handed_back += 1
                    await item.delivery.nak()
                else:
                    await self._guarded(self._handle(item, lane.job), what=f"event {item.envelope.id}",
                                        delivery=item.delivery)
            finally:
                self._held.discard(item.delivery)
                await self._release()

    async def _guarded(self, work: Any, *, what: str, delivery: Delivery | None = None) -> None:
        """Keep a lane alive whatever happens; a failure of our own (not a handler's) hands the event back."""
        try:
            await work
        except Interrupted:
            if delivery is not None:
                self.stats.handed_back += 1
                await delivery.nak()
        except asyncio.CancelledError:
            raise
        except Exception:
            self._log.exception("internal error while processing %s; it will be redelivered", what)
            if delivery is not None:
                await delivery.nak(delay=1.0)

    async def _handle(self, item: _EventItem, job: Job) -> None:
        envelope, delivery = item.envelope, item.delivery
        name = self.controller.name
        finished = self.store.finished_handlers(name, envelope.id)
        pending = [h for h in self.controller.handlers_for(envelope.data) if h.id not in finished]
        if not pending:
            self.stats.duplicates += 1
            self._log.info("event %s was already handled; acking the redelivery", envelope.id)
            self._acks.ack_after_commit(delivery)  # its records may still be staged
            return
        newest = self._observe(envelope, delivery.data)
        if envelope.data.KIND in JOB_CHANGING_KINDS:
            job.invalidate()
        for handler in pending:
            if not handler.matches(envelope.data):
                continue
            if handler.latest_only and not newest:
                self.stats.stale += 1
                self.store.stage(name, envelope.id, handler.id, status=Status.STALE)
                continue
            await self._run_event_handler(handler, envelope, job)
        self._acks.ack_after_commit(delivery)  # with its records and its newest observation

    async def _run_event_handler(self, handler: EventHandler, envelope: CloudEvent[Any], job: Job) -> None:
        what = f"handler {handler.id} on {envelope.data.KIND.value} event {envelope.id} (job {envelope.subject})"
        outcome = await run_with_retries(
            functools.partial(self._attempt, handler, envelope, job),
            policy=handler.policy,
            stop=self._stop,
            what=what,
            logger=self._log,
        )
        name = self.controller.name
        if isinstance(outcome, Done):
            self.stats.handled += 1
            self.store.stage(name, envelope.id, handler.id, status=Status.DONE, outcome=outcome.value)
        else:
            assert isinstance(outcome, GaveUp)
            self.stats.gave_up += 1
            self.store.stage(name, envelope.id, handler.id, status=Status.GAVE_UP, outcome=outcome.describe())

    async def _attempt(self, handler: EventHandler, envelope: CloudEvent[Any], job: Job, number: int) -> Any:
        trace = child_traceparent(envelope.traceparent) if envelope.traceparent else None
        failed = envelope.data.host if isinstance(envelope.data, Failure) else None
        current = HandlerInvocation(
            self.controller.name, envelope.id, handler.id, number, traceparent=trace, failed_host=failed
        )
        with invocation(current):
            if handler.binder.takes("job"):  # a handler that cannot see the job does not wait for, or cause, a read
                await job.ensure_fresh(self.job_max_age, stale_limit=self.job_stale_limit)
            args, kwargs = handler.binder.arguments(
                {"payload": envelope.data, "job": job, "envelope": envelope, "logger": self._handler_log}
            )
            return await call_handler(handler.fn, args, kwargs)

    async def _keep_alive(self) -> None:
        """Extend the ack deadline of every delivery we hold (queued or being handled) well within the ack wait."""
        interval = self.heartbeat_interval
        ack_wait = getattr(self.source, "ack_wait", None)
        if ack_wait:
            interval = min(interval, ack_wait / 3)
        source_keep_alive = getattr(self.source, "keep_alive", None)  # optional: see sources.EventSource
        while True:
            await asyncio.sleep(interval)
            for delivery in list(self._held):
                await delivery.in_progress()
            if source_keep_alive is not None:
                await source_keep_alive()

    async def _position_ticker(self) -> None:
        """Its own task: asking the broker for the ack floor may take a while when it is busy or restarting, and must
        not delay the heartbeat that keeps held events' ack deadlines."""
        if getattr(self.source, "position", None) is None:
            return
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            await self._record_position()

    async def _record_position(self) -> None:
        """Record where the broker has every event acked, for a source whose consumer the broker may lose
        (optional: see sources.EventSource); the next start, or the source itself, resumes after it."""
        source_position = getattr(self.source, "position", None)
        if source_position is None:
            return
        try:
            position = await source_position()
            if position is not None:
                self.store.save_position(self.controller.name, self.controller.consumer, position)
        except Exception as exc:  # a full disk, say: the next heartbeat tries again, the events flow on
            self._log.warning("could not record the consumer's position (%r)", exc)

    # -- resync ------------------------------------------------------------------------------------------------------

    async def _resync_ticker(self) -> None:
        assert self.resync_interval is not None
        while not self._stop.is_set():
            for lane in self._lanes.values():
                if not lane.resync_queued:
                    lane.resync_queued = True
                    lane.queue.put_nowait(_RESYNC)
            await wait_set(self._stop, self.resync_interval)

    async def _resync(self, job: Job) -> None:
        for handler in self.controller.resync_handlers:
            await run_with_retries(
                functools.partial(self._resync_attempt, handler, job),
                policy=handler.policy,
                stop=self._stop,
                what=f"resync handler {handler.id} (job {job.id})",
                logger=self._log,
            )
        self.stats.resyncs += 1

    async def _resync_attempt(self, handler: ResyncHandler, job: Job, _number: int) -> Any:
        await job.refresh()
        args, kwargs = handler.binder.arguments({"job": job, "logger": self._handler_log})
        return await call_handler(handler.fn, args, kwargs)

    # -- newest observations -----------------------------------------------------------------------------------------

    def _observe(self, envelope: CloudEvent[Any], raw: bytes) -> bool:
        """Keep the newest event of its type; stored as it arrived (it decoded once, so it will again after restart)."""
        newest = self.store.observe(
            self.controller.name,
            envelope.subject,
            envelope.type,
            time_=envelope.time,
            event_id=envelope.id,
            event=_as_stored_text(envelope, raw),
        )
        if newest:
            self._latest[(envelope.subject, envelope.type)] = envelope.data
        return newest

    def _load_latest(self) -> None:
        for (job, event_type), raw in self.store.latest(self.controller.name).items():
            try:
                self._latest[(job, event_type)] = parse_event(raw).data
            except EventError:
                continue

    def _lookup_latest(self, job: str, model: type[EventData]) -> EventData | None:
        return self._latest.get((job, model.event_type()))



def _as_stored_text(envelope: CloudEvent[Any], raw: bytes) -> str:
    """The event as received when that is plain UTF-8 JSON text; otherwise (UTF-16, a BOM: JSON decoding accepts
    them, `parse_event` of the stored text would not) the envelope re-serialised."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return envelope.to_json_bytes().decode()
    return envelope.to_json_bytes().decode() if text.startswith("\ufeff") else text
