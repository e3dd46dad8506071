"""Warm joiners over HTTP, on SQLite and PostgreSQL: an offer that grows a job lists it under `standby` on the hosts
its accept would add; every other end of the offer takes it away again (rewritten for counter, reject and cancel;
dropped on the launcher's clock and from the table at expiry); the accept makes the standby host a member.

The desired state is read from the outbox, as in `test_api_job_runs_placement`; time is the app's `FakeClock`.
"""

from __future__ import annotations

import httpx
from fastapi import FastAPI
from sqlalchemy import func, select

from api.models import OutboxTopic
from api.models_standby import StandbyNode
from api.services.sweeper import sweep_once
from harmonaize.desired_state import HostAssignment
from harmonaize.negotiation import RoundAction
from tests.api.api_testkit import FakeClock, TenantHandle, create_host, create_job
from tests.api.negotiation_kit import act, negotiate, outbox

ENTRYPOINT = ["-m", "workloads.examples.mlp"]


async def writes(app: FastAPI) -> list[HostAssignment]:
    return [HostAssignment.model_validate_json(row.payload) for row in await outbox(app, OutboxTopic.DESIRED_STATE)]


async def standby_rows(app: FastAPI) -> int:
    async with app.state.sessionmaker() as session:
        return int(await session.scalar(select(func.count()).select_from(StandbyNode)) or 0)


def standing_by(assignment: HostAssignment) -> list[tuple[str, int, int]]:
    return [(entry.job, entry.workers, entry.epoch) for entry in assignment.standby]


async def two_host_job(client: httpx.AsyncClient, acme: TenantHandle) -> None:
    """acme/train on h1 + h2 (one GPU each); h3 (two GPUs) and h4 (one) free in another group."""
    await create_host(client, "h1", gpus=1, group="rack-a")
    await create_host(client, "h2", gpus=1, group="rack-a")
    await create_job(client, acme, "train", max_workers=4, initial_workers=2, entrypoint=ENTRYPOINT)
    await create_host(client, "h3", gpus=2, group="rack-b")
    await create_host(client, "h4", gpus=1, group="rack-b")


async def test_each_end_of_a_growing_offer_but_the_accept_stops_its_warm_joiner(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    await two_host_job(client, acme)
    before = len(await writes(app))
    opened = await negotiate(client, acme, "train", key="k1", desired_workers=4)
    assert opened["state"] == "offered"
    warm = (await writes(app))[before:]
    assert [(a.host, standing_by(a), a.jobs) for a in warm] == [("h3", [("train", 2, 2)], ())], (
        "the two new workers' host runs the standby; it is not placed there (no events, no micro loop)"
    )
    assert warm[0].standby[0].standby_until is not None
    assert warm[0].standby[0].standby_until.isoformat() == opened["offer"]["expires_at"].replace("Z", "+00:00")

    countered = await act(client, acme, opened["id"], RoundAction.COUNTER, {"desired_workers": 3})
    assert countered.status_code == 200 and countered.json()["state"] == "offered"
    recount = (await writes(app))[before + 1:]
    assert [(a.host, standing_by(a)) for a in recount] == [("h3", [("train", 1, 2)])], (
        "the new offer's joiner replaces the old one on the same host, in one write"
    )
    rejected = await act(client, acme, opened["id"], RoundAction.REJECT)
    assert rejected.status_code == 200
    last = (await writes(app))[-1]
    assert (last.host, last.standby, await standby_rows(app)) == ("h3", (), 0)

    cancelled = await negotiate(client, acme, "train", key="k2", desired_workers=3)
    assert (await writes(app))[-1].standby != ()
    assert (await act(client, acme, cancelled["id"], RoundAction.CANCEL)).status_code == 200
    assert ((await writes(app))[-1].standby, await standby_rows(app)) == ((), 0)

    expiring = await negotiate(client, acme, "train", key="k3", desired_workers=3)
    count = len(await writes(app))
    assert await standby_rows(app) == 1
    clock.advance(seconds=61)
    assert await sweep_once(app.state.sessionmaker, now=clock()) == 1
    assert await standby_rows(app) == 0, "the expiry drops the rows"
    assert len(await writes(app)) == count, "no rewrite: launchers stop a standby at its `standby_until` themselves"
    assert expiring["offer"]["expires_at"] is not None


async def test_the_accept_places_the_workers_where_the_joiner_waits_or_stops_it_where_they_do_not_go(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    await two_host_job(client, acme)
    first = await negotiate(client, acme, "train", key="a1", desired_workers=3)
    assert [(a.host, standing_by(a)) for a in (await writes(app))[-1:]] == [("h3", [("train", 1, 2)])]
    assert (await act(client, acme, first["id"], RoundAction.ACCEPT)).status_code == 200
    h3 = [a for a in await writes(app) if a.host == "h3"][-1]
    assert [(job.job, job.workers, job.epoch, job.nodes) for job in h3.jobs] == [("train", 1, 2, 3)]
    assert h3.standby == () and await standby_rows(app) == 0, "the joiner is a member now"

    more = await negotiate(client, acme, "train", key="a2", desired_workers=4)
    assert more["state"] == "offered"
    assert await standby_rows(app) == 0, "the next worker would join train's node on h3: no new node to warm"
    assert (await act(client, acme, more["id"], RoundAction.REJECT)).status_code == 200


async def test_when_the_capacity_moves_before_the_accept_the_joiner_is_stopped_and_the_workers_go_elsewhere(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    await two_host_job(client, acme)
    opened = await negotiate(client, acme, "train", key="b1", desired_workers=3)
    assert standing_by((await writes(app))[-1]) == [("train", 1, 2)] and (await writes(app))[-1].host == "h3"
    await create_job(client, acme, "squatter", max_workers=2, initial_workers=2)  # takes all of h3 meanwhile
    assert (await act(client, acme, opened["id"], RoundAction.ACCEPT)).status_code == 200
    latest = {a.host: a for a in await writes(app)}
    assert [job.job for job in latest["h4"].jobs] == ["train"], "placed where there was room at the accept"
    assert ([job.job for job in latest["h3"].jobs], latest["h3"].standby) == (["squatter"], ()), (
        "h3's standby is stopped by the accept's rewrite"
    )
    assert await standby_rows(app) == 0
