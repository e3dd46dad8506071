"""A failure reaction moves the job off the failing host, on SQLite and PostgreSQL.

The tenant keeps its size after a failure (or a predicted one) and names the host as its Failure event did
(`replace_hosts`, the tenant's pseudonym): the provider offers the worker on a healthy host where there is room and
says so, drops it when the tenant's range allows and there is none, declines otherwise; the accepted option commits
the ledger (failing host out, healthy host in), a new epoch on the new host set, and the job's status shows it; the
job is not placed back on that host until the quarantine ends, or until the host was down and came back up.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select

from api.models import Host, OutboxTopic
from api.models_quarantines import JobHostQuarantine
from api.services.allocations import list_placements
from api.services.worker_replacement import QUARANTINE
from harmonaize.desired_state import HostAssignment
from harmonaize.negotiation import RoundAction
from harmonaize.pseudonyms import host_pseudonym
from tests.api.api_testkit import ADMIN, PROVIDER_SECRET, FakeClock, TenantHandle, create_host, create_job, field_names
from tests.api.negotiation_kit import act, ledger_totals, negotiate, outbox

INTERNAL_HOST = re.compile(r"\bh[1-3]\b")


def seen_as(tenant: TenantHandle, host: str) -> str:
    """The name `tenant`'s events give `host`."""
    return host_pseudonym(PROVIDER_SECRET.encode(), tenant.id, host)


async def hosts_of(app: FastAPI, job: str) -> list[str]:
    """The internal hosts of the job's live allocations (one entry per allocation), sorted."""
    async with app.state.sessionmaker() as session:
        return sorted(p.allocation.host_id for p in await list_placements(session, tenant_id="acme", job_id=job))


async def allocated(app: FastAPI) -> dict[str, tuple[int, int]]:
    """(allocated, total) GPUs per host."""
    async with app.state.sessionmaker() as session:
        return {host.id: (host.allocated_gpus, host.gpus) for host in await session.scalars(select(Host))}


async def status(client: httpx.AsyncClient, tenant: TenantHandle, job: str) -> dict[str, Any]:
    response = await client.get(f"/v1/jobs/{job}/status", headers=tenant.headers)
    assert response.status_code == 200, response.text
    return response.json()


def only_option(answer: dict[str, Any]) -> dict[str, Any]:
    assert answer["state"] == "offered", answer["rounds"][-1]["note"]
    (option,) = answer["offer"]["options"]
    assert not INTERNAL_HOST.search(option["reason"]), option["reason"]
    return option


@pytest.fixture
async def placed(app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle) -> TenantHandle:
    """A 1-4 worker job (one whole 4-GPU host per worker) on h1 and h2 of rack-a; h3 (rack-b) is free."""
    for host, group in (("h1", "rack-a"), ("h2", "rack-a"), ("h3", "rack-b")):
        await create_host(client, host, gpus=4, group=group)
    await create_job(client, acme, "train", min_workers=1, max_workers=4, gpus_per_worker=4, initial_workers=2)
    assert await hosts_of(app, "train") == ["h1", "h2"]
    return acme


async def test_the_failing_hosts_worker_moves_to_a_healthy_host_with_a_new_epoch(
    app: FastAPI, client: httpx.AsyncClient, placed: TenantHandle
) -> None:
    failing = seen_as(placed, "h1")
    before = await status(client, placed, "train")
    answer = await negotiate(client, placed, "train", key="xid79", desired_workers=2,
                             accept_workers={"min": 1, "max": 2}, replace_hosts=[failing])
    option = only_option(answer)
    assert (option["workers"], option["replaced_hosts"], option["start_at"]) == (2, [failing], None)
    assert option["reason"].startswith("2 workers now: 1 worker on ") and failing in option["reason"]
    assert "moves to a healthy host" in option["reason"] and "already running" not in option["reason"]
    assert answer["rounds"][-1]["note"] == option["reason"]
    desired_before = len(await outbox(app, OutboxTopic.DESIRED_STATE))

    accepted = await act(client, placed, answer["id"], RoundAction.ACCEPT)
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["state"] == "accepted"
    assert await hosts_of(app, "train") == ["h2", "h3"], "the failing host out, the healthy one in"
    assert (await allocated(app))["h1"] == (0, 4)
    assert await ledger_totals(app) == (8, 8, 8)

    after = await status(client, placed, "train")
    assert after["desired_workers"] == 2 and after["placement_epoch"] == before["placement_epoch"] + 1
    mine = (await client.get("/v1/jobs/train/allocations", headers=placed.headers)).json()
    assert sorted(a["host"] for a in mine) == sorted([seen_as(placed, "h2"), seen_as(placed, "h3")])

    rows = (await outbox(app, OutboxTopic.DESIRED_STATE))[desired_before:]
    written = {a.host: a for a in (HostAssignment.model_validate_json(row.payload) for row in rows)}
    assert sorted(written) == ["h1", "h2", "h3"], "every host of the old and the new node set is rewritten"
    assert written["h1"].jobs == ()
    for host in ("h2", "h3"):
        (job,) = written[host].jobs
        assert (job.job, job.workers, job.epoch, job.nodes) == ("train", 1, after["placement_epoch"], 2)


async def test_the_job_is_not_placed_back_on_the_host_it_replaced_until_the_quarantine_ends(
    app: FastAPI, client: httpx.AsyncClient, placed: TenantHandle, clock: FakeClock
) -> None:
    moved = await negotiate(client, placed, "train", key="move", desired_workers=2,
                            replace_hosts=[seen_as(placed, "h1")])
    assert (await act(client, placed, moved["id"], RoundAction.ACCEPT)).status_code == 200
    assert (await allocated(app))["h1"] == (0, 4)

    grow = await negotiate(client, placed, "train", key="grow", desired_workers=3)
    assert grow["state"] == "declined" and "room for 0 more" in grow["rounds"][-1]["note"], "h1 is free but failing"
    clock.advance(seconds=QUARANTINE.total_seconds() + 1)
    later = await negotiate(client, placed, "train", key="later", desired_workers=3)
    assert only_option(later)["workers"] == 3
    assert (await act(client, placed, later["id"], RoundAction.ACCEPT)).status_code == 200
    assert await hosts_of(app, "train") == ["h1", "h2", "h3"]


async def quarantined(app: FastAPI) -> list[tuple[str, str]]:
    """The (job, host name) rows of the quarantine table, in the order written."""
    async with app.state.sessionmaker() as session:
        rows = await session.execute(
            select(JobHostQuarantine.job_id, JobHostQuarantine.host_name).order_by(JobHostQuarantine.id)
        )
        return [(job, name) for job, name in rows]


async def test_a_replacement_keeps_the_hosts_it_left_and_prunes_what_no_longer_counts(
    app: FastAPI, client: httpx.AsyncClient, placed: TenantHandle, clock: FakeClock
) -> None:
    """The accept writes one row per host it moved the job off (offers read those, not every accepted offer of the
    hour); a later replacement drops the rows whose quarantine is over."""
    assert await quarantined(app) == []
    for key, workers in (("grow", 3), ("shrink", 2)):
        resized = await negotiate(client, placed, "train", key=key, desired_workers=workers)
        assert (await act(client, placed, resized["id"], RoundAction.ACCEPT)).status_code == 200
    assert await quarantined(app) == [], "a plain resize quarantines nothing"

    moved = await negotiate(client, placed, "train", key="move", desired_workers=2,
                            replace_hosts=[seen_as(placed, "h1")])
    assert (await act(client, placed, moved["id"], RoundAction.ACCEPT)).status_code == 200
    assert await quarantined(app) == [("train", seen_as(placed, "h1"))]

    clock.advance(seconds=QUARANTINE.total_seconds() + 1)
    (away,) = sorted(set(await hosts_of(app, "train")) - {"h1"})[:1]
    again = await negotiate(client, placed, "train", key="again", desired_workers=2,
                            replace_hosts=[seen_as(placed, away)])
    assert (await act(client, placed, again["id"], RoundAction.ACCEPT)).status_code == 200
    assert await quarantined(app) == [("train", seen_as(placed, away))], "h1's row outlived its quarantine"
    assert "h1" in await hosts_of(app, "train"), "the quarantine over, h1 takes the moved worker"


async def test_a_host_back_up_after_an_outage_ends_the_quarantine(
    app: FastAPI, client: httpx.AsyncClient, placed: TenantHandle, clock: FakeClock
) -> None:
    """Maintenance announced ahead: the tenant moves off h1, the provider takes h1 down, then reports it back up.
    Only the outage after the move ends the quarantine: an up report alone (h1 was never down) does not."""
    moved = await negotiate(client, placed, "train", key="move", desired_workers=2,
                            replace_hosts=[seen_as(placed, "h1")])
    assert (await act(client, placed, moved["id"], RoundAction.ACCEPT)).status_code == 200
    assert (await client.post("/v1/provider/hosts/h1/up", headers=ADMIN)).status_code == 200
    still = await negotiate(client, placed, "train", key="still", desired_workers=3)
    assert still["state"] == "declined", "h1 was never down: an up report is no repair"
    clock.advance(seconds=5)
    assert (await client.post("/v1/provider/hosts/h1/down", headers=ADMIN)).status_code == 200
    declined = await negotiate(client, placed, "train", key="down", desired_workers=3)
    assert declined["state"] == "declined", "h1 is down"
    clock.advance(seconds=30)
    up = await client.post("/v1/provider/hosts/h1/up", headers=ADMIN)
    assert up.status_code == 200 and up.json()["down_at"] is None
    back = await negotiate(client, placed, "train", key="back", desired_workers=3)
    assert only_option(back)["workers"] == 3
    assert (await act(client, placed, back["id"], RoundAction.ACCEPT)).status_code == 200
    assert await hosts_of(app, "train") == ["h1", "h2", "h3"]


async def test_no_healthy_room_is_a_decline_with_the_reason_or_the_smaller_size_the_range_allows(
    app: FastAPI, client: httpx.AsyncClient, placed: TenantHandle
) -> None:
    await create_job(client, placed, "squatter", gpus_per_worker=4, initial_workers=1)
    assert await hosts_of(app, "squatter") == ["h3"]
    failing = seen_as(placed, "h1")

    keep = await negotiate(client, placed, "train", key="keep", desired_workers=2, replace_hosts=[failing])
    assert keep["state"] == "declined" and keep["offer"] is None
    note = keep["rounds"][-1]["note"]
    assert note.startswith(f"no healthy host has room to replace the job's 1 worker on {failing}")
    assert "room for 0" in note and "you accept 2" in note and not INTERNAL_HOST.search(note)

    smaller = await negotiate(client, placed, "train", key="smaller", desired_workers=2,
                              accept_workers={"min": 1, "max": 2}, replace_hosts=[failing])
    option = only_option(smaller)
    assert option["workers"] == 1 and option["replaced_hosts"] == [failing]
    assert f"1 worker on {failing} is dropped (no healthy host has room to replace it)" in option["reason"]
    epoch = (await status(client, placed, "train"))["placement_epoch"]
    assert (await act(client, placed, smaller["id"], RoundAction.ACCEPT)).status_code == 200
    assert await hosts_of(app, "train") == ["h2"], "the failing host's worker goes, not the most recent one"
    after = await status(client, placed, "train")
    assert (after["desired_workers"], after["placement_epoch"]) == (1, epoch + 1)
    assert await ledger_totals(app) == (8, 8, 8)


async def test_two_replacements_racing_for_the_last_healthy_slot_never_overcommit(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    await create_host(client, "h1", gpus=8, group="rack-a")
    await create_host(client, "h2", gpus=4, group="rack-b")
    for job in ("a", "b"):
        await create_job(client, acme, job, gpus_per_worker=4, initial_workers=1)
        assert await hosts_of(app, job) == ["h1"]
    failing = seen_as(acme, "h1")
    offers = [await negotiate(client, acme, job, key=f"r-{job}", desired_workers=1, replace_hosts=[failing])
              for job in ("a", "b")]
    assert all(only_option(answer)["workers"] == 1 for answer in offers), "each fits alone"

    responses = await asyncio.gather(*(act(client, acme, answer["id"], RoundAction.ACCEPT) for answer in offers))
    assert sorted(response.status_code for response in responses) == [200, 409]
    lost = next(response for response in responses if response.status_code == 409)
    assert "capacity for this option is gone" in lost.json()["reason"]
    assert await allocated(app) == {"h1": (4, 8), "h2": (4, 4)}
    assert await ledger_totals(app) == (8, 8, 8)
    assert sorted([await hosts_of(app, "a"), await hosts_of(app, "b")]) == [["h1"], ["h2"]]
    loser = offers[responses.index(lost)]
    still = (await client.get(f"/v1/negotiations/{loser['id']}", headers=acme.headers)).json()
    assert still["state"] == "offered", "nothing half-applied: the loser can counter"


async def test_a_predicted_failure_is_replaced_at_once_before_its_eta_and_never_waits_for_carbon(
    app: FastAPI, client: httpx.AsyncClient, placed: TenantHandle
) -> None:
    await create_host(client, "h4", gpus=4, group="rack-b")
    failing = seen_as(placed, "h2")
    eta = "2026-03-01T12:05:00Z"
    grow = await negotiate(client, placed, "train", key="grow", desired_workers=3, replace_hosts=[failing],
                           constraints={"deadline": eta})
    assert only_option(grow)["reason"].startswith(f"3 workers now: 1 worker on {failing} moves to a healthy host, "
                                                  "1 more on healthy hosts")
    assert (await act(client, placed, grow["id"], RoundAction.REJECT)).status_code == 200
    later = await negotiate(client, placed, "train", key="later", desired_workers=2, replace_hosts=[failing],
                            start_after="2026-03-01T13:00:00Z")
    assert later["state"] == "declined" and "takes effect at once" in later["rounds"][-1]["note"]

    capped = await negotiate(client, placed, "train", key="capped", desired_workers=3,
                             accept_workers={"min": 2, "max": 3}, replace_hosts=[failing],
                             constraints={"deadline": eta, "carbon_cap_g_per_kwh": 100})
    option = only_option(capped)
    assert (option["workers"], option["start_at"]) == (2, None), "the replacement now, the growth not above the cap"
    assert "moves to a healthy host" in option["reason"] and "no growth now" in option["reason"]
    assert (await act(client, placed, capped["id"], RoundAction.ACCEPT)).status_code == 200
    assert await hosts_of(app, "train") == ["h1", "h3"]
    assert await ledger_totals(app) == (8, 8, 8)


async def test_a_host_the_job_does_not_use_moves_nothing_and_bad_names_are_refused(
    app: FastAPI, client: httpx.AsyncClient, placed: TenantHandle, globex: TenantHandle
) -> None:
    epoch = (await status(client, placed, "train"))["placement_epoch"]
    for key, name in (("free", seen_as(placed, "h3")), ("theirs", seen_as(globex, "h1"))):
        answer = await negotiate(client, placed, "train", key=key, desired_workers=2, replace_hosts=[name])
        option = only_option(answer)
        assert option["workers"] == 2 and option["replaced_hosts"] is None
        assert option["reason"] == f"2 workers now (already running); no worker of this job runs on {name}"
        assert (await act(client, placed, answer["id"], RoundAction.ACCEPT)).status_code == 200
    assert await hosts_of(app, "train") == ["h1", "h2"]
    assert (await status(client, placed, "train"))["placement_epoch"] == epoch

    plan = await negotiate(client, placed, "train", key="plan", kind="repartition", parallel_plan="hsdp",
                           replace_hosts=[seen_as(placed, "h1")])
    assert plan["state"] == "declined"
    assert plan["rounds"][-1]["note"] == "replace_hosts is for scale requests, not repartition"
    for bad in (["h1"], [seen_as(placed, "h1")] * 2, []):
        response = await client.post(
            "/v1/negotiations",
            json={"job": "train", "kind": "scale", "terms": {"desired_workers": 2, "replace_hosts": bad}},
            headers={**placed.headers, "Idempotency-Key": f"bad-{len(bad)}-{bad[:1]}"},
        )
        assert response.status_code == 422, (bad, response.text)
        assert any(name.startswith("body.terms") for name in field_names(response)), response.text
