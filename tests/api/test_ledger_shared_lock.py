"""Accepts on different hosts run side by side on PostgreSQL; on a common host, or out of order, they still serialise.

An accepted resize holds the ledger shared and locks only its job and hosts (`api.services.ledger_lock`). A second
session stands for an accept caught in the middle (the ledger held shared, a host's row locked, uncommitted): an
accept on another host must finish meanwhile, one on that host must wait for it. An accept whose planned host is
taken while it waits, so that its placement moves to a host sorting before one it holds, is redone holding the
whole ledger (counted in `/v1/metrics`) and still places its worker. A grow on the one host its job runs on leaves
that host's lock to its grant's update, which must then really hold it; if that update finds the host full after
all, the host is locked before the next one, so the order holds and nothing is redone. A shrink's update of its job
locks the job's hosts itself (another session cannot have them) and reads the allocations it releases; a grow's
reads the hosts as they are when it runs. Many accepts at once on jobs spread over several hosts leave the
ledger's totals equal and each host's last desired state equal to what the ledger holds.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Sequence

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select, text
from sqlalchemy.exc import DBAPIError

from api.models import Allocation, Job, OutboxTopic
from api.services import ledger_rows
from api.services.ledger import (
    change_job_workers,
    change_job_workers_reading,
    new_allocation_id,
    place_workers,
    release_workers,
)
from api.services.ledger_hosts import host_snapshot
from api.services.ledger_lock import LedgerOrderError, hold_hosts, hold_job, share_ledger
from harmonaize.desired_state import HostAssignment
from tests.api.api_testkit import ADMIN, FakeClock, TenantHandle, create_host, create_job
from tests.api.negotiation_kit import ROW, ledger_totals, negotiate, outbox, waiting
from tests.api.test_negotiations_concurrency import hosts_of
from tests.support import eventually


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest) -> str:
    """PostgreSQL only: SQLite has one writer at a time, so there is no lock to share."""
    return str(request.param)


async def _metrics(client: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the app process's `/v1/metrics` (process-wide counters: compare before and after)."""
    response = await client.get("/v1/metrics", headers=ADMIN)
    assert response.status_code == 200, response.text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text) for sample in family.samples
    }


def _grown(before: dict[tuple[str, tuple[tuple[str, str], ...]], float],
           after: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


async def _accept(client: httpx.AsyncClient, tenant: TenantHandle, offer: dict[str, object]) -> httpx.Response:
    return await client.post(f"/v1/negotiations/{offer['id']}/accept", json={"option": 0}, headers=tenant.headers)


async def _grow_offer(client: httpx.AsyncClient, tenant: TenantHandle, job: str, workers: int) -> dict[str, object]:
    offer = await negotiate(client, tenant, job, key=f"{job}-{workers}", desired_workers=workers)
    assert offer["state"] == "offered", offer
    return offer


async def _last_assignments(app: FastAPI) -> dict[str, HostAssignment]:
    """Each host's last queued desired state (the outbox in delivery order), checking generations only grow."""
    last: dict[str, HostAssignment] = {}
    for row in await outbox(app, OutboxTopic.DESIRED_STATE):
        assignment = HostAssignment.model_validate_json(row.payload)
        if (before := last.get(assignment.host)) is not None:
            assert assignment.generation > before.generation, (before, assignment)
        last[assignment.host] = assignment
    return last


async def _ledger_workers(app: FastAPI) -> dict[str, dict[str, int]]:
    """Workers per host per job, from the live allocations."""
    async with app.state.sessionmaker() as session:
        rows = await session.execute(
            select(Allocation.host_id, Allocation.job_id, Allocation.gpus, Job.gpus_per_worker)
            .join(Job, (Job.tenant_id == Allocation.tenant_id) & (Job.id == Allocation.job_id))
            .where(Allocation.released_at.is_(None))
        )
        workers: dict[str, Counter[str]] = {}
        for host, job, gpus, per_worker in rows:
            workers.setdefault(host, Counter())[job] += gpus // per_worker
    return {host: dict(jobs) for host, jobs in workers.items()}


async def test_an_accept_on_another_host_finishes_while_one_on_its_own_host_waits(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    await create_host(client, "h1", gpus=8, group="rack-a")
    await create_host(client, "h2", gpus=8, group="rack-b")
    await create_job(client, acme, "a", initial_workers=1)
    await create_job(client, acme, "b", initial_workers=1)
    assert (await hosts_of(app, "a"), await hosts_of(app, "b")) == (["h1"], ["h2"])
    grow_a, grow_b = await _grow_offer(client, acme, "a", 2), await _grow_offer(client, acme, "b", 2)
    before = await _metrics(client)

    async with app.state.sessionmaker() as holder:  # an accept of job a, caught between locking h1 and committing
        assert await share_ledger(holder, ("acme", "a"))
        await hold_hosts(holder, ["h1"])
        done_b = await asyncio.wait_for(_accept(client, acme, grow_b), timeout=30)
        assert done_b.status_code == 200, done_b.text
        waiting_a = asyncio.create_task(_accept(client, acme, grow_a))
        await eventually(lambda: waiting(app, ROW, at_least=1), timeout=20, what="the accept on h1 waiting for its row")
        assert not waiting_a.done()
        await holder.rollback()
        done_a = await asyncio.wait_for(waiting_a, timeout=30)

    assert done_a.status_code == 200, done_a.text
    assert (await hosts_of(app, "a"), await hosts_of(app, "b")) == (["h1", "h1"], ["h2", "h2"])
    assert await ledger_totals(app) == (4, 4, 4)
    last = await _last_assignments(app)
    assert {host: [(job.job, job.workers) for job in last[host].jobs] for host in ("h1", "h2")} == {
        "h1": [("a", 2)], "h2": [("b", 2)],
    }
    after = await _metrics(client)  # the two accepts' waits and holds, timed (the holder's share too)
    assert _grown(before, after, "hz_ledger_lock_wait_seconds_count", mode="shared") == 3
    assert _grown(before, after, "hz_ledger_lock_held_seconds_count", mode="shared") == 3
    assert _grown(before, after, "hz_ledger_lock_wait_seconds_count", mode="whole") == 0
    assert _grown(before, after, "hz_ledger_hosts_wait_seconds_count") == 3
    assert _grown(before, after, "hz_ledger_hosts_wait_seconds_sum") > 0


async def test_an_accept_whose_planned_host_is_taken_while_it_waits_is_redone_holding_the_whole_ledger(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    """Job j runs on h3 (full) and would grow onto h2 (its rack); another change takes h2's last GPU while the accept
    waits for h2's row. Its worker must then go to h1, which sorts before h3, already locked: the accept is redone
    holding the whole ledger, and records one accept, not two."""
    await create_host(client, "h3", gpus=1, group="rack-a")
    await create_job(client, acme, "j", initial_workers=1)
    await create_job(client, acme, "k")  # no workers yet: the other change gives it h2's GPU
    await create_host(client, "h2", gpus=1, group="rack-a")
    await create_host(client, "h1", gpus=8, group="rack-b")
    grow = await _grow_offer(client, acme, "j", 2)
    before = await _metrics(client)

    async with app.state.sessionmaker() as holder:
        await share_ledger(holder, ("acme", "k"))
        k = await holder.get_one(Job, ("acme", "k"))
        await change_job_workers(holder, k, 1)
        await hold_hosts(holder, ["h2"])
        assert await ledger_rows.grant(holder, Allocation(
            id=new_allocation_id(), tenant_id="acme", job_id="k", host_id="h2", gpus=1, created_at=clock.now,
            starts_at=None,
        ))
        accepting = asyncio.create_task(_accept(client, acme, grow))
        await eventually(lambda: waiting(app, ROW, at_least=1), timeout=20, what="the accept waiting for h2's row")
        await holder.commit()
        response = await asyncio.wait_for(accepting, timeout=30)

    assert response.status_code == 200, response.text
    assert [step["action"] for step in response.json()["rounds"]] == ["request", "offer", "accept"]
    assert (await hosts_of(app, "j"), await hosts_of(app, "k")) == (["h1", "h3"], ["h2"])
    assert await ledger_totals(app) == (3, 3, 3)
    after = await _metrics(client)
    assert _grown(before, after, "hz_accepts_redone_whole_ledger_total") == 1, "counted in /v1/metrics"
    assert _grown(before, after, "hz_ledger_lock_wait_seconds_count", mode="whole") == 1


async def test_the_shared_mode_refuses_rows_out_of_its_order(app: FastAPI, client: httpx.AsyncClient) -> None:
    await create_host(client, "h1", gpus=8, group="rack-a")
    await create_host(client, "h2", gpus=8, group="rack-a")
    async with app.state.sessionmaker() as session:
        await share_ledger(session, ("acme", "a"))
        await hold_hosts(session, ["h2"])
        with pytest.raises(LedgerOrderError, match="'h1' sorts before"):
            await hold_hosts(session, ["h1"])
        with pytest.raises(LedgerOrderError, match="'b' is not the job"):
            hold_job(session, ("acme", "b"))
        hold_job(session, ("acme", "a"))
        await hold_hosts(session, ["h2"])  # held already: nothing to do
        await session.rollback()
        await hold_hosts(session, ["h1"])  # the transaction ended, and with it the shared mode: no lock, no check
        hold_job(session, ("acme", "b"))
        await session.rollback()


async def test_many_accepts_at_once_over_several_hosts_leave_the_ledger_and_each_host_agreeing(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    """Grows and shrinks of ten jobs at once, three times over, on four hosts small enough that grown jobs span
    hosts (so accepts of different jobs meet on common hosts, in both orders)."""
    for index, group in zip(range(1, 5), itertools.cycle(["rack-a", "rack-b"]), strict=False):
        await create_host(client, f"h{index}", gpus=5, group=group)
    jobs = [f"job-{index}" for index in range(10)]
    for job in jobs:
        await create_job(client, acme, job, initial_workers=1, max_workers=4)

    for cycle, target in enumerate([3, 1, 2, 1, 3]):
        offers = []
        for job in jobs:
            offer = await negotiate(client, acme, job, key=f"{job}-{cycle}", desired_workers=target)
            if offer["state"] == "offered":
                offers.append(offer)
        responses = await asyncio.gather(*(_accept(client, acme, offer) for offer in offers))
        refused = [r.json()["reason"] for r in responses if r.status_code != 200]
        assert all(r.status_code in (200, 409) for r in responses), [r.text for r in responses]
        assert all("capacity for this option is gone" in reason for reason in refused), refused
        hosts, rows, placed = await ledger_totals(app)
        assert hosts == rows == placed <= 20, (cycle, hosts, rows, placed)

    ledger = await _ledger_workers(app)
    assert sum(len(jobs_on) > 0 for jobs_on in ledger.values()) >= 3, ledger
    last = await _last_assignments(app)
    assert {host: {job.job: job.workers for job in last[host].jobs} for host in last if last[host].jobs} == ledger


async def test_a_shrinks_update_of_its_job_locks_the_jobs_hosts_in_the_same_statement(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    """Its hosts are recorded as held and are not locked again: so the update must really hold them, as another
    session asking for them without waiting finds."""
    await create_host(client, "h1", gpus=2, group="rack-a")
    await create_host(client, "h2", gpus=2, group="rack-a")
    await create_host(client, "h3", gpus=2, group="rack-a")
    await create_job(client, acme, "wide", initial_workers=3, max_workers=4, gpus_per_worker=1)
    await create_job(client, acme, "solo", initial_workers=1)
    wide, solo = set(await hosts_of(app, "wide")), set(await hosts_of(app, "solo"))
    assert len(wide) == 2 and not solo <= wide, (wide, solo)

    async with app.state.sessionmaker() as shrinking, app.state.sessionmaker() as other:
        await share_ledger(shrinking, ("acme", "wide"))
        job = await shrinking.get_one(Job, ("acme", "wide"))
        assert await change_job_workers_reading(shrinking, job, -1, expected_workers=3, quarantine_since=clock.now)
        await hold_hosts(shrinking, wide)  # held already: no statement, no error
        for host in sorted({"h1", "h2", "h3"}):
            try:
                await other.execute(text("SELECT id FROM hosts WHERE id = :id FOR NO KEY UPDATE NOWAIT"), {"id": host})
                free = True
            except DBAPIError as refused:
                assert "could not obtain lock" in str(refused), refused
                free = False
            await other.rollback()
            assert free is (host not in wide), (host, wide)
        await shrinking.rollback()


async def test_a_shrinks_update_of_its_job_reads_the_allocations_it_releases_as_the_ledger_holds_them(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    """The release takes the job's most recent workers from the rows that update read (one JSON column): they must
    be the live rows a statement of their own reads, in its order, with their exact times (a reservation's start
    included), or the wrong worker goes."""
    await create_host(client, "h1", gpus=2, group="rack-a")
    await create_host(client, "h2", gpus=2, group="rack-a")
    await create_job(client, acme, "wide", initial_workers=3, max_workers=4, gpus_per_worker=1)
    async with app.state.sessionmaker() as admin:
        reserved = await admin.scalar(text(
            "UPDATE allocations SET starts_at = now() + interval '1 hour 0.000123 second' WHERE id = "
            "(SELECT min(id) FROM allocations WHERE job_id = 'wide') RETURNING id"
        ))
        await admin.commit()

    async with app.state.sessionmaker() as shrinking:
        await share_ledger(shrinking, ("acme", "wide"))
        job = await shrinking.get_one(Job, ("acme", "wide"))
        moved = await change_job_workers_reading(shrinking, job, -1, expected_workers=3, quarantine_since=clock.now)
        assert moved is not None and moved.most_recent_first is not None and moved.hosts is None
        own_read = (await shrinking.scalars(
            select(Allocation).where(Allocation.job_id == "wide", Allocation.released_at.is_(None))
            .order_by(Allocation.created_at.desc(), Allocation.id.desc())
        )).all()

        def fields(rows: Sequence[Allocation]) -> list[tuple[object, ...]]:
            return [(a.id, a.tenant_id, a.job_id, a.host_id, a.gpus, a.created_at, a.starts_at) for a in rows]

        assert fields(moved.most_recent_first) == fields(own_read) and len(own_read) == 3
        assert [a.starts_at is not None for a in moved.most_recent_first] == [a.id == reserved for a in own_read]
        touched = await release_workers(shrinking, job, 1, now=clock.now, most_recent_first=moved.most_recent_first)
        assert touched == {own_read[0].host_id}
        released = await shrinking.scalars(select(Allocation.id).where(Allocation.released_at.is_not(None)))
        assert list(released) == [own_read[0].id]
        await shrinking.rollback()


async def test_a_grows_update_of_its_job_reads_the_hosts_as_they_are_when_it_runs(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    """The placement of an accepted grow starts from the hosts its counters' update read: they must be the ledger's
    as that statement runs (a host gone down in a commit after the transaction began is no longer a room), equal to
    what a statement of their own reads next; an update the job's size refuses changes nothing and reads nothing."""
    await create_host(client, "h1", gpus=2, group="rack-a")
    await create_host(client, "h2", gpus=4, group="rack-b")
    await create_job(client, acme, "train", initial_workers=1, max_workers=3, gpus_per_worker=1)
    (own,) = await hosts_of(app, "train")
    other_host = ({"h1", "h2"} - {own}).pop()

    async with app.state.sessionmaker() as growing, app.state.sessionmaker() as admin:
        await share_ledger(growing, ("acme", "train"))
        job = await growing.get_one(Job, ("acme", "train"))
        refused = await change_job_workers_reading(growing, job, 1, expected_workers=2, quarantine_since=clock.now)
        assert refused is None, "the job has 1 worker, not 2"
        await admin.execute(text("UPDATE hosts SET down_at = now() WHERE id = :id"), {"id": other_host})
        await admin.commit()
        moved = await change_job_workers_reading(growing, job, 1, expected_workers=1, quarantine_since=clock.now)
        assert moved is not None and moved.hosts is not None
        assert moved.hosts == await host_snapshot(growing, job)
        assert [room[0] for room in moved.hosts.rooms] == [own], "the other host went down after the lock was taken"
        assert moved.hosts.usage == {own: ("rack-a" if own == "h1" else "rack-b", 1)}
        assert job.desired_workers == 2, "the update read the job again"
        placed = await place_workers(growing, job, 1, now=clock.now, snapshot=moved.hosts)
        assert [placement.allocation.host_id for placement in placed] == [own]
        await growing.rollback()
    assert await _ledger_workers(app) == {own: {"train": 1}}, "rolled back: nothing changed"


async def _locked_elsewhere(app: FastAPI, hosts: list[str]) -> dict[str, bool]:
    """Whether another session finds each host's row locked (asking without waiting)."""
    locked = {}
    async with app.state.sessionmaker() as other:
        for host in hosts:
            try:
                await other.execute(text("SELECT id FROM hosts WHERE id = :id FOR NO KEY UPDATE NOWAIT"), {"id": host})
                locked[host] = False
            except DBAPIError as refused:
                assert "could not obtain lock" in str(refused), refused
                locked[host] = True
            await other.rollback()
    return locked


async def test_a_grow_on_its_own_host_is_locked_by_its_grant_and_records_the_wait(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    """No statement of its own locks the host: so the grant's update must hold it, and later writes of the host
    (its new desired state) must not lock it again."""
    await create_host(client, "h1", gpus=4, group="rack-a")
    await create_host(client, "h2", gpus=4, group="rack-a")
    await create_job(client, acme, "j", initial_workers=1)
    assert await hosts_of(app, "j") == ["h1"]
    before = await _metrics(client)

    async with app.state.sessionmaker() as growing:
        await share_ledger(growing, ("acme", "j"))
        job = await growing.get_one(Job, ("acme", "j"))
        placed = await place_workers(growing, job, 1, now=clock.now)
        assert [p.allocation.host_id for p in placed] == ["h1"]
        assert await _locked_elsewhere(app, ["h1", "h2"]) == {"h1": True, "h2": False}
        with pytest.raises(LedgerOrderError, match="'h0' sorts before"):  # h1 recorded as held
            await hold_hosts(growing, ["h0"])
        await growing.rollback()

    after = await _metrics(client)
    assert _grown(before, after, "hz_ledger_hosts_wait_seconds_count") == 1, "the grant's wait is the host's"


async def test_a_grow_whose_own_host_fills_while_its_grant_waits_locks_it_and_moves_on_in_order(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    """Job j runs on h1 with one GPU to spare; another change takes that GPU while j's grant waits for h1's row.
    The grant then matches nothing and locks nothing, so h1 is locked before j's worker goes to h2 (after h1 in
    the order): placed, and not redone."""
    await create_host(client, "h1", gpus=2, group="rack-a")
    await create_job(client, acme, "j", initial_workers=1)
    await create_job(client, acme, "k")
    await create_host(client, "h2", gpus=8, group="rack-b")
    grow = await _grow_offer(client, acme, "j", 2)
    before = await _metrics(client)

    async with app.state.sessionmaker() as holder:
        await share_ledger(holder, ("acme", "k"))
        k = await holder.get_one(Job, ("acme", "k"))
        await change_job_workers(holder, k, 1)
        await hold_hosts(holder, ["h1"])
        assert await ledger_rows.grant(holder, Allocation(
            id=new_allocation_id(), tenant_id="acme", job_id="k", host_id="h1", gpus=1, created_at=clock.now,
            starts_at=None,
        ))
        accepting = asyncio.create_task(_accept(client, acme, grow))
        await eventually(lambda: waiting(app, ROW, at_least=1), timeout=20, what="the grant waiting for h1's row")
        await holder.commit()
        response = await asyncio.wait_for(accepting, timeout=30)

    assert response.status_code == 200, response.text
    assert (await hosts_of(app, "j"), await hosts_of(app, "k")) == (["h1", "h2"], ["h1"])
    assert await ledger_totals(app) == (3, 3, 3)
    after = await _metrics(client)
    assert _grown(before, after, "hz_accepts_redone_whole_ledger_total") == 0
    assert _grown(before, after, "hz_ledger_lock_wait_seconds_count", mode="whole") == 0
