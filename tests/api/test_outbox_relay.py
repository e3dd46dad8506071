"""The outbox relay over an in-memory bus, on SQLite and PostgreSQL: order, retries, and rows left by a dead process.

The API here runs without a bus, so outbox rows accumulate exactly as they would if the process died after
committing; a relay built afterwards (a "new process") must deliver every one of them, in order, at least once.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI

from api.app import create_app
from api.models import OutboxTopic
from api.options import NegotiationOptions
from api.services.outbox_relay import OutboxRelay
from broker_config.provider_bus import ProviderBusError
from harmonaize.desired_state import HostAssignment
from harmonaize.negotiation import RoundAction
from harmonaize.settings import Settings
from tests.api.api_memory_broker import InMemoryBroker
from tests.api.api_memory_bus import MemoryProviderBus
from tests.api.api_testkit import ADMIN, TenantHandle, create_host, create_job
from tests.api.negotiation_kit import act, negotiate, outbox
from tests.support import eventually


@pytest.fixture
async def committed(client: httpx.AsyncClient, acme: TenantHandle, app: FastAPI) -> int:
    """A placement, a negotiation and its acceptance, committed with nobody delivering; how many rows."""
    await create_host(client, "h1", gpus=4, group="rack-a")
    await create_job(client, acme, "train", initial_workers=1)
    offer = await negotiate(client, acme, "train", key="k", desired_workers=3)
    assert (await act(client, acme, offer["id"], RoundAction.ACCEPT)).status_code == 200
    rows = await outbox(app)
    assert [row.topic for row in rows] == [
        OutboxTopic.DESIRED_STATE, OutboxTopic.TENANT_EVENT, OutboxTopic.DESIRED_STATE, OutboxTopic.TENANT_EVENT
    ]
    assert all(row.delivered_at is None for row in rows)
    return len(rows)


async def test_a_new_relay_delivers_rows_left_by_a_previous_process_in_order(app: FastAPI, committed: int) -> None:
    bus = MemoryProviderBus()
    assert await OutboxRelay(app.state.sessionmaker, bus).deliver_pending() == committed
    assert [subject for subject, _, _ in bus.events] == ["hz.t.acme.events.negotiation.train"] * 2
    revisions = [HostAssignment.model_validate_json(value) for value in bus.kv["host.h1"]]
    assert [(a.generation, a.jobs[0].workers) for a in revisions] == [(1, 1), (2, 3)]
    rows = await outbox(app)
    assert all(row.delivered_at is not None and row.attempts == 1 and row.last_error is None for row in rows)
    assert await OutboxRelay(app.state.sessionmaker, bus).deliver_pending() == 0, "delivered rows stay delivered"


async def test_a_failure_stops_the_pass_records_it_and_the_retry_resumes_in_order(
    app: FastAPI, committed: int
) -> None:
    bus = MemoryProviderBus(down=True)
    relay = OutboxRelay(app.state.sessionmaker, bus)
    with pytest.raises(ProviderBusError):
        await relay.deliver_pending()
    first, *rest = await outbox(app)
    assert (first.attempts, first.delivered_at) == (1, None) and "down" in (first.last_error or "")
    assert all(row.attempts == 0 for row in rest), "later rows wait: a host's state never overtakes an older one"

    bus.down = False
    bus.lose_acks = 1
    with pytest.raises(ProviderBusError):
        await relay.deliver_pending()
    assert await relay.deliver_pending() == committed - 1
    assert len(bus.events) == 2 and bus.duplicates_dropped == 1, "stored once, though published twice"
    attempts = [row.attempts for row in await outbox(app)]
    assert attempts == [2, 2, 1, 1]


async def test_the_running_relay_backs_off_and_delivers_once_the_bus_is_back(
    migrated_settings: Settings, committed: int, app: FastAPI
) -> None:
    bus = MemoryProviderBus(down=True)
    relay = OutboxRelay(app.state.sessionmaker, bus, backoff_initial=0.01, backoff_max=0.05, poll_interval=0.05)
    task = asyncio.create_task(relay.run())
    try:
        await eventually(lambda: bus.attempts >= 3, what="several attempts while the bus is down")
        bus.down = False
        await eventually(lambda: relay.delivered == committed, what="every row once the bus is back")
        assert len(bus.events) == 2 and len(bus.kv["host.h1"]) == 2
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_an_app_with_a_bus_relays_on_its_own_including_old_rows(
    migrated_settings: Settings, committed: int, app: FastAPI
) -> None:
    """A second app on the same database, with a bus: it delivers what the first (busless) one left, then its own
    (its sweeper also tells the job's tenant its capacity: an event of its own, not one of the rows left)."""
    bus = MemoryProviderBus()
    second = create_app(migrated_settings, broker=InMemoryBroker(), bus=bus, negotiation=NegotiationOptions())

    def left_over() -> int:
        return sum(1 for subject, _, _ in bus.events if ".events.capacity." not in subject)

    async with second.router.lifespan_context(second):
        # Two apps share one SQLite file here: a relay that meets the other app's write lock backs off (up to 5 s).
        await eventually(lambda: left_over() == 2, timeout=20, what="rows of the previous app")
        transport = httpx.ASGITransport(app=second)
        async with httpx.AsyncClient(transport=transport, base_url="http://hz.test") as client:
            body = {"tenant_id": "acme", "job_id": "train", "gpus": 1}
            assert (await client.post("/v1/allocations", json=body, headers=ADMIN)).status_code == 201
        await eventually(lambda: len(bus.kv["host.h1"]) == 3, timeout=20, what="the admin placement's desired state")
    assert HostAssignment.model_validate_json(bus.kv["host.h1"][-1]).jobs[0].workers == 4
