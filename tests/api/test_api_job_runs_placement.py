"""Running jobs over HTTP, on SQLite and PostgreSQL: placement epochs in the desired state, host outages, entrypoints.

The desired state is read from the outbox (`desired_state` rows, one complete `HostAssignment` per host write): these
tests run without a bus. Time is the app's `FakeClock`, moved by hand.
"""

from __future__ import annotations

import httpx
from fastapi import FastAPI

from api.models import OutboxTopic
from harmonaize.desired_state import AssignedJob, HostAssignment, RestartMode
from harmonaize.job_runtime import Directives, JobRanges
from harmonaize.jobs import Compression
from harmonaize.negotiation import RoundAction
from harmonaize.ranges import IntRange
from tests.api.api_testkit import ADMIN, FakeClock, TenantHandle, create_host, create_job, field_names
from tests.api.negotiation_kit import act, ledger_totals, negotiate, outbox

ENTRYPOINT = ["-m", "workloads.examples.mlp", "--steps", "50"]


async def desired(app: FastAPI) -> list[HostAssignment]:
    """Every queued host assignment, in write order."""
    return [HostAssignment.model_validate_json(row.payload) for row in await outbox(app, OutboxTopic.DESIRED_STATE)]


def placed(assignment: HostAssignment, tenant: str, job: str) -> AssignedJob | None:
    found = [entry for entry in assignment.jobs if (entry.tenant, entry.job) == (tenant, job)]
    assert len(found) <= 1
    return found[0] if found else None


def shape(assignment: HostAssignment, tenant: str = "acme", job: str = "train") -> tuple[object, ...]:
    """(host, workers, epoch, nodes, restart, plan) of the job on this host; None fields when absent."""
    entry = placed(assignment, tenant, job)
    if entry is None:
        return (assignment.host, None)
    return (assignment.host, entry.workers, entry.epoch, entry.nodes, entry.restart, entry.parallel_plan)


async def accept_scale(client: httpx.AsyncClient, tenant: TenantHandle, job: str, workers: int, *, key: str) -> None:
    answer = await negotiate(client, tenant, job, key=key, desired_workers=workers)
    assert answer["state"] == "offered", answer
    assert answer["offer"]["options"][0]["workers"] == workers, answer
    accepted = await act(client, tenant, answer["id"], RoundAction.ACCEPT)
    assert accepted.status_code == 200, accepted.text


async def job_epoch(client: httpx.AsyncClient, tenant: TenantHandle, job: str) -> tuple[int, int]:
    body = (await client.get(f"/v1/jobs/{job}", headers=tenant.headers)).json()
    return body["desired_workers"], body["placement_epoch"]


async def test_epochs_move_with_the_node_set_and_plan_but_not_with_directives(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, globex: TenantHandle, clock: FakeClock
) -> None:
    await create_host(client, "h1", gpus=2, group="rack-a")
    await create_host(client, "h2", gpus=2, group="rack-a")
    job = await create_job(
        client, acme, "train", max_workers=6, initial_workers=4, entrypoint=ENTRYPOINT,
        checkpoint_interval_steps={"min": 50, "max": 500},
        gradient_compression={"allowed": ["powersgd", "none"], "powersgd_max_rank": 4},
        gradient_accumulation={"min": 1, "max": 4},
    )
    assert (job["placement_epoch"], job["entrypoint"]) == (1, ENTRYPOINT)
    ranges = JobRanges(
        checkpoint_interval_steps=IntRange(min=50, max=500),
        compression_allowed=(Compression.NONE, Compression.POWERSGD),
        powersgd_max_rank=4,
        batch_size=IntRange(min=16, max=64),
        gradient_accumulation=IntRange(min=1, max=4),
    )
    first = await desired(app)
    assert [(a.host, a.generation) for a in first] == [("h1", 1), ("h2", 1)]
    assert [shape(a) for a in first] == [("h1", 2, 1, 2, "graceful", "ddp"), ("h2", 2, 1, 2, "graceful", "ddp")]
    for assignment in first:
        entry = placed(assignment, "acme", "train")
        assert entry is not None and len(assignment.jobs) == 1
        assert (entry.entrypoint, entry.ranges, entry.directives) == (tuple(ENTRYPOINT), ranges, Directives())

    # Another tenant's job on a third host: its epoch must not move when acme's job grows onto that host.
    await create_host(client, "h3", gpus=3, group="rack-b")
    await create_job(client, globex, "solo", initial_workers=1)
    (solo,) = (await desired(app))[2:]
    assert shape(solo, "globex", "solo") == ("h3", 1, 1, 1, "graceful", "ddp") and placed(solo, "acme", "train") is None

    count = len(await desired(app))
    clock.advance(seconds=10)  # the new worker is the job's most recent one (released first when it shrinks)
    await accept_scale(client, acme, "train", 5, key="up")
    warm, *grown = (await desired(app))[count:]
    (standby,) = warm.standby
    assert (warm.host, placed(warm, "acme", "train")) == ("h3", None), "the offer warms the joiner's host first"
    assert (standby.job, standby.workers, standby.epoch, standby.nodes, standby.standby) == ("train", 1, 2, 3, True)
    assert [shape(a) for a in grown] == [
        ("h1", 2, 2, 3, "graceful", "ddp"), ("h2", 2, 2, 3, "graceful", "ddp"), ("h3", 1, 2, 3, "graceful", "ddp"),
    ], "the old hosts are rewritten with the new epoch and node count"
    assert [a.generation for a in [warm, *grown]] == [2, 2, 2, 3]
    assert grown[2].standby == (), "the accept made the joiner a member: no standby left on its host"
    assert shape(grown[2], "globex", "solo") == ("h3", 1, 1, 1, "graceful", "ddp"), "globex's node set is unchanged"
    assert await job_epoch(client, acme, "train") == (5, 2)
    assert await job_epoch(client, globex, "solo") == (1, 1)

    count = len(await desired(app))
    plan = await negotiate(client, acme, "train", key="plan", kind="repartition", parallel_plan="hsdp")
    assert (await act(client, acme, plan["id"], RoundAction.ACCEPT)).status_code == 200
    repartitioned = (await desired(app))[count:]
    assert [shape(a) for a in repartitioned] == [
        ("h1", 2, 3, 3, "graceful", "hsdp"), ("h2", 2, 3, 3, "graceful", "hsdp"), ("h3", 1, 3, 3, "graceful", "hsdp"),
    ]
    assert shape(repartitioned[2], "globex", "solo")[2] == 1

    count = len(await desired(app))
    proposal = {"checkpoint_interval_steps": 200, "compression": "powersgd", "powersgd_rank": 2, "reason": "congested"}
    issued = await client.put("/v1/provider/jobs/acme/train/directives", json=proposal, headers=ADMIN)
    assert issued.status_code == 200, issued.text
    assert issued.json()["version"] == 1
    rewritten = (await desired(app))[count:]
    assert [shape(a) for a in rewritten] == [
        ("h1", 2, 3, 3, "graceful", "hsdp"), ("h2", 2, 3, 3, "graceful", "hsdp"), ("h3", 1, 3, 3, "graceful", "hsdp"),
    ], "a directive rewrites the job's hosts but keeps the epoch"
    for assignment in rewritten:
        directives = placed(assignment, "acme", "train").directives  # type: ignore[union-attr]
        assert (directives.version, directives.checkpoint_interval_steps) == (1, 200)
        assert (directives.compression, directives.powersgd_rank, directives.reason) == ("powersgd", 2, "congested")
    assert placed(rewritten[2], "globex", "solo").directives == Directives()  # type: ignore[union-attr]
    assert await job_epoch(client, acme, "train") == (5, 3)

    # Scale down: the newest worker (on h3) leaves; h3 keeps only globex's job, the others move to epoch 4.
    count = len(await desired(app))
    await accept_scale(client, acme, "train", 4, key="down")
    shrunk = (await desired(app))[count:]
    assert [shape(a) for a in shrunk] == [
        ("h1", 2, 4, 2, "graceful", "hsdp"), ("h2", 2, 4, 2, "graceful", "hsdp"), ("h3", None),
    ]
    assert [(j.tenant, j.job) for j in shrunk[2].jobs] == [("globex", "solo")]
    assert placed(shrunk[0], "acme", "train").directives.version == 1  # type: ignore[union-attr]
    assert await job_epoch(client, acme, "train") == (4, 4)


async def two_host_job(client: httpx.AsyncClient, tenant: TenantHandle) -> None:
    """h1 and h2 (2 GPUs each, full): acme's 4-worker job at epoch 1."""
    await create_host(client, "h1", gpus=2, group="rack-a")
    await create_host(client, "h2", gpus=2, group="rack-a")
    await create_job(client, tenant, "train", initial_workers=4, entrypoint=ENTRYPOINT)


async def host(client: httpx.AsyncClient, host_id: str) -> dict[str, object]:
    (found,) = [h for h in (await client.get("/v1/hosts", headers=ADMIN)).json() if h["id"] == host_id]
    return found


async def test_a_host_down_releases_its_workers_and_restarts_the_survivors_at_once(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    await two_host_job(client, acme)
    count = len(await desired(app))
    for path in ("/v1/provider/hosts/h2/down", "/v1/provider/hosts/h2/up"):
        refused = await client.post(path, headers=acme.headers)
        assert refused.status_code == 403, refused.text
    assert len(await desired(app)) == count and (await host(client, "h2"))["down_at"] is None

    clock.advance(seconds=30)
    down = await client.post("/v1/provider/hosts/h2/down", headers=ADMIN)
    assert (down.status_code, down.json()) == (200, {"jobs_shrunk": ["acme/train"]})
    after = (await desired(app))[count:]
    assert [shape(a) for a in after] == [("h1", 2, 2, 1, RestartMode.IMMEDIATE, "ddp"), ("h2", None)]
    assert after[1].jobs == (), "the down host is told to run nothing"
    assert await job_epoch(client, acme, "train") == (2, 2)
    live = (await client.get("/v1/allocations", params={"tenant_id": "acme", "job_id": "train"}, headers=ADMIN)).json()
    assert {a["host_id"] for a in live} == {"h1"} and sum(a["gpus"] for a in live) == 2
    assert await ledger_totals(app) == (2, 2, 2)
    h2 = await host(client, "h2")
    assert (h2["down_at"], h2["allocated_gpus"]) == ("2026-03-01T12:00:30Z", 0)
    status = (await client.get("/v1/jobs/train/status", headers=acme.headers)).json()
    assert (status["desired_workers"], status["placement_epoch"], status["progress"]) == (2, 2, None)
    assert (await client.post("/v1/provider/hosts/nowhere/down", headers=ADMIN)).status_code == 404


async def test_reporting_a_host_down_twice_changes_nothing_the_second_time(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    await two_host_job(client, acme)
    assert (await client.post("/v1/provider/hosts/h2/down", headers=ADMIN)).status_code == 200
    count = len(await desired(app))
    first_down = (await host(client, "h2"))["down_at"]
    clock.advance(seconds=5)
    again = await client.post("/v1/provider/hosts/h2/down", headers=ADMIN)
    assert (again.status_code, again.json()) == (200, {"jobs_shrunk": []})
    assert await job_epoch(client, acme, "train") == (2, 2)
    assert await ledger_totals(app) == (2, 2, 2)
    assert (await host(client, "h2"))["down_at"] == first_down
    assert [(a.host, a.generation) for a in (await desired(app))[count:]] == [], "no new desired state is queued"


async def test_a_down_host_takes_no_placements_until_it_is_reported_up(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    await two_host_job(client, acme)
    assert (await client.post("/v1/provider/hosts/h2/down", headers=ADMIN)).status_code == 200
    count = len(await desired(app))
    on_h2 = {"tenant_id": "acme", "job_id": "train", "gpus": 1, "host_id": "h2"}
    assert (await client.post("/v1/allocations", json=on_h2, headers=ADMIN)).status_code == 409
    anywhere = {"tenant_id": "acme", "job_id": "train", "gpus": 1}
    assert (await client.post("/v1/allocations", json=anywhere, headers=ADMIN)).status_code == 409
    spare = await client.post("/v1/jobs", json={"id": "spare", "min_workers": 1, "max_workers": 1,
                                                "initial_workers": 1}, headers=acme.headers)
    assert spare.status_code == 409, spare.text
    assert len(await desired(app)) == count and await ledger_totals(app) == (2, 2, 2)

    up = await client.post("/v1/provider/hosts/h2/up", headers=ADMIN)
    assert up.status_code == 200 and (up.json()["down_at"], up.json()["free_gpus"]) == (None, 2)
    again = await client.post("/v1/provider/hosts/h2/up", headers=ADMIN)
    assert again.status_code == 200 and again.json() == up.json()
    assert len(await desired(app)) == count, "nothing returns to the host by itself"

    await accept_scale(client, acme, "train", 4, key="back")
    warm, *back = (await desired(app))[count:]
    assert (warm.host, [entry.job for entry in warm.standby]) == ("h2", ["train"]), "the offer warms h2 again"
    assert [shape(a) for a in back] == [("h1", 2, 3, 2, "graceful", "ddp"), ("h2", 2, 3, 2, "graceful", "ddp")]
    assert await ledger_totals(app) == (4, 4, 4)


async def test_a_down_host_is_not_offered_in_a_negotiation(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    """h1 is full and h2 is down: a scale-up has no room, so it is declined rather than offered and then refused."""
    await two_host_job(client, acme)
    assert (await client.post("/v1/provider/hosts/h2/down", headers=ADMIN)).status_code == 200
    answer = await negotiate(client, acme, "train", key="grow", desired_workers=4, accept_workers={"min": 3, "max": 4})
    assert answer["state"] == "declined", f"the down host's GPUs were offered: {answer['offer']}"
    assert "no room now" in answer["rounds"][-1]["note"]


async def test_bad_entrypoints_are_a_422_naming_the_field(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    cases = [
        (["-m", "train\nrm -rf /"], "body.entrypoint.1"),
        (["-m", "train\x00"], "body.entrypoint.1"),
        (["\x7f"], "body.entrypoint.0"),
        (["-m", ""], "body.entrypoint.1"),
        (["x" * 501], "body.entrypoint.0"),
        (["--flag"] * 65, "body.entrypoint"),
        ("-m train", "body.entrypoint"),
    ]
    for entrypoint, field in cases:
        response = await client.post("/v1/jobs", json={"id": "bad", "min_workers": 1, "max_workers": 1,
                                                       "entrypoint": entrypoint}, headers=acme.headers)
        assert response.status_code == 422, (entrypoint, response.text)
        assert field_names(response) == {field}, (entrypoint, response.text)
        assert field in response.json()["reason"]
    assert (await client.get("/v1/jobs", headers=acme.headers)).json() == []
    most = await create_job(client, acme, "most", entrypoint=["--flag"] * 64)
    assert most["entrypoint"] == ["--flag"] * 64
    assert most["placement_epoch"] == 0 and await desired(app) == [], "not placed: no epoch, nothing to launch"
