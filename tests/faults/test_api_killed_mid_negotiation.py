"""The API is killed (SIGKILL) mid-negotiation, between the tenant's accept and the placement change: after a
restart the ledger, the negotiation and the hosts' desired state agree. Nothing is half-applied, and an accepted
change is carried out, exactly once.

The API runs as its own process (`harmonaize api serve`), the broker is a real nats-server. Two kill points:

1. Inside the accept's transaction (PostgreSQL): the test holds a lock on the outbox table, so the accept blocks
   on its outbox insert after it has already written the negotiation, the job, the hosts and the allocations (the
   test checks in `pg_locks` that it holds those writes), and the API is killed right there. After the restart the
   negotiation is still `offered`, the ledger and the desired state are as before, and the tenant's retried accept
   is carried out once.
2. After the accept committed (SQLite, the local default), with the broker down so the placement change sits in the
   outbox: the API is killed, the broker and the API come back, and the relay of the new process writes the hosts'
   desired state and the tenant's events. The KV bucket then matches the ledger, and every outcome event is in the
   tenant's stream exactly once.

What "agree" means, checked against the database itself: the negotiation's state, the job's `desired_workers` and
`allocated_gpus`, the sum of the job's live allocations, the host's `allocated_gpus`, the host's desired state in
the KV bucket (generation and workers) and the NegotiationUpdate events in the tenant's stream, by CloudEvent id.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import nats.errors
import pytest
from sqlalchemy import text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from api.db import make_engine
from api.models import utcnow
from api.services.capacity_events import publish_capacity_changes
from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from harmonaize.desired_state import DESIRED_STATE_BUCKET, HostAssignment, host_key
from harmonaize.events import EventKind, NegotiationUpdate, parse_event_as
from harmonaize.subjects import parse_tenant_event_subject, tenant_event_subject
from tests.faults.support import ADMIN_TOKEN, ApiService
from tests.support import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
JOB = "train"


@dataclass(frozen=True)
class Ledger:
    negotiation_state: str
    desired_workers: int
    job_gpus: int
    allocated: int  # sum of the job's live allocations
    host_gpus: int  # h1's allocated_gpus
    host_generation: int
    undelivered: int  # outbox rows not yet published, but for the sweeper's capacity events (its own timing)


async def ledger(database_url: str, negotiation_id: str) -> Ledger:
    engine = make_engine(database_url, single_use=True)
    try:
        async with engine.connect() as db:
            state = (await db.execute(text("SELECT state FROM negotiations WHERE id = :id"),
                                      {"id": negotiation_id})).scalar_one()
            workers, job_gpus = (await db.execute(
                text("SELECT desired_workers, allocated_gpus FROM jobs WHERE id = :job"), {"job": JOB})).one()
            allocated = (await db.execute(text(
                "SELECT COALESCE(SUM(gpus), 0) FROM allocations WHERE job_id = :job AND released_at IS NULL"),
                {"job": JOB})).scalar_one()
            host_gpus, generation = (await db.execute(
                text("SELECT allocated_gpus, generation FROM hosts WHERE id = 'h1'"))).one()
            undelivered = len(await _undelivered_rows(db))
    finally:
        await engine.dispose()
    return Ledger(str(state).lower(), workers, job_gpus, int(allocated), host_gpus, generation, undelivered)


async def desired(broker: NatsTenantBroker) -> HostAssignment:
    provider = await broker.provider_connection()
    try:
        entry = await (await provider.jetstream().key_value(DESIRED_STATE_BUCKET)).get(host_key("h1"))
        assert entry.value is not None
        return HostAssignment.model_validate_json(entry.value)
    finally:
        await provider.close()


async def negotiation_events(broker: NatsTenantBroker) -> list[Any]:
    """Every NegotiationUpdate stored in acme's stream, in order."""
    provider = await broker.provider_connection()
    try:
        js = provider.jetstream()
        total = (await js.stream_info("HZ_T_acme")).state.messages
        sub = await js.pull_subscribe(f"hz.t.acme.events.negotiation.{JOB}", stream="HZ_T_acme")
        events = []
        while True:
            try:
                batch = await sub.fetch(max(total, 1), timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):  # nats-py 2.16 raises either
                break
            events += [parse_event_as(m.data, NegotiationUpdate) for m in batch]
        await sub.unsubscribe()
        return events
    finally:
        await provider.close()


async def world(api: ApiService) -> dict[str, str]:
    """Tenant acme, host h1 with 3 GPUs, job `train` (1-4 workers) placed at 2; the tenant's auth header."""
    async with httpx.AsyncClient(base_url=api.url, headers=ADMIN, timeout=30) as admin:
        acme = await admin.post("/v1/tenants", json={"id": "acme", "display_name": "Acme"})
        assert acme.status_code == 201, acme.text
        host = await admin.post("/v1/hosts", json={"id": "h1", "gpus": 3, "locality_group": "g1"})
        assert host.status_code == 201, host.text
    tenant = {"Authorization": f"Bearer {acme.json()['api_token']}"}
    async with httpx.AsyncClient(base_url=api.url, headers=tenant, timeout=30) as client:
        job = await client.post("/v1/jobs", json={"id": JOB, "min_workers": 1, "max_workers": 4, "initial_workers": 2})
        assert job.status_code == 201, job.text
    return tenant


async def open_scale_to_four(api: ApiService, tenant: dict[str, str]) -> str:
    body = {"job": JOB, "kind": "scale", "terms": {"desired_workers": 4, "accept_workers": {"min": 2, "max": 4}}}
    async with httpx.AsyncClient(base_url=api.url, headers=tenant, timeout=30) as client:
        opened = await client.post("/v1/negotiations", json=body, headers={"Idempotency-Key": "scale-4"})
    assert opened.status_code == 201, opened.text
    assert opened.json()["offer"]["options"][0]["workers"] == 3, "h1 has one GPU left: the provider offers 3"
    return str(opened.json()["id"])


async def accept(api: ApiService, tenant: dict[str, str], negotiation_id: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=api.url, headers=tenant, timeout=60) as client:
        return await client.post(f"/v1/negotiations/{negotiation_id}/accept", json={"option": 0})


BEFORE = Ledger("offered", desired_workers=2, job_gpus=2, allocated=2, host_gpus=2, host_generation=1, undelivered=0)
AFTER = Ledger("accepted", desired_workers=3, job_gpus=3, allocated=3, host_gpus=3, host_generation=2, undelivered=0)


async def assert_agree(url: str, broker: NatsTenantBroker, negotiation_id: str, expected: Ledger) -> None:
    """The database is `expected`, and the host's desired state in the KV bucket is the same generation and size."""
    assert await ledger(url, negotiation_id) == expected
    assignment = await desired(broker)
    assert assignment.generation == expected.host_generation
    assert [(j.job, j.workers, j.gpus) for j in assignment.jobs] == [(JOB, expected.desired_workers,
                                                                      expected.job_gpus)]


def assert_events_once(events: list[Any], states: list[str]) -> None:
    ids = Counter(e.id for e in events)
    assert all(n == 1 for n in ids.values()), f"an outcome event stored twice: {ids}"
    assert [e.data.state for e in events] == states


async def test_killed_inside_the_accept_transaction_nothing_is_half_applied(
    tmp_path: Path, nats_server: NatsServer, tenant_broker: NatsTenantBroker, provider_secret: bytes,
    postgres_url: URL,
) -> None:
    url = postgres_url.render_as_string(hide_password=False)
    api = ApiService(tmp_path / "api", nats_server, provider_secret, database_url=url)
    dsn = postgres_url.set(drivername="postgresql").render_as_string(hide_password=False)
    locker = None
    pending: asyncio.Task[httpx.Response] | None = None
    try:
        await api.start()
        tenant = await world(api)
        negotiation_id = await open_scale_to_four(api, tenant)
        await eventually(lambda: _delivered(url, negotiation_id), timeout=15, what="the offer's rows delivered")
        await assert_agree(url, tenant_broker, negotiation_id, BEFORE)
        # the sweeper must have nothing to write while the outbox is locked: a capacity event it queued then would
        # hold the job's row (its capacity digest) while waiting for our lock, and the accept would wait behind it
        await bring_capacity_views_up_to_date(url, provider_secret)
        await eventually(lambda: _outbox_drained(url), timeout=15, what="every outbox row delivered")

        locker = await asyncpg.connect(dsn)
        await locker.execute("BEGIN; LOCK TABLE outbox IN EXCLUSIVE MODE")  # reads go on; inserts wait
        pending = asyncio.create_task(accept(api, tenant, negotiation_id))
        blocked = await _wait_for_blocked_insert(locker)
        held = {r["relname"] for r in await locker.fetch(
            "SELECT c.relname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
            "WHERE l.pid = $1 AND l.granted AND l.mode = 'RowExclusiveLock'", blocked)}
        assert {"jobs", "hosts", "allocations"} <= held, (
            f"the accept must be killed with its writes done but not committed; it held {sorted(held)}")
        api.kill()
        with pytest.raises(httpx.TransportError):
            await pending
        pending = None
        await locker.execute("ROLLBACK")
        await eventually(lambda: _backend_gone(locker, blocked), timeout=15, what="PostgreSQL ending the dead session")

        await api.start()
        # once the relay drained the outbox: a row the killed accept left would be delivered now, and fail the
        # events checked at the end
        await eventually(lambda: _delivered(url, negotiation_id), timeout=15, what="the restarted API's outbox drained")
        await assert_agree(url, tenant_broker, negotiation_id, BEFORE)  # nothing of the accept survived
        retried = await accept(api, tenant, negotiation_id)
        assert retried.status_code == 200, retried.text
        assert retried.json()["state"] == "accepted"
        await eventually(lambda: _delivered(url, negotiation_id), timeout=15, what="the accept's rows delivered")
        await assert_agree(url, tenant_broker, negotiation_id, AFTER)
        assert_events_once(await negotiation_events(tenant_broker), ["offered", "accepted"])
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        if locker is not None:
            await locker.close()
        await api.stop()


async def test_killed_after_accepting_with_the_placement_undelivered_the_change_is_carried_out_once(
    tmp_path: Path, nats_server: NatsServer, tenant_broker: NatsTenantBroker, provider_secret: bytes
) -> None:
    api = ApiService(tmp_path / "api", nats_server, provider_secret)  # SQLite in its data dir
    url = f"sqlite+aiosqlite:///{api.data_dir / 'harmonaize.db'}"
    try:
        await api.start()
        tenant = await world(api)
        negotiation_id = await open_scale_to_four(api, tenant)
        await eventually(lambda: _delivered(url, negotiation_id), timeout=15, what="the offer's rows delivered")
        await assert_agree(url, tenant_broker, negotiation_id, BEFORE)

        nats_server.stop()  # the relay cannot deliver: the accept's placement change stays in the outbox
        accepted = await accept(api, tenant, negotiation_id)
        assert accepted.status_code == 200, accepted.text
        # the host's new desired state and the tenant's event wait in the outbox (beside them the sweeper may already
        # have queued the capacity events the accept changed: those are not the accept's rows)
        assert await _undelivered_except_capacity(url) == [
            ("desired_state", host_key("h1")),
            ("tenant_event", tenant_event_subject("acme", EventKind.NEGOTIATION, JOB)),
        ]
        api.kill()

        nats_server.start()
        assert (await desired(tenant_broker)).generation == 1, "the placement change was not delivered before"
        await api.start()
        await eventually(lambda: _delivered(url, negotiation_id), timeout=20, what="the new process relaying")
        await assert_agree(url, tenant_broker, negotiation_id, AFTER)
        assert_events_once(await negotiation_events(tenant_broker), ["offered", "accepted"])
    finally:
        await api.stop()
        if not nats_server.is_running():
            nats_server.start()


async def _undelivered_except_capacity(url: str) -> list[tuple[str, str]]:
    engine = make_engine(url, single_use=True)
    try:
        async with engine.connect() as db:
            return await _undelivered_rows(db)
    finally:
        await engine.dispose()


async def _undelivered_rows(db: AsyncConnection) -> list[tuple[str, str]]:
    """(topic, subject) of each outbox row not yet published, in order, leaving out the sweeper's capacity events.

    The sweeper queues a capacity event whenever a job's view changed, on its own schedule (right after an offer, an
    accept or a restart): counting those would make every "nothing left undelivered" below a race with it.
    """
    rows = (await db.execute(text("SELECT topic, subject FROM outbox WHERE delivered_at IS NULL ORDER BY id"))).all()
    return [(str(topic).lower(), subject) for topic, subject in rows
            if not (str(topic).lower() == "tenant_event"
                    and parse_tenant_event_subject(subject).kind is EventKind.CAPACITY)]


async def bring_capacity_views_up_to_date(url: str, secret: bytes) -> None:
    """Queue every capacity event the sweeper would queue now, as it would (its guarded update decides a race with
    it): afterwards its ticks find every job's view unchanged and write nothing, until the ledger changes."""
    engine = make_engine(url, single_use=True)
    try:
        async with AsyncSession(engine) as session:
            await publish_capacity_changes(session, secret=secret, now=utcnow())
    finally:
        await engine.dispose()


async def _outbox_drained(url: str) -> bool:
    engine = make_engine(url, single_use=True)
    try:
        async with engine.connect() as db:
            return not (await db.execute(text("SELECT COUNT(*) FROM outbox WHERE delivered_at IS NULL"))).scalar_one()
    finally:
        await engine.dispose()


async def _delivered(url: str, negotiation_id: str) -> bool:
    return (await ledger(url, negotiation_id)).undelivered == 0


async def _wait_for_blocked_insert(db: asyncpg.Connection) -> int:
    """The pid of the API's backend once it waits for our lock to write into the outbox."""
    found: list[int] = []

    async def blocked() -> bool:
        found[:] = [r["pid"] for r in await db.fetch(
            "SELECT l.pid FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
            "WHERE c.relname = 'outbox' AND NOT l.granted AND l.mode = 'RowExclusiveLock'")]
        return bool(found)

    await eventually(blocked, timeout=15, interval=0.05, what="the accept waiting to write its outbox rows")
    assert len(found) == 1
    return found[0]


async def _backend_gone(db: asyncpg.Connection, pid: int) -> bool:
    return not await db.fetchval("SELECT COUNT(*) FROM pg_stat_activity WHERE pid = $1", pid)
