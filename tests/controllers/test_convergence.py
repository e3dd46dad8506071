"""Fast tier: a level-based controller converges whatever the bus and the provider do to it.

The bus drops events before they are stored, stores some twice, reorders batches and loses acks; the provider fails a
third of all requests with 503; and after the controller has converged, the provider changes the job behind its back.
Handlers act on the newest observation (`latest_only`, `job.latest`) and `@ctl.on_resync` compares the job as the
provider has it with what the controller wants, so the job ends at the size implied by the newest carbon reading
that reached the stream, for every seed.
"""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from harmonaize.events import CarbonIntensity
from tenant_controllers import Controller, Job
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.memory import Faults, MemoryBroker, MemoryEventSource
from tenant_controllers.store import HandledStore
from tests.controllers.fake_provider import FakeProvider
from tests.controllers.support import T0, carbon, running
from tests.support import eventually


def target(g_per_kwh: float) -> int:
    return 4 if g_per_kwh < 150 else 3 if g_per_kwh < 300 else 1


def build_controller() -> Controller:
    ctl = Controller(tenant="acme", job="llm-finetune", name="scaler")

    async def reconcile(job: Job) -> None:
        latest = job.latest(CarbonIntensity)
        if latest is None:
            return
        want = target(latest.g_per_kwh)
        if job.workers != want:
            offer = await job.negotiate(scale_to=want, accept=(want, want))
            await offer.accept()

    @ctl.on(CarbonIntensity, latest_only=True, retries=50, backoff=0.005)
    async def on_carbon(event: CarbonIntensity, job: Job) -> None:
        await reconcile(job)

    @ctl.on_resync(retries=50, backoff=0.005)
    async def resync(job: Job) -> None:
        await reconcile(job)

    return ctl


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_drops_duplicates_reordering_lost_acks_and_api_faults_still_converge(
    seed: int, provider: FakeProvider, store: HandledStore
) -> None:
    rng = random.Random(seed)
    bus = MemoryBroker(
        tenant="acme", ack_wait=0.1, faults=Faults(drop=0.3, duplicate=0.3, reorder=True, lose_ack=0.2, seed=seed)
    )
    provider.flaky = 0.3
    provider.rng = random.Random(seed)
    readings = [carbon(rng.uniform(50, 450), at=T0 + timedelta(minutes=n)) for n in range(40)]
    async with ProviderApi(base_url="http://provider", token=provider.token, transport=provider.transport,
                           retry_delay=0.001) as api:
        ctl = build_controller()
        async with running(ctl, source=MemoryEventSource(bus), api=api, store=store, resync_interval=0.05,
                           batch=8) as runtime:
            for reading in readings:
                bus.publish(reading)
            stored = [r for r in readings if r.id not in bus.dropped]
            want = target(max(stored, key=lambda r: r.time).data.g_per_kwh)
            job = provider.jobs["llm-finetune"]
            await eventually(lambda: job["desired_workers"] == want and bus.consumer_state(ctl.consumer)[1] == 0,
                             timeout=15, what=f"job at {want} workers and every event settled")

            job["desired_workers"] = 2 if want != 2 else 1  # the provider changed it (e.g. after a host failure)
            await eventually(lambda: job["desired_workers"] == want, timeout=10, what="resync repaired the drift")
    assert bus.dropped and bus.stored > len(stored), "the faults really happened (drops and duplicates)"
    assert runtime.stats.duplicates > 0 and runtime.stats.stale > 0
    handled_ids = [r.event_id for r in store.records() if r.handler.endswith("on_carbon")]
    assert len(handled_ids) == len(set(handled_ids)) == len(stored), "every stored reading finished exactly once"
