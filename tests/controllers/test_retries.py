"""Fast tier: what a handler's outcome means (kopf's rules), and stopping in the middle of it."""

from __future__ import annotations

import asyncio
import time
from itertools import pairwise

from harmonaize.events import Failure
from tenant_controllers import Controller, PermanentError, TemporaryError
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.memory import MemoryBroker, MemoryEventSource
from tenant_controllers.runtime import ControllerRuntime
from tenant_controllers.store import HandledStore, Status
from tests.controllers.support import failure, running
from tests.support import eventually


async def test_temporary_error_retries_after_its_delay_then_the_outcome_is_recorded(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore
) -> None:
    ctl = Controller(job="llm-finetune")
    attempts: list[float] = []

    @ctl.on(Failure, retries=3, backoff=5.0)
    async def flaky(event: Failure) -> str:
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise TemporaryError("not yet", delay=0.05)
        return "ok"

    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as runtime:
        bus.publish(failure())
        await eventually(lambda: runtime.stats.handled == 1, what="handled after two temporary errors")
    assert len(attempts) == 3
    assert all(later - earlier >= 0.045 for earlier, later in pairwise(attempts)), "delay= replaced backoff"
    [record] = store.records()
    assert (record.status, record.outcome) == (Status.DONE, "ok")
    assert bus.consumer_state(ctl.consumer) == (1, 0)


async def test_permanent_error_gives_up_at_once_acks_and_is_never_retried(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore
) -> None:
    ctl = Controller(job="llm-finetune")
    calls: list[str] = []

    @ctl.on(Failure, retries=5, backoff=0.01)
    async def hopeless(event: Failure) -> None:
        calls.append("x")
        raise PermanentError("cannot do anything about this failure")

    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as runtime:
        bus.publish(failure())
        await eventually(lambda: runtime.stats.gave_up == 1, what="gave up")
        await eventually(lambda: bus.consumer_state(ctl.consumer) == (1, 0), what="acked")
        await asyncio.sleep(bus.ack_wait * 2)  # an unacked event would have been redelivered by now
    assert calls == ["x"]
    [record] = store.records()
    assert record.status == Status.GAVE_UP and "cannot do anything" in record.outcome


async def test_other_exceptions_are_retried_with_backoff_up_to_retries_then_given_up(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore
) -> None:
    ctl = Controller(job="llm-finetune")
    attempts: list[float] = []

    @ctl.on(Failure, retries=2, backoff=0.04)
    async def broken(event: Failure) -> None:
        attempts.append(time.monotonic())
        raise RuntimeError("bug")

    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as runtime:
        bus.publish(failure())
        await eventually(lambda: runtime.stats.gave_up == 1, what="gave up after the retries")
    assert len(attempts) == 3, "one attempt plus retries=2"
    gaps = [later - earlier for earlier, later in pairwise(attempts)]
    assert gaps[0] >= 0.035 and gaps[1] >= 0.075, f"exponential backoff 0.04 s, 0.08 s: got {gaps}"
    assert store.records()[0].outcome == "RuntimeError: bug"
    assert bus.consumer_state(ctl.consumer) == (1, 0)


async def test_temporary_errors_count_against_retries_too(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore
) -> None:
    ctl = Controller(job="llm-finetune")
    calls: list[int] = []

    @ctl.on(Failure, retries=1)
    async def never_ready(event: Failure) -> None:
        calls.append(1)
        raise TemporaryError("still not ready", delay=0.01)

    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as runtime:
        bus.publish(failure())
        await eventually(lambda: runtime.stats.gave_up == 1, what="gave up")
    assert len(calls) == 2


async def test_stop_during_a_retry_wait_hands_the_event_back_and_the_next_run_finishes_it(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore
) -> None:
    ctl = Controller(job="llm-finetune")
    calls: list[int] = []

    @ctl.on(Failure, retries=10)
    async def slow_to_succeed(event: Failure) -> str:
        calls.append(1)
        if len(calls) == 1:
            raise TemporaryError("come back in a minute", delay=60)
        return "second run"

    started = time.monotonic()
    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as runtime:
        bus.publish(failure())
        await eventually(lambda: calls == [1], what="first attempt")
    assert time.monotonic() - started < 5, "the stop did not wait out the 60 s delay"
    assert runtime.stats.handed_back >= 1 and runtime.stats.handled == 0 and store.records() == []
    assert bus.consumer_state(ctl.consumer) == (0, 1), "nak'ed, still pending in the broker"

    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as again:
        await eventually(lambda: again.stats.handled == 1, what="handled by the next run")
    assert store.records()[0].outcome == "second run"


async def test_stop_lets_a_running_handler_finish_and_hands_queued_events_back(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore
) -> None:
    ctl = Controller(job="llm-finetune")
    release = asyncio.Event()
    finished: list[str] = []

    @ctl.on(Failure)
    async def slow(event: Failure) -> None:
        await release.wait()
        finished.append(event.kind.value)

    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as runtime:
        for _ in range(3):
            bus.publish(failure())
        await eventually(lambda: runtime.stats.received == 3, what="all three fetched")
        asyncio.get_running_loop().call_later(0.1, release.set)
    assert finished == ["host_down"], "the running handler finished; the two queued ones were not started"
    assert runtime.stats.handed_back == 2
    assert bus.consumer_state(ctl.consumer) == (1, 2)


async def test_a_slow_handler_keeps_its_delivery_alive(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore
) -> None:
    """The ack wait is 0.3 s here; a 1 s handler must not see its event redelivered meanwhile."""
    ctl = Controller(job="llm-finetune")
    calls: list[int] = []

    @ctl.on(Failure)
    async def slow(event: Failure) -> None:
        calls.append(1)
        await asyncio.sleep(1.0)

    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store, heartbeat_interval=0.1) as runtime:
        bus.publish(failure())
        await eventually(lambda: runtime.stats.handled == 1, timeout=5, what="slow handler done")
    assert calls == [1] and runtime.stats.duplicates == 0 and runtime.stats.received == 1


async def test_cancelling_the_runtime_does_not_wait_for_handlers(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore
) -> None:
    """What a second Ctrl-C does: the runner cancels, and the runtime gives up on running handlers at once."""
    ctl = Controller(job="llm-finetune", name="impatient")
    started = asyncio.Event()

    @ctl.on(Failure)
    async def stuck(event: Failure) -> None:
        started.set()
        await asyncio.sleep(3600)

    runtime = ControllerRuntime(ctl, source=MemoryEventSource(bus), api=api, store=store, fetch_timeout=0.05,
                                resync_interval=None, drain_timeout=3600)
    task = asyncio.create_task(runtime.run(asyncio.Event()))
    bus.publish(failure())
    await asyncio.wait_for(started.wait(), timeout=5)
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    assert task.cancelled() and store.records() == []
    assert bus.consumer_state(ctl.consumer) == (0, 1), "unfinished: the broker redelivers it to the next run"
