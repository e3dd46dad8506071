"""`ControllerHarness`: run a controller against an in-memory broker and a fake provider, in one `async with`.

The controller runs in the real `ControllerRuntime` (the same delivery, de-duplication, retry and ack logic as under
`harmonaize controller run`); only the two transports are swapped, as the SDK's seams allow: events come from a
`MemoryBroker` (JetStream's at-least-once semantics, in process) and the REST calls go to a `FakeProvider`. So what a
test sees is what the controller would do in a cloud, minus the cloud.

Faults a test can inject: on the bus, a duplicate publish (`publish(..., duplicate=True)`) and random drops, copies,
reordering and lost acks (`faults=Faults(...)`); a crash and restart of the controller (`restart(crash=True)`: what it
had not acked comes back after the ack wait); a cut connection to the broker (`async with h.disconnected():`); and on
the API, errors, lost replies and slow answers (`h.provider.fail_next(...)`, `h.provider.slow_next(...)`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, TypeVar

from harmonaize.events import CONTROL_PLANE_SOURCE, CloudEvent, EventData, agent_source, is_host_pseudonym, make_event
from harmonaize.tracing import new_traceparent
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.controller import Controller
from tenant_controllers.errors import TemporaryError
from tenant_controllers.memory import Faults, MemoryBroker, MemoryEventSource
from tenant_controllers.runtime import ControllerRuntime, RuntimeStats
from tenant_controllers.sources import Delivery, Subscription
from tenant_controllers.store import HandledRecord, HandledStore
from tenant_controllers.testing.provider import FakeProvider

__all__ = ["ControllerHarness", "provider_event"]

DataT = TypeVar("DataT", bound=EventData)


def provider_event(
    data: DataT, *, job: str, time: datetime | None = None, event_id: str | None = None
) -> CloudEvent[DataT]:
    """Wrap `data` in the CloudEvent the provider would publish about `job`.

    As the provider does: a payload naming a host comes from that host's agent (`/hz/provider/agent/h-...`), anything
    else from the control plane; the subject is the job; each event starts a new trace. `time` defaults to now.
    """
    host = getattr(data, "host", None)
    source = agent_source(host) if isinstance(host, str) and is_host_pseudonym(host) else CONTROL_PLANE_SOURCE
    return make_event(
        data, source=source, subject=job, time=time or datetime.now(UTC), event_id=event_id,
        traceparent=new_traceparent(),
    )


class _Link:
    """The controller's connection to the broker; a test cuts it with `ControllerHarness.disconnected`."""

    def __init__(self) -> None:
        self._up = True

    def is_up(self) -> bool:
        """A call, not an attribute, so a check after an `await` is not narrowed away by the type checker."""
        return self._up

    def set_up(self, up: bool) -> None:
        self._up = up


class _LinkedDelivery:
    """A delivery whose acks are lost while the link is down (the broker then delivers it again)."""

    def __init__(self, inner: Delivery, link: _Link) -> None:
        self._inner = inner
        self._link = link

    @property
    def data(self) -> bytes:
        return self._inner.data

    @property
    def subject(self) -> str:
        return self._inner.subject

    @property
    def num_delivered(self) -> int:
        return self._inner.num_delivered

    async def ack(self) -> None:
        if self._link.is_up():
            await self._inner.ack()

    async def nak(self, delay: float | None = None) -> None:
        if self._link.is_up():
            await self._inner.nak(delay)

    async def in_progress(self) -> None:
        if self._link.is_up():
            await self._inner.in_progress()

    async def term(self) -> None:
        if self._link.is_up():
            await self._inner.term()


class _LinkedSource:
    """A `MemoryEventSource` behind a link that can go down: no deliveries, and opening fails, until it is back."""

    def __init__(self, broker: MemoryBroker, link: _Link) -> None:
        self._inner = MemoryEventSource(broker)
        self._link = link

    @property
    def ack_wait(self) -> float:
        return self._inner.ack_wait

    async def open(self, subscription: Subscription) -> None:
        if not self._link.is_up():
            raise TemporaryError("the broker is unreachable (disconnected by the test)")
        await self._inner.open(subscription)

    async def fetch(self, *, batch: int, timeout: float) -> Sequence[Delivery]:
        if not self._link.is_up():
            await asyncio.sleep(timeout)
            return []
        deliveries = await self._inner.fetch(batch=batch, timeout=timeout)
        if not self._link.is_up():  # cut while waiting: lost in transit, delivered again after the ack wait
            return []
        return [_LinkedDelivery(delivery, self._link) for delivery in deliveries]

    async def close(self) -> None:
        await self._inner.close()


class ControllerHarness:
    """Runs `controller` for the duration of an `async with` block; publish events in, read what it negotiated.

    Every job of the controller that `provider` does not know yet is added to it with `workers`, `min_workers`,
    `max_workers`, `capacity` and `plan`. Further keyword arguments go to `ControllerRuntime` (the harness defaults to
    a short fetch timeout and no periodic resync; pass `resync_interval=` to exercise `@ctl.on_resync`).
    """

    def __init__(
        self,
        controller: Controller,
        *,
        provider: FakeProvider | None = None,
        tenant: str | None = None,
        workers: int = 2,
        min_workers: int = 1,
        max_workers: int = 4,
        capacity: int | None = None,
        plan: str = "ddp",
        faults: Faults | None = None,
        ack_wait: float = 0.5,
        store: HandledStore | None = None,
        start_timeout: float = 10.0,
        **runtime_options: Any,
    ) -> None:
        self.controller = controller
        tenant = tenant or controller.tenant or (provider.tenant if provider is not None else "acme")
        self.provider = provider if provider is not None else FakeProvider(tenant=tenant)
        for job in controller.jobs:
            if job not in self.provider.jobs:
                self.provider.add_job(job, min_workers=min_workers, max_workers=max_workers, desired=workers,
                                      plan=plan, capacity=capacity)
        self.broker = MemoryBroker(tenant=tenant, faults=faults, ack_wait=ack_wait)
        self._own_store = store is None
        self.store = store if store is not None else HandledStore(":memory:")
        self.start_timeout = start_timeout
        self._options: dict[str, Any] = {"fetch_timeout": 0.05, "resync_interval": None, **runtime_options}
        self._link = _Link()
        self._api: ProviderApi | None = None
        self._runtime: ControllerRuntime | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._final_records: list[HandledRecord] | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    async def __aenter__(self) -> ControllerHarness:
        if not self.controller.has_name:
            self.controller.set_default_name("test")
        self._api = ProviderApi(base_url="http://provider.test", token=self.provider.token,
                                transport=self.provider.transport, retry_delay=0.01)
        try:
            await self._start()
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self._halt(crash=False)
        finally:
            await self._close()

    async def restart(self, *, crash: bool = False) -> None:
        """Stop the controller and start it again on the same broker and store, as a restarted process would.

        `crash=True` kills it instead of stopping it: handlers are cancelled mid-way and nothing they had not finished
        is acked, so the broker delivers those events again after the ack wait.
        """
        await self._halt(crash=crash)
        await self._start()

    @contextlib.asynccontextmanager
    async def disconnected(self) -> AsyncIterator[None]:
        """Cut the controller off the broker for the block: nothing is delivered and acks are lost (so those events
        come again); events published meanwhile wait in the stream."""
        self._link.set_up(False)
        try:
            yield
        finally:
            self._link.set_up(True)

    async def _start(self) -> None:
        assert self._api is not None
        runtime = ControllerRuntime(
            self.controller, source=_LinkedSource(self.broker, self._link), api=self._api, store=self.store,
            **self._options,
        )
        self._stop = asyncio.Event()
        task = asyncio.create_task(runtime.run(self._stop), name=f"hz-harness-{self.controller.name}")
        ready = asyncio.create_task(runtime.ready.wait(), name="hz-harness-ready")
        await asyncio.wait({task, ready}, timeout=self.start_timeout, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            await asyncio.gather(ready, return_exceptions=True)
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            task.result()  # the runtime's own error, if it failed
            raise TimeoutError(f"the controller did not become ready within {self.start_timeout} s")
        self._runtime, self._task = runtime, task

    async def _halt(self, *, crash: bool) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        if crash:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return
        self._stop.set()
        await asyncio.wait_for(task, timeout=30)  # re-raises what the runtime raised

    async def _close(self) -> None:
        if self._api is not None:
            await self._api.aclose()
            self._api = None
        if self._own_store and self._final_records is None:
            self._final_records = self.records  # readable after the block, once the store is closed
            self.store.close()

    # -- driving it --------------------------------------------------------------------------------------------------

    async def publish(
        self,
        event: EventData | CloudEvent[Any],
        *,
        job: str | None = None,
        duplicate: bool = False,
        time: datetime | None = None,
        event_id: str | None = None,
    ) -> CloudEvent[Any]:
        """Publish an event as the provider would (a payload is wrapped by `provider_event`); returns the envelope.

        `job` may be left out when the controller has one job. `duplicate=True` stores the same CloudEvent twice under
        two message ids, as a provider that republished after a crash would: the controller must handle it once.
        """
        if isinstance(event, CloudEvent):
            envelope: CloudEvent[Any] = event
        else:
            envelope = provider_event(event, job=job or self._only_job(), time=time, event_id=event_id)
        self.broker.publish(envelope)
        if duplicate:
            self.broker.publish(envelope, msg_id=f"{envelope.id}#republished")
        await asyncio.sleep(0)
        return envelope

    async def settle(self, timeout: float = 5.0) -> None:
        """Wait until the controller has taken every stored event of its subscription and settled each one (handled
        and acked, or terminated): after this, what the handlers did is visible in the provider and in `records`."""
        deadline = time.monotonic() + timeout
        while not self._settled():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the controller did not settle its events within {timeout} s ({self.stats})")
            await asyncio.sleep(0.005)

    def _settled(self) -> bool:
        consumer = self.broker._consumers.get(self.controller.consumer)
        return consumer is not None and consumer.next_seq > self.broker.stored and not consumer.pending

    def _only_job(self) -> str:
        if len(self.controller.jobs) != 1:
            raise ValueError(f"the controller has jobs {list(self.controller.jobs)}: say which with job=")
        return self.controller.jobs[0]

    # -- what a test reads -------------------------------------------------------------------------------------------

    @property
    def runtime(self) -> ControllerRuntime:
        """The running runtime (a new one after `restart`)."""
        if self._runtime is None:
            raise RuntimeError("the harness is not running: use `async with ControllerHarness(...) as h`")
        return self._runtime

    @property
    def stats(self) -> RuntimeStats:
        """The current runtime's counters (handled, gave_up, duplicates, ...)."""
        return self.runtime.stats

    @property
    def records(self) -> list[HandledRecord]:
        """Each handler's recorded outcome per event (`status` done / gave_up / stale, `outcome` its return value or
        error), oldest first; still readable after the `async with` block."""
        if self._final_records is not None:
            return list(self._final_records)
        return self.store.records(self.controller.name)

    def job(self, job_id: str | None = None) -> dict[str, Any]:
        """The job as the fake provider has it now (`desired_workers`, `parallel_plan`, ...)."""
        return self.provider.jobs[job_id or self._only_job()]
