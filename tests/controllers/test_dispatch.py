"""Fast tier: handlers are typed, filtered by job, bound by signature; the runtime routes, acks and ignores correctly.

Runs over `MemoryBroker` (a real in-process transport with JetStream's semantics) and the fake provider API.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from harmonaize.events import CarbonIntensity, CloudEvent, Congestion, Failure, FailureKind
from tenant_controllers import Controller, Job
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.controller import consumer_name
from tenant_controllers.memory import MemoryBroker, MemoryEventSource
from tenant_controllers.store import HandledStore
from tests.controllers.fake_provider import FakeProvider
from tests.controllers.support import carbon, failure, running
from tests.support import eventually


async def test_handlers_get_typed_payloads_and_only_their_jobs_events(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore
) -> None:
    ctl = Controller(tenant="acme", job="llm-finetune")
    seen: list[tuple[str, Any, str, int]] = []

    @ctl.on(Failure)
    async def on_failure(event: Failure, job: Job) -> None:
        seen.append(("failure", event, job.id, job.workers))

    @ctl.on(CarbonIntensity)
    async def on_carbon(event: CarbonIntensity, job: Job) -> None:
        seen.append(("carbon", event, job.id, job.workers))

    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as runtime:
        bus.publish(failure(job="other-job"))
        bus.publish(failure())
        bus.publish(carbon(180))
        await eventually(lambda: len(seen) == 2, what="two handled events")
    assert [(name, type(payload), job, workers) for name, payload, job, workers in seen] == [
        ("failure", Failure, "llm-finetune", 2),
        ("carbon", CarbonIntensity, "llm-finetune", 2),
    ]
    assert seen[1][1].g_per_kwh == 180
    assert runtime.stats.handled == 2
    assert ctl.kinds == ("carbon", "failure")


async def test_runtime_drops_other_jobs_and_unhandled_kinds_even_when_the_source_delivers_them(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore
) -> None:
    """The consumer's filter is the first line; the runtime's own routing is the second."""
    ctl = Controller(tenant="acme", job="llm-finetune")
    calls: list[str] = []

    @ctl.on(Failure)
    async def on_failure(event: Failure) -> None:
        calls.append(event.kind.value)

    source = MemoryEventSource(bus)
    async with running(ctl, source=source, api=api, store=store) as runtime:
        assert source.subscription is not None and source.subscription.jobs == ("llm-finetune",)
        bus._consumers[ctl.consumer].subscription = type(source.subscription)(ctl.consumer, (), ())  # widen it
        bus.publish(failure(job="other-job"))
        bus.publish(carbon(100))
        bus.publish_raw("hz.t.acme.events.failure.llm-finetune", b'{"not": "a cloudevent"}')
        bus.publish(failure(kind=FailureKind.GPU_ERROR))
        await eventually(lambda: calls == ["gpu_error"], what="only our job's failure handled")
        await eventually(lambda: runtime.stats.ignored == 2 and runtime.stats.terminated == 1, what="routing counts")
    assert bus.consumer_state(ctl.consumer) == (3, 0), "everything settled: 3 acked, the malformed one terminated"


async def test_handler_may_ask_for_the_envelope_and_a_logger_and_may_be_sync(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore
) -> None:
    ctl = Controller(tenant="acme", job="llm-finetune")
    got: dict[str, Any] = {}

    @ctl.on(Failure)
    async def with_envelope(envelope: CloudEvent[Failure], log: logging.Logger, *, job: Job) -> None:
        got["envelope"] = envelope
        got["logger"] = log
        got["job"] = job

    @ctl.on(Failure, id="sync-handler")
    def plain(event: Failure) -> str:
        got["sync"] = event.kind
        return "done"

    published = failure()
    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as runtime:
        bus.publish(published)
        await eventually(lambda: runtime.stats.handled == 2, what="both handlers")
    assert got["envelope"].id == published.id and isinstance(got["envelope"].data, Failure)
    assert isinstance(got["logger"], logging.Logger)
    assert got["job"].id == "llm-finetune"
    assert got["sync"] is FailureKind.HOST_DOWN
    assert {r.handler: r.outcome for r in store.records()} == {"sync-handler": "done",
                                                               with_envelope.__qualname__: None}


def test_a_parameter_the_sdk_cannot_fill_fails_at_decoration() -> None:
    ctl = Controller(job="j")
    with pytest.raises(TypeError, match="parameter 'mystery'"):
        @ctl.on(Failure)
        async def bad(event: Failure, mystery: int) -> None: ...

    with pytest.raises(TypeError, match="parameter 'event'"):
        @ctl.on(Failure)
        async def wrong_model(event: Congestion) -> None: ...

    with pytest.raises(TypeError, match="parameter 'event'"):
        @ctl.on_resync
        async def resync_cannot_take_events(event: Failure) -> None: ...

    with pytest.raises(TypeError, match="event model"):
        ctl.on("failure")  # type: ignore[arg-type]


def test_handler_ids_are_unique_and_controllers_need_a_job() -> None:
    ctl = Controller(job="j")

    @ctl.on(Failure)
    async def one(event: Failure) -> None: ...

    with pytest.raises(ValueError, match="two handlers"):
        ctl.on(Failure, id=one.__qualname__)(one)
    with pytest.raises(ValueError, match="job="):
        Controller(tenant="acme")
    with pytest.raises(ValueError, match="invalid job id"):
        Controller(job="Bad.Job")


def test_consumer_names_are_valid_ids_derived_from_job_and_name() -> None:
    assert consumer_name("guard", ["llm-finetune"]) == "ctl-llm-finetune-guard"
    several = consumer_name("guard", ["b", "a"])
    assert several.startswith("ctl-guard-") and several == consumer_name("guard", ["a", "b"])
    long = consumer_name("n" * 40, ["j" * 63])
    assert len(long) <= 63 and long != consumer_name("n" * 41, ["j" * 63])


async def test_a_handlers_job_view_is_reread_only_when_stale_or_after_our_own_negotiation(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore, provider: FakeProvider
) -> None:
    """Re-reading the job before every event capped a controller at one REST round trip per event; the view is
    re-read when older than `job_max_age`, and at once after this controller negotiated."""
    ctl = Controller(tenant="acme", job="llm-finetune")
    seen: list[int] = []

    @ctl.on(CarbonIntensity)
    async def on_carbon(event: CarbonIntensity, job: Job) -> None:
        seen.append(job.workers)
        if event.g_per_kwh == 150:
            await job.negotiate(scale_to=3)

    def job_reads() -> int:
        return sum(1 for r in provider.requests if r.method == "GET" and r.url.path == "/v1/jobs/llm-finetune")

    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store, job_max_age=3600.0):
        for intensity in (100, 110, 120):
            bus.publish(carbon(intensity))
        await eventually(lambda: len(seen) == 3, what="three events handled")
        assert job_reads() == 1, "one read serves events within job_max_age"
        provider.jobs["llm-finetune"]["desired_workers"] = 3  # changed behind our back: seen after max age only
        bus.publish(carbon(150))
        await eventually(lambda: len(seen) == 4, what="the negotiating event")
        bus.publish(carbon(160))
        await eventually(lambda: len(seen) == 5, what="the event after our negotiation")
    assert job_reads() == 2, "our own negotiation made the next handler re-read the job"
    assert seen == [2, 2, 2, 2, 3]


async def test_an_event_that_says_the_job_changed_has_its_handlers_see_the_job_re_read(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore, provider: FakeProvider
) -> None:
    """The bounded-age view is a safety net: a job that restarted at a new shape (or a negotiation's outcome, or a lost
    host) is re-read before the handlers of that event, whatever `job_max_age` says; frequent kinds are not."""
    from harmonaize.events import JobUpdate, make_event
    from harmonaize.jobs import ParallelPlan
    from tests.controllers.support import T0

    ctl = Controller(tenant="acme", job="llm-finetune")
    seen: list[tuple[str, int]] = []

    @ctl.on(CarbonIntensity)
    async def on_carbon(job: Job) -> None:
        seen.append(("carbon", job.workers))

    @ctl.on(JobUpdate)
    async def on_job(event: JobUpdate, job: Job) -> None:
        seen.append(("job", job.workers))

    restarted = make_event(JobUpdate(epoch=2, world_size=3, parallel_plan=ParallelPlan.DDP, step=40, at=T0),
                           source="/hz/provider/jobs", subject="llm-finetune", time=T0)
    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store, job_max_age=3600.0):
        bus.publish(carbon(100))
        await eventually(lambda: len(seen) == 1, what="the first event")
        provider.jobs["llm-finetune"]["desired_workers"] = 3  # the job grew; the next two events come after
        bus.publish(carbon(110))
        await eventually(lambda: len(seen) == 2, what="a frequent event")
        bus.publish(restarted)
        await eventually(lambda: len(seen) == 3, what="the job's restart")
        bus.publish(carbon(120))
        await eventually(lambda: len(seen) == 4, what="the event after it")
    assert seen == [("carbon", 2), ("carbon", 2), ("job", 3), ("carbon", 3)]


async def test_a_handler_that_does_not_take_the_job_never_has_it_read(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore, provider: FakeProvider
) -> None:
    """Reading the job is for handlers that see it: one that takes only the event costs the provider nothing."""
    ctl = Controller(tenant="acme", job="llm-finetune")
    blind: list[float] = []
    sighted: list[int] = []

    @ctl.on(CarbonIntensity)
    async def on_carbon(event: CarbonIntensity) -> None:
        blind.append(event.g_per_kwh)

    def job_reads() -> int:
        return sum(1 for r in provider.requests if r.method == "GET" and r.url.path == "/v1/jobs/llm-finetune")

    every_time = {"job_max_age": 0.0, "job_stale_limit": 0.0}  # a read before each handler that takes the job
    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store, **every_time):
        for intensity in (100, 110, 120):
            bus.publish(carbon(intensity))
        await eventually(lambda: len(blind) == 3, what="three events handled")
    assert job_reads() == 0

    sighted_ctl = Controller(tenant="acme", job="llm-finetune", name="sighted")

    @sighted_ctl.on(CarbonIntensity)
    async def on_carbon_with_job(job: Job) -> None:
        sighted.append(job.workers)

    async with running(sighted_ctl, source=MemoryEventSource(bus), api=api, store=store, **every_time):
        await eventually(lambda: len(sighted) == 3, what="the same events, handled with the job")
    # the start-up read (prefetch) plus one per handler: with a max age of 0 no view, not even a fresh one, will do
    assert job_reads() == 1 + 3 and sighted == [2, 2, 2]


async def test_the_runtime_reads_the_job_at_start_up_only_for_handlers_that_take_it(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore, provider: FakeProvider
) -> None:
    """The first event after start-up found no view and waited a whole round trip, its lane's events behind it; the
    runtime now starts that read as it starts. A controller whose handlers never see the job still costs nothing."""

    def job_reads() -> int:
        return sum(1 for r in provider.requests if r.method == "GET" and r.url.path == "/v1/jobs/llm-finetune")

    sighted_ctl = Controller(tenant="acme", job="llm-finetune", name="sighted")
    seen: list[int] = []

    @sighted_ctl.on(CarbonIntensity)
    async def on_carbon_with_job(job: Job) -> None:
        seen.append(job.workers)

    async with running(sighted_ctl, source=MemoryEventSource(bus), api=api, store=store, job_max_age=3600.0):
        await eventually(lambda: job_reads() == 1, what="the read started with the runtime, before any event")
        bus.publish(carbon(100))
        bus.publish(carbon(110))
        await eventually(lambda: len(seen) == 2, what="two events handled")
    assert job_reads() == 1, "the handlers used the start-up read"
    assert seen == [2, 2]

    blind_ctl = Controller(tenant="acme", job="llm-finetune", name="blind")
    blind: list[float] = []

    @blind_ctl.on(CarbonIntensity)
    async def on_carbon(event: CarbonIntensity) -> None:
        blind.append(event.g_per_kwh)

    async with running(blind_ctl, source=MemoryEventSource(bus), api=api, store=store):
        await eventually(lambda: blind == [100, 110], what="the same events handled by a controller blind to the job")
    assert job_reads() == 1, "no read for it"


async def test_with_resyncs_the_first_resync_is_the_start_up_read(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore, provider: FakeProvider
) -> None:
    """The first resync, queued first in every lane, reads the job anyway: a start-up read beside it would be a
    second request for the same answer."""
    ctl = Controller(tenant="acme", job="llm-finetune")
    resynced: list[int] = []
    seen: list[int] = []

    @ctl.on_resync
    async def converge(job: Job) -> None:
        resynced.append(job.workers)

    @ctl.on(CarbonIntensity)
    async def on_carbon(job: Job) -> None:
        seen.append(job.workers)

    def job_reads() -> int:
        return sum(1 for r in provider.requests if r.method == "GET" and r.url.path == "/v1/jobs/llm-finetune")

    options = {"resync_interval": 3600.0, "job_max_age": 3600.0}
    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store, **options):
        bus.publish(carbon(100))
        await eventually(lambda: resynced == [2] and seen == [2], what="the first resync and an event")
    assert job_reads() == 1
