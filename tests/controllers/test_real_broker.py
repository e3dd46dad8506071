"""Real tier: the controller runtime over a real nats-server with our broker config and the real API.

The consumer is created through `PUT /v1/event-consumers/{name}`, events are pulled with the tenant's nkey seed
through the imported JetStream API, and the provider publishes as agents do. These tests check what the fast tier
cannot: filters and acks really work across accounts, and the pull loop survives a broker restart.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from harmonaize.events import CarbonIntensity, CloudEvent, Failure, FailureKind
from tenant_controllers import Controller, Job, PermanentError, TemporaryError
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.nats_source import NatsEventSource
from tenant_controllers.sources import StreamPosition
from tenant_controllers.store import HandledStore, Status
from tests.controllers.live_cloud import LiveCloud
from tests.controllers.support import carbon, failure, running
from tests.support import eventually


async def test_typed_handlers_job_filter_dedup_and_error_semantics_over_the_real_broker(
    cloud: LiveCloud, tmp_path: Path
) -> None:
    await cloud.create_job("llm-finetune")
    await cloud.create_job("other-job")
    ctl = Controller(tenant="acme", job="llm-finetune", name="real")
    failures: list[tuple[str, str, int]] = []
    carbon_attempts: list[float] = []

    @ctl.on(Failure)
    async def on_failure(event: Failure, job: Job, envelope: CloudEvent[Failure]) -> str:
        failures.append((envelope.id, event.kind.value, job.max_workers))
        if event.kind is FailureKind.GPU_ERROR:
            raise PermanentError("nothing to do for a GPU error")
        return "ok"

    @ctl.on(CarbonIntensity, retries=3, backoff=0.01)
    async def on_carbon(event: CarbonIntensity) -> float:
        carbon_attempts.append(event.g_per_kwh)
        if len(carbon_attempts) < 3:
            raise TemporaryError("not yet", delay=0.02)
        return event.g_per_kwh

    duplicate = failure()
    async with ProviderApi(base_url=cloud.api_url, token=cloud.token) as api:
        source = NatsEventSource(servers=cloud.nats_url, seed=cloud.seed, api=api)
        with HandledStore(tmp_path / "handled.sqlite3") as store:
            async with running(ctl, source=source, api=api, store=store) as runtime:
                await cloud.publish(failure(job="other-job"))
                await cloud.publish(duplicate, msg_id="first-publish")
                await cloud.publish(duplicate, msg_id="second-publish")  # same CloudEvent, new Nats-Msg-Id
                await cloud.publish(failure(kind=FailureKind.GPU_ERROR))
                await cloud.publish(carbon(120))
                await eventually(
                    lambda: runtime.stats.handled == 2 and runtime.stats.gave_up == 1 and runtime.stats.duplicates == 1,
                    timeout=10, what="two handled, one given up, one duplicate",
                )
                info = await cloud.consumer_info(ctl.consumer)
                await eventually(lambda: _settled(cloud, ctl.consumer), timeout=5, what="everything acked")
            records = {(r.handler.rsplit(".", 1)[-1], r.status) for r in store.records()}
    assert [(kind, workers) for _, kind, workers in failures] == [("host_down", 4), ("gpu_error", 4)]
    assert carbon_attempts == [120.0] * 3
    assert records == {("on_failure", Status.DONE), ("on_failure", Status.GAVE_UP), ("on_carbon", Status.DONE)}
    assert set(info.config.filter_subjects or (info.config.filter_subject,)) == {
        "hz.t.acme.events.carbon.llm-finetune", "hz.t.acme.events.failure.llm-finetune"
    }, "the consumer asked only for this job's kinds with handlers"
    assert runtime.stats.received == 4, "the other job's failure never reached us"
    assert source.errors == [], "no permission violations"


async def _settled(cloud: LiveCloud, consumer: str) -> bool:
    info = await cloud.consumer_info(consumer)
    return info.num_ack_pending == 0 and info.num_pending == 0


async def test_the_pull_loop_survives_a_broker_restart(cloud: LiveCloud, tmp_path: Path) -> None:
    await cloud.create_job("llm-finetune")
    ctl = Controller(tenant="acme", job="llm-finetune", name="survivor")
    seen: list[float] = []

    @ctl.on(CarbonIntensity)
    async def on_carbon(event: CarbonIntensity) -> None:
        seen.append(event.g_per_kwh)

    async with ProviderApi(base_url=cloud.api_url, token=cloud.token) as api:
        source = NatsEventSource(servers=cloud.nats_url, seed=cloud.seed, api=api, reconnect_wait=0.1)
        with HandledStore(tmp_path / "handled.sqlite3") as store:
            async with running(ctl, source=source, api=api, store=store, fetch_timeout=0.2):
                await cloud.publish(carbon(100))
                await eventually(lambda: seen == [100.0], timeout=10, what="first event")
                await asyncio.to_thread(cloud.nats_server.stop)
                await asyncio.to_thread(cloud.nats_server.start)
                await cloud.publish(carbon(200))
                await eventually(lambda: seen == [100.0, 200.0], timeout=15, what="event after the restart")
                info = await cloud.consumer_info(ctl.consumer)
    assert not [e for e in source.errors if "permission" in e.lower()], source.errors
    assert source.recreated == 1, "the consumer, kept in the broker's memory, was lost and asked for again"
    assert info.config.mem_storage, "the controller keeps its own position: the broker writes no state file for it"


async def test_a_broker_restarted_while_the_controller_is_down_resumes_at_the_recorded_position(
    cloud: LiveCloud, tmp_path: Path
) -> None:
    """The broker's restart loses the consumer while nobody runs: the next run asks for it again from the position
    the store recorded, so it receives only what is new, not the stream from its start (which de-duplication would
    absorb, at the cost of re-reading days of events)."""
    await cloud.create_job("llm-finetune")
    ctl = Controller(tenant="acme", job="llm-finetune", name="resumer")
    seen: list[float] = []

    @ctl.on(CarbonIntensity)
    async def on_carbon(event: CarbonIntensity) -> None:
        seen.append(event.g_per_kwh)

    async with ProviderApi(base_url=cloud.api_url, token=cloud.token) as api:
        with HandledStore(tmp_path / "handled.sqlite3") as store:
            source = NatsEventSource(servers=cloud.nats_url, seed=cloud.seed, api=api)
            async with running(ctl, source=source, api=api, store=store, heartbeat_interval=0.1):
                for value in (100, 200, 300):
                    await cloud.publish(carbon(value))
                await eventually(lambda: len(seen) == 3, timeout=10, what="three events handled")
                await eventually(
                    lambda: (store.position(ctl.name, ctl.consumer) or _NONE).sequence == 3,
                    timeout=10, what="the position of the third event recorded",
                )
            await asyncio.to_thread(cloud.nats_server.stop)
            await asyncio.to_thread(cloud.nats_server.start)
            await cloud.publish(carbon(400))
            source = NatsEventSource(servers=cloud.nats_url, seed=cloud.seed, api=api)
            async with running(ctl, source=source, api=api, store=store) as runtime:
                await eventually(lambda: len(seen) == 4, timeout=15, what="the event published while down")
                info = await cloud.consumer_info(ctl.consumer)
    assert seen == [100.0, 200.0, 300.0, 400.0]
    assert runtime.stats.received == 1 and runtime.stats.duplicates == 0, "it started after the recorded position"
    assert info.config.opt_start_seq == 4


_NONE = StreamPosition(-1, "")
