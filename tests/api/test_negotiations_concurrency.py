"""Concurrent acceptances against limited capacity, and the per-job cap, on SQLite and PostgreSQL.

The capacity ledger must end exactly full, never beyond, with its three running totals (hosts, live allocation rows,
jobs) agreeing, however the concurrent transactions interleave; losers get 409 with a reason and change nothing.
"""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI
from sqlalchemy import func, select

from api.models import Host, Negotiation
from api.models_quarantines import JobHostQuarantine
from api.services.allocations import list_placements
from api.services.ledger_lock import lock_ledger
from harmonaize.negotiation import NegotiationState
from harmonaize.pseudonyms import host_pseudonym
from tests.api.api_testkit import ADMIN, PROVIDER_SECRET, FakeClock, TenantHandle, create_host, create_job
from tests.api.negotiation_kit import ADVISORY, ledger_totals, negotiate, waiting
from tests.support import eventually

JOBS = 50
HOSTS = [("h-a1", 4, "rack-a"), ("h-a2", 4, "rack-a"), ("h-b1", 2, "rack-b")]
TOTAL_GPUS = sum(gpus for _, gpus, _ in HOSTS)


async def test_fifty_concurrent_accepts_exactly_fill_capacity(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    for host_id, gpus, group in HOSTS:
        await create_host(client, host_id, gpus=gpus, group=group)
    offers = []
    for index in range(JOBS):
        await create_job(client, acme, f"job-{index}")
        offers.append(await negotiate(client, acme, f"job-{index}", key=f"k{index}", desired_workers=1))
    assert all(offer["state"] == "offered" for offer in offers), "each one alone would fit"

    responses = await asyncio.gather(
        *(client.post(f"/v1/negotiations/{offer['id']}/accept", json={"option": 0}, headers=acme.headers)
          for offer in offers)
    )
    statuses = [response.status_code for response in responses]
    assert statuses.count(200) == TOTAL_GPUS and statuses.count(409) == JOBS - TOTAL_GPUS, statuses
    assert all("capacity for this option is gone" in r.json()["reason"] for r in responses if r.status_code == 409)

    assert await ledger_totals(app) == (TOTAL_GPUS, TOTAL_GPUS, TOTAL_GPUS)
    async with app.state.sessionmaker() as session:
        assert all(host.allocated_gpus == host.gpus for host in await session.scalars(select(Host)))
        counted = await session.execute(select(Negotiation.state, func.count()).group_by(Negotiation.state))
        states = dict(counted.all())
    assert states == {NegotiationState.ACCEPTED: TOTAL_GPUS, NegotiationState.OFFERED: JOBS - TOTAL_GPUS}
    jobs = (await client.get("/v1/jobs", headers=acme.headers)).json()
    assert sum(job["desired_workers"] for job in jobs) == TOTAL_GPUS


async def test_two_accepts_of_one_offer_cannot_both_win(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    await create_host(client, "h1", gpus=8, group="rack-a")
    await create_job(client, acme, "train")
    offer = await negotiate(client, acme, "train", key="once", desired_workers=2)
    responses = await asyncio.gather(
        *(client.post(f"/v1/negotiations/{offer['id']}/accept", json={"option": 0}, headers=acme.headers)
          for _ in range(6))
    )
    statuses = sorted(response.status_code for response in responses)
    assert statuses == [200] + [409] * 5, statuses
    assert {r.json()["reason"] for r in responses if r.status_code == 409} == {"negotiation is accepted: cannot accept"}
    assert await ledger_totals(app) == (2, 2, 2)


async def test_two_offers_of_one_job_accepted_together_both_apply_to_the_job_as_it_then_is(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    """An accept reads its job before it waits for the ledger lock; one that waited behind another accept of the same
    job must carry out its target on the job as that one left it (an offer's size is absolute), not fail on, or
    apply a delta to, the size it read. On PostgreSQL the lock is held from outside until both accepts wait for it,
    so both have read the job at one worker; SQLite runs them one after the other."""
    await create_host(client, "h1", gpus=8, group="rack-a")
    await create_job(client, acme, "train", max_workers=4, initial_workers=1)
    to_three = await negotiate(client, acme, "train", key="three", desired_workers=3)
    to_two = await negotiate(client, acme, "train", key="two", desired_workers=2)
    assert to_three["state"] == to_two["state"] == "offered"

    async with app.state.sessionmaker() as holder:
        locked = await lock_ledger(holder)
        accepts = [
            asyncio.create_task(client.post(f"/v1/negotiations/{offer['id']}/accept", json={"option": 0},
                                            headers=acme.headers))
            for offer in (to_three, to_two)
        ]
        if locked:  # the sweeper may wait too: at least two
            await eventually(lambda: waiting(app, ADVISORY, at_least=2), timeout=20,
                             what="both accepts waiting for the ledger lock")
        await holder.rollback()
        responses = await asyncio.gather(*accepts)

    assert [response.status_code for response in responses] == [200, 200], [r.text for r in responses]
    job = (await client.get("/v1/jobs/train", headers=acme.headers)).json()
    assert job["desired_workers"] in (2, 3)
    assert await ledger_totals(app) == (job["desired_workers"],) * 3


async def test_an_accept_that_waited_while_its_job_was_kept_off_a_host_places_nothing_there(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    """What changed about a job while its accept waited for the ledger lock counts, not only its size: here another
    transaction keeps the job off the host it runs on (as an accepted replacement does) while the accept of a grow
    waits behind it. Read before the wait, the job had left no host, so the new worker would join it on that host; on
    PostgreSQL the update of the job's counters reads it again (`ledger.change_job_workers_reading`)."""
    await create_host(client, "h1", gpus=8, group="rack-a")
    await create_job(client, acme, "train", max_workers=4, initial_workers=1)
    await create_host(client, "h2", gpus=8, group="rack-a")
    assert await hosts_of(app, "train") == ["h1"]
    grow = await negotiate(client, acme, "train", key="grow", desired_workers=2)
    assert grow["state"] == "offered"

    async with app.state.sessionmaker() as holder:
        locked = await lock_ledger(holder)
        holder.add(JobHostQuarantine(
            tenant_id=acme.id, job_id="train", host_name=host_pseudonym(PROVIDER_SECRET.encode(), acme.id, "h1"),
            left_at=clock.now,
        ))
        await holder.flush()
        accept = asyncio.create_task(
            client.post(f"/v1/negotiations/{grow['id']}/accept", json={"option": 0}, headers=acme.headers)
        )
        if locked:
            await eventually(lambda: waiting(app, ADVISORY, at_least=1), timeout=20,
                             what="the accept waiting for the ledger lock")
        await holder.commit()
        response = await accept

    assert response.status_code == 200, response.text
    assert await hosts_of(app, "train") == ["h1", "h2"], "the new worker stays off the host the job was kept off"


async def hosts_of(app: FastAPI, job: str) -> list[str]:
    """The internal hosts of the job's live allocations (one entry per allocation), sorted."""
    async with app.state.sessionmaker() as session:
        return sorted(p.allocation.host_id for p in await list_placements(session, tenant_id="acme", job_id=job))


async def test_the_job_cap_holds_under_concurrent_admin_allocations(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    await create_host(client, "h1", gpus=16, group="rack-a")
    await create_job(client, acme, "pair", min_workers=1, max_workers=3, gpus_per_worker=2)
    body = {"tenant_id": "acme", "job_id": "pair", "gpus": 2}
    responses = await asyncio.gather(*(client.post("/v1/allocations", json=body, headers=ADMIN) for _ in range(10)))
    statuses = [response.status_code for response in responses]
    assert statuses.count(201) == 3 and statuses.count(409) == 7, statuses
    assert all("at most 3 workers" in r.json()["reason"] for r in responses if r.status_code == 409)
    assert await ledger_totals(app) == (6, 6, 6)
    odd = await client.post("/v1/allocations", json={**body, "gpus": 1}, headers=ADMIN)
    assert odd.status_code == 422 and "multiple" in odd.json()["reason"]

    first = (await client.get("/v1/allocations", headers=ADMIN)).json()[0]
    assert (await client.delete(f"/v1/allocations/{first['id']}", headers=ADMIN)).status_code == 200
    assert (await client.get("/v1/jobs/pair", headers=acme.headers)).json()["desired_workers"] == 2
    assert await ledger_totals(app) == (4, 4, 4)


async def test_initial_workers_are_placed_whole_or_not_at_all(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    await create_host(client, "h1", gpus=3, group="rack-a")
    await create_host(client, "h2", gpus=3, group="rack-b")
    refused = await client.post(
        "/v1/jobs", json={"id": "wide", "min_workers": 1, "max_workers": 4, "gpus_per_worker": 2,
                          "initial_workers": 3}, headers=acme.headers,
    )
    assert refused.status_code == 409, "6 GPUs free, but only one 2-GPU worker fits per host"
    assert "room for 2 of the 3" in refused.json()["reason"] and "not created" in refused.json()["reason"]
    assert (await client.get("/v1/jobs/wide", headers=acme.headers)).status_code == 404
    assert await ledger_totals(app) == (0, 0, 0)

    out_of_range = await client.post(
        "/v1/jobs", json={"id": "x", "min_workers": 2, "max_workers": 4, "initial_workers": 1}, headers=acme.headers
    )
    assert out_of_range.status_code == 422
    assert {error["field"] for error in out_of_range.json()["errors"]} == {"body.initial_workers"}

    placed = await create_job(client, acme, "wide", gpus_per_worker=2, initial_workers=2)
    assert placed["desired_workers"] == 2
    allocations = (await client.get("/v1/jobs/wide/allocations", headers=acme.headers)).json()
    assert sorted(a["gpus"] for a in allocations) == [2, 2] and len({a["host"] for a in allocations}) == 2
