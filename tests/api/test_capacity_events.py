"""Capacity events from the control plane, on SQLite and PostgreSQL: each live job's tenant is told, through the
outbox, when what the job could grow into changes (another job came or went, a host went down or came back, a
quarantine ended), once per change, in the tenant's pseudonyms only."""

from __future__ import annotations

import json
from typing import Any

import httpx
from fastapi import FastAPI

from api.models import OutboxTopic
from api.services.capacity_events import publish_capacity_changes
from harmonaize.negotiation import RoundAction
from harmonaize.pseudonyms import host_pseudonym, locality_pseudonym
from tests.api.api_testkit import (
    ADMIN,
    PROVIDER_SECRET,
    FakeClock,
    TenantHandle,
    create_host,
    create_job,
    create_tenant,
)
from tests.api.negotiation_kit import act, negotiate, outbox

SECRET = PROVIDER_SECRET.encode()


async def sweep(app: FastAPI, clock: FakeClock) -> int:
    async with app.state.sessionmaker() as session:
        return await publish_capacity_changes(session, secret=SECRET, now=clock())


async def capacity_events(app: FastAPI, tenant: str, job: str) -> list[dict[str, Any]]:
    """The `data` of every capacity event queued for `tenant`'s `job`, oldest first."""
    subject = f"hz.t.{tenant}.events.capacity.{job}"
    rows = [row for row in await outbox(app, OutboxTopic.TENANT_EVENT) if row.subject == subject]
    return [json.loads(row.payload)["data"] for row in rows]


async def test_a_job_hears_of_capacity_when_it_changes_and_only_then(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    for host, group in (("h1", "rack-a"), ("h2", "rack-a"), ("h3", "rack-b"), ("h4", "rack-b")):
        await create_host(client, host, gpus=4, group=group)
    await create_job(client, acme, "train", min_workers=1, max_workers=4, gpus_per_worker=4, initial_workers=2)
    assert await sweep(app, clock) == 1
    (first,) = await capacity_events(app, "acme", "train")
    assert first["max_workers"] == 4
    groups = {entry["group"]: entry["free_gpus"] for entry in first["groups"]}
    assert groups == {locality_pseudonym(SECRET, "acme", "rack-a"): "none",
                      locality_pseudonym(SECRET, "acme", "rack-b"): "some"}
    assert "rack-" not in json.dumps(first) and "h3" not in json.dumps(first)
    assert await sweep(app, clock) == 0, "nothing changed: nothing sent"

    globex = await create_tenant(client, "globex")
    await create_job(client, globex, "big", min_workers=1, max_workers=2, gpus_per_worker=4, initial_workers=2)
    assert await sweep(app, clock) == 2, "acme's view shrank, and globex's job got its first"
    assert [e["max_workers"] for e in await capacity_events(app, "acme", "train")] == [4, 2]
    (theirs,) = await capacity_events(app, "globex", "big")
    assert theirs["max_workers"] == 2 and {g["group"] for g in theirs["groups"]}.isdisjoint(groups), "pseudonyms"

    allocations = await client.get("/v1/allocations", params={"tenant_id": "globex", "job_id": "big"},
                                   headers=ADMIN)
    for allocation in allocations.json():
        assert (await client.delete(f"/v1/allocations/{allocation['id']}", headers=ADMIN)).status_code == 200
    assert await sweep(app, clock) == 2
    assert [e["max_workers"] for e in await capacity_events(app, "acme", "train")] == [4, 2, 4]

    assert (await client.post("/v1/provider/hosts/h4/down", headers=ADMIN)).status_code == 200
    assert await sweep(app, clock) == 2
    assert [e["max_workers"] for e in await capacity_events(app, "acme", "train")] == [4, 2, 4, 3]


async def test_a_job_that_left_hosts_ahead_of_maintenance_hears_when_they_are_back(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    """The O1 cycle: grown onto h3, the job leaves it ahead of announced maintenance (quarantined, so not offered);
    the provider takes h3 down, then back up; only then does the job's view grow again."""
    for host in ("h1", "h2", "h3"):
        await create_host(client, host, gpus=4, group="rack-a")
    await create_job(client, acme, "train", min_workers=1, max_workers=3, gpus_per_worker=4, initial_workers=3)
    await sweep(app, clock)
    left = await negotiate(client, acme, "train", key="leave", desired_workers=2,
                           replace_hosts=[host_pseudonym(SECRET, "acme", "h3")])
    assert (await act(client, acme, left["id"], RoundAction.ACCEPT)).status_code == 200
    await sweep(app, clock)
    assert [e["max_workers"] for e in await capacity_events(app, "acme", "train")] == [3, 2], "h3 is quarantined"
    clock.advance(seconds=2)
    assert (await client.post("/v1/provider/hosts/h3/down", headers=ADMIN)).status_code == 200
    assert await sweep(app, clock) == 1, "the group's free GPUs went from some to none"
    assert (await capacity_events(app, "acme", "train"))[-1]["max_workers"] == 2, "down or quarantined: no room"
    clock.advance(seconds=10)
    assert (await client.post("/v1/provider/hosts/h3/up", headers=ADMIN)).status_code == 200
    assert await sweep(app, clock) == 1
    assert [e["max_workers"] for e in await capacity_events(app, "acme", "train")] == [3, 2, 2, 3]
