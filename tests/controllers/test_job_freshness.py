"""A handler's view of its job: bounded in age, refreshed in the background, never older than our own negotiation.

The clock is injected and each `get_job` waits on a gate the test opens, so every interleaving here is chosen by the
test, not by timing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tenant_controllers.job import Job
from tests.support import ManualClock


class GatedApi:
    """Answers `get_job` with the current `workers`, each read held until the test releases it."""

    def __init__(self) -> None:
        self.workers = 2
        self.reads = 0
        self.gates: list[asyncio.Event] = []

    async def get_job(self, job_id: str) -> dict[str, Any]:
        self.reads += 1
        answer = {"id": job_id, "name": job_id, "desired_workers": self.workers, "min_workers": 1, "max_workers": 8,
                  "gpus_per_worker": 1, "parallel_plan": "ddp", "checkpoint_interval_steps": {"min": 100, "max": 1000},
                  "gradient_compression": {"allowed": ["none"]}, "batch_size": None,
                  "gradient_accumulation": {"min": 1, "max": 1}, "entrypoint": [], "placement_epoch": 0,
                  "created_at": "2026-01-01T00:00:00Z"}
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        return answer

    def release(self) -> None:
        for gate in self.gates:
            gate.set()


async def until(condition: Any, what: str) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0.001)


@pytest.fixture
def api() -> GatedApi:
    return GatedApi()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


async def loaded(api: GatedApi, clock: ManualClock) -> Job:
    job = Job("j1", api=api, clock=clock)  # type: ignore[arg-type]
    first = asyncio.create_task(job.ensure_fresh(1.0))
    await until(lambda: api.reads == 1, "first read")
    assert not first.done(), "with no view at all, the handler must wait for the provider"
    api.release()
    await first
    return job


async def test_a_view_younger_than_max_age_is_served_without_a_read(api: GatedApi, clock: ManualClock) -> None:
    job = await loaded(api, clock)
    clock.now += 0.9
    await job.ensure_fresh(1.0)
    assert api.reads == 1 and job.workers == 2
    await job.aclose()


async def test_a_stale_view_is_served_at_once_and_replaced_by_a_background_read(
    api: GatedApi, clock: ManualClock
) -> None:
    job = await loaded(api, clock)
    api.workers = 3  # changed at the provider
    clock.now += 1.5  # older than max_age, younger than twice it
    await asyncio.wait_for(job.ensure_fresh(1.0), timeout=1)  # returns while the read is held at the gate
    assert job.workers == 2, "the handler ran on the old view without waiting"
    await until(lambda: api.reads == 2, "background read")
    await job.ensure_fresh(1.0)
    assert api.reads == 2, "one background read at a time"
    api.release()
    await until(lambda: job._background is not None and job._background.done(), "the background read landed")
    assert job.workers == 2, "a view never changes under a running handler: the read waits for the next one"
    clock.now += 0.5
    await job.ensure_fresh(1.0)  # the next handler
    assert job.workers == 3 and api.reads == 2, "it gets the background read's view, counted as fresh"
    await job.aclose()


async def test_a_view_older_than_twice_max_age_is_reread_before_the_handler(api: GatedApi, clock: ManualClock) -> None:
    job = await loaded(api, clock)
    api.workers = 4
    clock.now += 2.5
    waiting = asyncio.create_task(job.ensure_fresh(1.0))
    await until(lambda: api.reads == 2, "second read")
    assert not waiting.done(), "a view that old is not served"
    api.release()
    await waiting
    assert job.workers == 4
    await job.aclose()


async def test_up_to_the_stale_limit_a_quiet_jobs_view_is_served_while_it_is_reread(
    api: GatedApi, clock: ManualClock
) -> None:
    """The runtime's limit (a minute) is wider than twice max_age: after a quiet spell, the events that wake the
    controller do not all queue behind a blocking read; past the limit they do."""
    job = await loaded(api, clock)
    api.workers = 4
    clock.now += 30
    await asyncio.wait_for(job.ensure_fresh(1.0, stale_limit=60.0), timeout=1)  # served while the read is held
    assert job.workers == 2
    await until(lambda: api.reads == 2, "the background read")
    api.release()
    await until(lambda: job._staged is not None, "the read staged")
    await job.ensure_fresh(1.0, stale_limit=60.0)
    assert job.workers == 4
    clock.now += 61
    waiting = asyncio.create_task(job.ensure_fresh(1.0, stale_limit=60.0))
    await until(lambda: api.reads == 3, "third read")
    assert not waiting.done(), "past the limit the handler waits for the read"
    api.release()
    await waiting
    await job.aclose()


async def test_a_background_read_started_before_our_negotiation_is_discarded(api: GatedApi, clock: ManualClock) -> None:
    job = await loaded(api, clock)
    clock.now += 1.5
    await job.ensure_fresh(1.0)  # background read #2 starts, answering workers=2
    await until(lambda: api.reads == 2, "background read")
    job.invalidate()  # what job.negotiate() and offer.accept() do before their requests
    api.workers = 3  # the negotiation's effect at the provider
    api.release()  # read #2 lands now, with the pre-negotiation answer
    await until(lambda: job._background is not None and job._background.done(), "background read done")
    waiting = asyncio.create_task(job.ensure_fresh(1.0))
    await until(lambda: api.reads == 3, "a fresh read after the negotiation")
    assert not waiting.done(), "the pre-negotiation answer must not count as fresh"
    api.release()
    await waiting
    assert job.workers == 3
    await job.aclose()


async def test_stopping_cancels_a_background_read_in_flight(api: GatedApi, clock: ManualClock) -> None:
    job = await loaded(api, clock)
    clock.now += 1.5
    await job.ensure_fresh(1.0)
    await until(lambda: api.reads == 2, "background read")
    background = job._background
    assert background is not None and not background.done()
    await job.aclose()
    assert background.cancelled()



class JoinWatch:
    """Records when a handler starts waiting on a read it joined (job.py shields it), so a test can act then."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.joined = asyncio.Event()
        real_shield = asyncio.shield

        def shield(awaitable: Any) -> Any:
            self.joined.set()
            return real_shield(awaitable)

        monkeypatch.setattr("tenant_controllers.job.asyncio.shield", shield)


@pytest.fixture
def joins(monkeypatch: pytest.MonkeyPatch) -> JoinWatch:
    return JoinWatch(monkeypatch)


async def handler_joining_the_start_up_read(
    api: GatedApi, clock: ManualClock, joins: JoinWatch
) -> tuple[Job, asyncio.Task[Job]]:
    """A job whose start-up read is held at the gate, and a handler waiting on that read."""
    job = Job("j1", api=api, clock=clock)  # type: ignore[arg-type]
    job.prefetch()
    waiting = asyncio.create_task(job.ensure_fresh(1.0))
    await asyncio.wait_for(joins.joined.wait(), 5)
    return job, waiting


async def test_a_handler_with_no_view_joins_the_start_up_read_instead_of_starting_another(
    api: GatedApi, clock: ManualClock, joins: JoinWatch
) -> None:
    job = Job("j1", api=api, clock=clock)  # type: ignore[arg-type]
    job.prefetch()  # what the runtime does as it starts
    await until(lambda: api.reads == 1, "the start-up read")
    job.prefetch()
    waiting = asyncio.create_task(job.ensure_fresh(1.0))
    await asyncio.wait_for(joins.joined.wait(), 5)
    assert not waiting.done(), "there is no view yet: the handler waits for the read under way"
    assert api.reads == 1, "one read, joined; a second prefetch does not start another either"
    api.release()
    await waiting
    assert job.workers == 2 and api.reads == 1
    await job.aclose()


class FailingFirstRead(GatedApi):
    """Like GatedApi, but the first read, once released, fails."""

    async def get_job(self, job_id: str) -> dict[str, Any]:
        first = self.reads == 0
        answer = await super().get_job(job_id)
        if first:
            raise ConnectionError("provider not up yet")
        return answer


async def test_when_the_read_it_joined_fails_the_handler_reads_for_itself(clock: ManualClock, joins: JoinWatch) -> None:
    api = FailingFirstRead()
    job, waiting = await handler_joining_the_start_up_read(api, clock, joins)
    api.workers = 5
    api.release()  # the joined read fails
    await until(lambda: api.reads == 2, "the handler's own read")
    api.release()
    await waiting
    assert job.workers == 5
    await job.aclose()


async def test_a_failed_start_up_read_leaves_the_handler_to_read_for_itself(clock: ManualClock) -> None:
    api = FailingFirstRead()
    job = Job("j1", api=api, clock=clock)  # type: ignore[arg-type]
    job.prefetch()
    await until(lambda: api.reads == 1, "the start-up read")
    api.release()
    await until(lambda: job._background is not None and job._background.done(), "the start-up read failed")
    api.workers = 5
    waiting = asyncio.create_task(job.ensure_fresh(1.0))
    await until(lambda: api.reads == 2, "the handler's own read")
    api.release()
    await waiting
    assert job.workers == 5
    await job.aclose()


async def test_a_read_under_way_from_before_a_change_is_not_joined(api: GatedApi, clock: ManualClock) -> None:
    job = Job("j1", api=api, clock=clock)  # type: ignore[arg-type]
    job.prefetch()
    await until(lambda: api.reads == 1, "the start-up read")
    job.invalidate()  # we negotiated while it was in flight: its answer may predate that
    api.workers = 3
    waiting = asyncio.create_task(job.ensure_fresh(1.0))
    await until(lambda: api.reads == 2, "a read of its own")
    api.release()
    await waiting
    assert job.workers == 3
    await job.aclose()


async def test_a_change_while_the_handler_waits_on_a_joined_read_makes_it_read_again(
    api: GatedApi, clock: ManualClock, joins: JoinWatch
) -> None:
    job, waiting = await handler_joining_the_start_up_read(api, clock, joins)
    job.invalidate()  # e.g. another lane's handler negotiated meanwhile
    api.workers = 3
    api.release()  # the joined read lands with the pre-change answer, which is discarded
    await until(lambda: api.reads == 2, "the handler's own read")
    api.release()
    await waiting
    assert job.workers == 3
    await job.aclose()


async def test_a_background_read_too_old_to_serve_is_not_joined(api: GatedApi, clock: ManualClock) -> None:
    job = await loaded(api, clock)
    clock.now += 1.5
    await job.ensure_fresh(1.0, stale_limit=60.0)  # starts a background read, which hangs
    await until(lambda: api.reads == 2, "the background read")
    clock.now += 61  # the view and that read's answer are both past the limit now
    waiting = asyncio.create_task(job.ensure_fresh(1.0, stale_limit=60.0))
    await until(lambda: api.reads == 3, "a read of its own, not a wait on the old one")
    api.workers = 4
    api.release()
    await waiting
    await job.aclose()


async def test_a_cancelled_handler_does_not_cancel_the_read_it_joined(
    api: GatedApi, clock: ManualClock, joins: JoinWatch
) -> None:
    job, waiting = await handler_joining_the_start_up_read(api, clock, joins)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert waiting.cancelled()
    background = job._background
    assert background is not None and not background.done(), "the read goes on"
    api.release()
    await background
    await job.ensure_fresh(1.0)
    assert job.workers == 2 and api.reads == 1, "the next handler gets the read that went on"
    await job.aclose()
