"""Real tier: each example controller, loaded and run by the runner, against the real broker and the real API.

The test publishes the triggering events as the provider and reads the negotiation the controller made back through
`GET /v1/negotiations` (the provider's record of every round), and the job's new state through `GET /v1/jobs/{id}`.
The provider's carbon forecast is held at 150 g/kWh so the scaler's carbon cap (200) admits an immediate start.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import tenant_controllers.examples
from api.options import NegotiationOptions
from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from harmonaize.events import CongestionLevel, FailureKind
from tenant_controllers.runner import Credentials, load_controllers, run_controllers
from tests.controllers.live_cloud import LiveCloud, live_cloud
from tests.controllers.support import T0, carbon, congestion, failure, maintenance
from tests.support import eventually

EXAMPLES = Path(tenant_controllers.examples.__file__).parent


class FlatForecast:
    """A provider forecast that says the grid stays at `g` g/kWh."""

    def __init__(self, g: float) -> None:
        self.g = g

    def points(self, now: datetime) -> list[tuple[datetime, float]]:
        start = now.replace(minute=0, second=0, microsecond=0)
        return [(start + timedelta(hours=h), self.g) for h in range(25)]


@pytest.fixture
async def placed(
    tmp_path: Path, nats_server: NatsServer, tenant_broker: NatsTenantBroker, provider_secret: bytes
) -> AsyncIterator[LiveCloud]:
    async with live_cloud(
        tmp_path / "hz", nats_server=nats_server, tenant_broker=tenant_broker, provider_secret=provider_secret,
        negotiation=NegotiationOptions(forecast=FlatForecast(150.0)),
    ) as cloud:
        await cloud.add_host("h1", gpus=4, group="rack-a")
        await cloud.add_host("h2", gpus=4, group="rack-b")
        await cloud.create_job("llm-finetune", min_workers=1, max_workers=4, initial_workers=2)
        yield cloud


@asynccontextmanager
async def example_running(cloud: LiveCloud, name: str, state_dir: Path) -> AsyncIterator[None]:
    """The example script, loaded and run by the runner (as `harmonaize controller run` does), in this process."""
    async with run_script(cloud, EXAMPLES / f"{name}.py", state_dir):
        yield


@asynccontextmanager
async def run_script(cloud: LiveCloud, script: Path, state_dir: Path) -> AsyncIterator[None]:
    """Any controller script, loaded and run by the runner, in this process."""
    [controller] = load_controllers(script)
    credentials = Credentials(tenant=cloud.tenant, token=cloud.token, nats_seed=cloud.seed,
                              nats_url=cloud.nats_url, api_url=cloud.api_url)
    stop = asyncio.Event()
    task = asyncio.create_task(run_controllers([controller], credentials=credentials, state_dir=state_dir, stop=stop,
                                               resync_interval=None))
    await eventually(lambda: _consumer_exists(cloud, controller.consumer), timeout=10, what="consumer created")
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


async def _consumer_exists(cloud: LiveCloud, name: str) -> bool:
    try:
        await cloud.consumer_info(name)
    except Exception:
        return False
    return True


async def job_state(cloud: LiveCloud) -> dict[str, Any]:
    return dict((await cloud.tenant_client.get("/v1/jobs/llm-finetune")).json())


async def test_carbon_aware_scaler_negotiates_with_a_carbon_cap(placed: LiveCloud, tmp_path: Path) -> None:
    async with example_running(placed, "carbon_aware_scaler", tmp_path / "state"):
        await placed.publish(carbon(120, at=T0))
        await eventually(lambda: _workers_are(placed, 4), timeout=15, what="scaled up to 4")
        await placed.publish(carbon(420, at=T0 + timedelta(hours=1)))
        await eventually(lambda: _workers_are(placed, 1), timeout=15, what="scaled down to 1")
    shrink, grow = await placed.negotiations(job="llm-finetune")  # newest first
    assert (grow["kind"], grow["state"]) == ("scale", "accepted")
    assert grow["terms"]["desired_workers"] == 4 and grow["terms"]["accept_workers"] == {"min": 3, "max": 4}
    assert grow["terms"]["constraints"]["carbon_cap_g_per_kwh"] == 200.0
    assert grow["accepted_option"]["workers"] == 4
    assert (shrink["kind"], shrink["state"], shrink["terms"]["desired_workers"]) == ("scale", "accepted", 1)


async def test_failure_guard_negotiates_a_replacement_before_the_predicted_failure(
    placed: LiveCloud, tmp_path: Path
) -> None:
    [host] = {a["host"] for a in (await placed.tenant_client.get("/v1/jobs/llm-finetune/allocations")).json()}
    predicted = failure(kind=FailureKind.PREDICTED_FAILURE, at=datetime.now(T0.tzinfo), host=host)
    async with example_running(placed, "failure_guard", tmp_path / "state"):
        await placed.publish(predicted)
        await eventually(lambda: _negotiation_settled(placed), timeout=15, what="a settled negotiation")
    [negotiation] = await placed.negotiations(job="llm-finetune")
    assert (negotiation["kind"], negotiation["state"]) == ("scale", "accepted")
    assert negotiation["terms"]["desired_workers"] == 2
    assert negotiation["terms"]["accept_workers"] == {"min": 1, "max": 2}
    assert negotiation["terms"]["constraints"]["deadline"] is not None
    assert negotiation["accepted_option"]["replaced_hosts"] == [host]
    assert (await job_state(placed))["desired_workers"] == 2
    moved = (await placed.tenant_client.get("/v1/jobs/llm-finetune/allocations")).json()
    assert len(moved) == 2 and host not in {a["host"] for a in moved}, "both workers left the host predicted to fail"


@pytest.fixture
async def relayed(
    tmp_path: Path, nats_server: NatsServer, tenant_broker: NatsTenantBroker, provider_secret: bytes
) -> AsyncIterator[LiveCloud]:
    """`placed`, with the API's outbox relayed to the broker."""
    async with live_cloud(
        tmp_path / "hz", nats_server=nats_server, tenant_broker=tenant_broker, provider_secret=provider_secret,
        relay=True,
    ) as cloud:
        await cloud.add_host("h1", gpus=4, group="rack-a")
        await cloud.add_host("h2", gpus=4, group="rack-b")
        await cloud.create_job("llm-finetune", min_workers=1, max_workers=4, initial_workers=2)
        yield cloud


async def test_capacity_scaler_grows_on_the_control_planes_capacity_event_and_leaves_a_host_before_maintenance(
    relayed: LiveCloud, tmp_path: Path
) -> None:
    """Nothing is published by the test for the growth: the API's own capacity event says the job has room for 4."""
    placed = relayed
    async with example_running(placed, "capacity_scaler", tmp_path / "state"):
        await eventually(lambda: _workers_are(placed, 4), timeout=15, what="grown to 4 on the capacity event")
        allocations = (await placed.tenant_client.get("/v1/jobs/llm-finetune/allocations")).json()
        hosts = sorted({a["host"] for a in allocations})
        notice = maintenance(hosts=(hosts[0],), at=datetime.now(T0.tzinfo), lead=timedelta(seconds=30))
        await placed.publish(notice)
        await eventually(lambda: _off_host(placed, hosts[0]), timeout=15, what="every worker off the host")
    leave, grow = await placed.negotiations(job="llm-finetune")  # newest first
    assert (grow["state"], grow["terms"]["accept_workers"], grow["accepted_option"]["workers"]) == (
        "accepted", {"min": 3, "max": 4}, 4)
    assert (leave["state"], leave["terms"]["replace_hosts"]) == ("accepted", [hosts[0]])
    assert leave["terms"]["constraints"]["deadline"] is not None
    assert (await job_state(placed))["desired_workers"] == 4, "the other host had room: the size was kept"


async def _off_host(cloud: LiveCloud, host: str) -> bool:
    allocations = (await cloud.tenant_client.get("/v1/jobs/llm-finetune/allocations")).json()
    return bool(allocations) and host not in {a["host"] for a in allocations}


async def test_congestion_repartitioner_switches_to_hsdp_and_back(placed: LiveCloud, tmp_path: Path) -> None:
    async with example_running(placed, "congestion_repartitioner", tmp_path / "state"):
        await placed.publish(congestion(CongestionLevel.HIGH, at=T0))
        await eventually(lambda: _plan_is(placed, "hsdp"), timeout=15, what="HSDP")
        await placed.publish(congestion(CongestionLevel.NONE, at=T0 + timedelta(minutes=5)))
        await eventually(lambda: _plan_is(placed, "ddp"), timeout=15, what="back to DDP")
    back, there = await placed.negotiations(job="llm-finetune")
    assert [(n["kind"], n["terms"]["parallel_plan"], n["state"]) for n in (there, back)] == [
        ("repartition", "hsdp", "accepted"), ("repartition", "ddp", "accepted")]


async def _workers_are(cloud: LiveCloud, workers: int) -> bool:
    return (await job_state(cloud))["desired_workers"] == workers


async def _plan_is(cloud: LiveCloud, plan: str) -> bool:
    return (await job_state(cloud))["parallel_plan"] == plan


async def _negotiation_settled(cloud: LiveCloud) -> bool:
    items = await cloud.negotiations(job="llm-finetune")
    return bool(items) and all(n["state"] != "offered" for n in items)
