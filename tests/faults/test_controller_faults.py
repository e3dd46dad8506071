"""A level-based controller whose events are dropped, duplicated and reordered at random, and which crashes and
restarts midway, ends in the same final state as the same controller fed the same events without faults.

Real broker and real API (tests/controllers/live_cloud.py); the controller runs in this process so that a fault
transport can sit between it and its real durable consumer (`NatsEventSource`), the way httpx's mock transport sits
under a client. Per seed, from one `random.Random(seed)`:

* publishing: the readings go out of order (shuffled within windows of six), and some are published twice under
  different message ids (stored twice: a duplicate only de-duplication by CloudEvent id can catch);
* delivery (`FaultySource`): some deliveries are dropped on the way (never acked, so JetStream redelivers them after
  the 1 s ack wait), some are handed over twice, and every batch is shuffled;
* a crash: the runtime's task is cancelled while events are in flight (no drain: what it held comes back after the
  ack wait), and a new runtime (a new `Controller`, as a restarted process builds) resumes on the same durable
  consumer and store.

The no-fault reference run uses the same readings for a job of its own. Asserted, by CloudEvent id and on exact
counts: the job ends at the reference's size (and at the size the newest reading implies); every stored reading has
exactly one finished record (handled or skipped as stale) and no handler body ran twice for one event, except at most
the one the crash interrupted; the faults really happened (drops redelivered, duplicates suppressed, stale skipped).

A controller killed with SIGKILL as a process is tests/controllers/test_real_crash.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from harmonaize.events import CarbonIntensity, CloudEvent, make_event
from tenant_controllers import Controller, Job
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.nats_source import NatsEventSource
from tenant_controllers.runtime import ControllerRuntime, RuntimeStats
from tenant_controllers.sources import Delivery, Subscription
from tenant_controllers.store import HandledStore, Status
from tests.controllers.live_cloud import LiveCloud
from tests.faults.support import SOAK, scaled
from tests.support import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(scaled(150, 1200))]

SEEDS = list(range(1, 11)) if SOAK else [1, 2]
READINGS = scaled(40, 120)
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def target(g_per_kwh: float) -> int:
    """The level-based rule: the job size is a function of the newest carbon reading alone."""
    return 4 if g_per_kwh < 150 else 3 if g_per_kwh < 300 else 1


def build_controller(job: str, runs: Counter[str]) -> Controller:
    """The README's shape of a level-based controller: act on the newest reading only, and again at every resync."""
    ctl = Controller(job=job, name="scaler")

    async def reconcile(job: Job) -> None:
        reading = job.latest(CarbonIntensity)
        if reading is None:
            return
        want = target(reading.g_per_kwh)
        if job.workers != want:
            offer = await job.negotiate(scale_to=want, accept=(want, want))
            await offer.accept()

    @ctl.on(CarbonIntensity, latest_only=True, retries=20, backoff=0.05)
    async def on_carbon(envelope: CloudEvent[CarbonIntensity], job: Job) -> None:
        runs[envelope.id] += 1
        await reconcile(job)

    @ctl.on_resync(retries=20, backoff=0.05)
    async def resync(job: Job) -> None:
        await reconcile(job)

    return ctl


@dataclass(frozen=True)
class Echo:
    """A second copy of a delivery, as a network can produce: it carries the same message, and whatever the
    controller answers to it (ack, nak, ...) is lost on the way."""

    original: Delivery

    data = property(lambda self: self.original.data)
    subject = property(lambda self: self.original.subject)
    num_delivered = property(lambda self: self.original.num_delivered)

    async def ack(self) -> None: ...

    async def nak(self, delay: float | None = None) -> None: ...

    async def in_progress(self) -> None: ...

    async def term(self) -> None: ...


@dataclass
class FaultySource:
    """An `EventSource` that loses, repeats and reorders what the real one delivers (seeded)."""

    inner: NatsEventSource
    rng: random.Random
    drop: float = 0.0
    duplicate: float = 0.0
    reorder: bool = False
    dropped: int = 0
    duplicated: int = 0

    @property
    def ack_wait(self) -> float | None:
        return self.inner.ack_wait

    async def open(self, subscription: Subscription) -> None:
        await self.inner.open(subscription)

    async def fetch(self, *, batch: int, timeout: float) -> Sequence[Delivery]:
        out: list[Delivery] = []
        for delivery in await self.inner.fetch(batch=batch, timeout=timeout):
            if self.rng.random() < self.drop:
                self.dropped += 1  # lost on the way: never acked, so the broker delivers it again
                continue
            out.append(delivery)
            if self.rng.random() < self.duplicate:
                self.duplicated += 1
                out.append(Echo(delivery))
        if self.reorder:
            self.rng.shuffle(out)
        return out

    async def close(self) -> None:
        await self.inner.close()


@dataclass
class Run:
    job: str
    events: list[CloudEvent[CarbonIntensity]]
    runs: Counter[str] = field(default_factory=Counter)
    stats: list[RuntimeStats] = field(default_factory=list)
    dropped: int = 0
    duplicated: int = 0
    republished: int = 0


def readings(job: str, values: list[float]) -> list[CloudEvent[CarbonIntensity]]:
    return [
        make_event(CarbonIntensity(region="US-CAL-CISO", g_per_kwh=g, observed_at=T0 + timedelta(minutes=n)),
                   source="/hz/provider/carbon", subject=job, time=T0 + timedelta(minutes=n))
        for n, g in enumerate(values)
    ]


async def start(run: Run, cloud: LiveCloud, api: ProviderApi, store: HandledStore, *, rng: random.Random | None,
                ) -> tuple[ControllerRuntime, asyncio.Event, asyncio.Task[None], FaultySource]:
    inner = NatsEventSource(servers=cloud.nats_url, seed=cloud.seed, api=api, ack_wait=1.0)
    faults = (dict(drop=0.25, duplicate=0.25, reorder=True) if rng is not None else {})
    source = FaultySource(inner, rng or random.Random(0), **faults)  # type: ignore[arg-type]
    runtime = ControllerRuntime(build_controller(run.job, run.runs), source=source, api=api, store=store,
                                resync_interval=0.5, batch=8, fetch_timeout=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(runtime.run(stop), name=f"hz-faults-{run.job}")
    await eventually(lambda: runtime.ready.is_set() or task.done(), timeout=15, what="the controller pulling")
    if task.done():
        task.result()
    return runtime, stop, task, source


async def crash(task: asyncio.Task[None], stopping: asyncio.Event) -> None:
    """Cancel the runtime's task the way a kill ends a process: no drain. On Python 3.11 a cancel can be lost
    (asyncio.wait_for inside nats-py's fetch may swallow it when a message arrives at that moment), so the cancel is
    repeated until the runtime has begun to stop (it sets `stopping` first thing); then it gets 30 s to finish."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not stopping.is_set() and not task.done() and loop.time() < deadline:
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)
    await asyncio.wait({task}, timeout=30)
    if not task.done():
        stacks = io.StringIO()
        for other in asyncio.all_tasks():
            if other is not asyncio.current_task():
                print(f"--- {other.get_name()}", file=stacks)
                other.print_stack(limit=20, file=stacks)
        raise AssertionError(f"the cancelled controller did not stop:\n{stacks.getvalue()}")
    with contextlib.suppress(asyncio.CancelledError):
        task.result()


async def execute(
    run: Run, cloud: LiveCloud, api: ProviderApi, tmp_path: Path, *, seed: int | None, want: dict[str, Any]
) -> None:
    """Publish the readings and run the controller until every one is settled (with faults and a crash if seeded),
    then give its resyncs a moment to reach `want`."""
    rng = random.Random(seed) if seed is not None else None
    order = list(run.events)
    if rng is not None:  # out of order within windows of six, as concurrent agents and retries reorder events
        windows = [order[i:i + 6] for i in range(0, len(order), 6)]
        for window in windows:
            rng.shuffle(window)
        order = [event for window in windows for event in window]
    crash_after = len(order) // 2 if rng is not None else None
    with HandledStore(tmp_path / f"{run.job}.sqlite3") as store:
        runtime, stop, task, source = await start(run, cloud, api, store, rng=rng)
        try:
            for n, event in enumerate(order):
                await cloud.publish(event)
                if rng is not None and rng.random() < 0.3:
                    run.republished += 1
                    await cloud.publish(event, msg_id=f"{event.id}.again")
                if n == crash_after:
                    await eventually(lambda: len(store.records()) >= 5, timeout=15, what="events being handled")
                    await crash(task, stop)
                    run.stats.append(runtime.stats)
                    run.dropped += source.dropped
                    run.duplicated += source.duplicated
                    runtime, stop, task, source = await start(run, cloud, api, store, rng=rng)

            async def settled() -> bool:
                info = await cloud.consumer_info(runtime.controller.consumer)
                finished = {r.event_id for r in store.records() if r.handler.endswith("on_carbon")}
                return info.num_pending == 0 and info.num_ack_pending == 0 and finished >= {e.id for e in run.events}

            await eventually(settled, timeout=60, interval=0.2, what=f"{run.job}: every reading settled")
            with contextlib.suppress(AssertionError):  # a resync or two may still be on its way (0.5 s apart)
                await eventually(lambda: _at(cloud, run.job, want), timeout=10, interval=0.2)
        finally:
            stop.set()
            await asyncio.wait_for(task, timeout=30)
            run.stats.append(runtime.stats)
            run.dropped += source.dropped
            run.duplicated += source.duplicated
        records = [r for r in store.records() if r.handler.endswith("on_carbon")]
        ids = Counter(r.event_id for r in records)
        assert set(ids) == {e.id for e in run.events} and set(ids.values()) == {1}, "one finished record per reading"
        assert {r.status for r in records} <= {Status.DONE, Status.STALE}


async def _at(cloud: LiveCloud, job: str, want: dict[str, Any]) -> bool:
    return await final_state(cloud, job) == want


async def final_state(cloud: LiveCloud, job: str) -> dict[str, Any]:
    reply = await cloud.tenant_client.get(f"/v1/jobs/{job}")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return {"desired_workers": body["desired_workers"], "parallel_plan": body["parallel_plan"]}


async def test_drops_duplicates_reordering_and_a_crash_end_in_the_no_fault_state(
    cloud: LiveCloud, tmp_path: Path
) -> None:
    await cloud.add_host("h1", gpus=4 * (len(SEEDS) + 1), group="g1")
    values = [random.Random(n).uniform(50, 450) for n in range(READINGS)]
    async with ProviderApi(base_url=cloud.api_url, token=cloud.token, retry_delay=0.05) as api:
        reference = Run("ref", readings("ref", values))
        await cloud.create_job("ref", initial_workers=2)
        implied = {"desired_workers": target(values[-1]), "parallel_plan": "ddp"}
        await execute(reference, cloud, api, tmp_path, seed=None, want=implied)
        expected = await final_state(cloud, "ref")
        assert expected == implied and implied["desired_workers"] != 2, "the reference ends at the newest level"

        for seed in SEEDS:
            run = Run(f"seed-{seed}", readings(f"seed-{seed}", values))
            await cloud.create_job(run.job, initial_workers=2)
            await execute(run, cloud, api, tmp_path, seed=seed, want=expected)
            got = await final_state(cloud, run.job)
            stats = run.stats
            print(
                f"\nseed {seed}: {len(run.events)} readings (+{run.republished} stored twice), "
                f"{run.dropped} deliveries dropped, {run.duplicated} handed over twice; controller: "
                f"{sum(s.received for s in stats)} deliveries, {sum(s.handled for s in stats)} handled, "
                f"{sum(s.stale for s in stats)} stale skipped, {sum(s.duplicates for s in stats)} duplicates "
                f"suppressed; final {got} (reference {expected})"
            )
            assert got == expected, f"seed {seed}: the faults changed the final state"
            assert run.dropped > 0 and run.duplicated > 0 and run.republished > 0, "the faults really happened"
            assert sum(s.duplicates for s in stats) >= run.republished, "every republished copy was suppressed"
            twice = {event_id: n for event_id, n in run.runs.items() if n > 1}
            assert len(twice) <= 1 and all(n == 2 for n in twice.values()), (
                f"only the handler interrupted by the crash may run again: {twice}")
