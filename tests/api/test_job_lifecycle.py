"""The job lifecycle: the transition table itself, then the phase over real sequences through the API, on SQLite
and PostgreSQL (progress and node failures as the node launchers report them, agreements as the tenant makes them).
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import select, update

from api import migrate
from api.db import make_engine
from api.models import Job
from api.services.job_lifecycle import (
    TRANSITIONS,
    InvalidJobTransitionError,
    JobEvent,
    epoch_event,
    next_phase,
    phase_after,
)
from harmonaize.desired_state import RestartMode
from harmonaize.jobs import JobPhase
from harmonaize.settings import Settings
from tests.api.api_testkit import ADMIN, FakeClock, TenantHandle, create_host, create_job
from tests.api.test_api_job_runs_placement import ENTRYPOINT, accept_scale, two_host_job
from tests.api.test_api_migrations import _TENANT_ROW, _execute, _job_row

_P, _E = JobPhase, JobEvent

REFUSED = sorted(set(itertools.product(JobPhase, JobEvent)) - set(TRANSITIONS))


@pytest.mark.parametrize(("phase", "event"), sorted(TRANSITIONS))
def test_every_edge_of_the_table_is_accepted(phase: JobPhase, event: JobEvent) -> None:
    assert next_phase(phase, event) is TRANSITIONS[(phase, event)]


@pytest.mark.parametrize(("phase", "event"), REFUSED)
def test_every_other_pair_is_refused(phase: JobPhase, event: JobEvent) -> None:
    with pytest.raises(InvalidJobTransitionError) as refused:
        next_phase(phase, event)
    assert refused.value.reason == f"job is {phase.value}: cannot {event.value}"


def test_the_table_covers_the_lifecycle() -> None:
    assert REFUSED == [(_P.PENDING, _E.GIVE_UP)], "a pending job has no node to give up"
    reached = {TRANSITIONS[key] for key in TRANSITIONS}
    assert reached == set(JobPhase), "every phase can be reached"
    assert TRANSITIONS[(_P.RUNNING, _E.NEW_EPOCH)] is _P.RESTARTING
    assert TRANSITIONS[(_P.FAILED, _E.PROGRESS)] is _P.FAILED, "a late report does not revive a failed job"


def test_a_new_epoch_is_told_apart_by_what_is_left_and_why() -> None:
    assert epoch_event(workers_placed=True, restart=RestartMode.IMMEDIATE) is JobEvent.NEW_EPOCH
    assert epoch_event(workers_placed=False, restart=RestartMode.GRACEFUL) is JobEvent.RELEASED_ALL
    assert epoch_event(workers_placed=False, restart=RestartMode.IMMEDIATE) is JobEvent.LOST_ALL


async def status(client: httpx.AsyncClient, tenant: TenantHandle) -> dict[str, Any]:
    reply = await client.get("/v1/jobs/train/status", headers=tenant.headers)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


async def phase(client: httpx.AsyncClient, tenant: TenantHandle) -> tuple[str, int]:
    body = await status(client, tenant)
    return body["phase"], body["placement_epoch"]


async def progress(
    client: httpx.AsyncClient, *, epoch: int, step: int, world: int, finished: bool = False
) -> None:
    body = {
        "tenant": "acme", "job": "train", "epoch": epoch, "step": step, "world_size": world, "parallel_plan": "ddp",
        "checkpoint_interval_steps": 100, "batch_size": 16, "updated_at": "2026-03-01T12:00:00Z",
        "finished": finished,
    }
    reply = await client.post("/v1/provider/progress", json=body, headers=ADMIN)
    assert reply.status_code == 202, reply.text


async def test_a_job_runs_restarts_after_an_agreement_and_finishes(
    client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    await create_host(client, "h1", gpus=4, group="rack-a")
    await create_job(client, acme, "idle")
    idle = await client.get("/v1/jobs/idle/status", headers=acme.headers)
    assert (idle.json()["phase"], idle.json()["placement_epoch"]) == ("pending", 0)

    await create_job(client, acme, "train", max_workers=4, initial_workers=2, entrypoint=ENTRYPOINT)
    assert await phase(client, acme) == ("placed", 1)
    await progress(client, epoch=1, step=10, world=2)
    assert await phase(client, acme) == ("running", 1)

    await accept_scale(client, acme, "train", 3, key="grow")
    assert await phase(client, acme) == ("restarting", 2)
    await progress(client, epoch=1, step=12, world=2)
    assert await phase(client, acme) == ("restarting", 2), "a report from the epoch the job left changes nothing"
    await progress(client, epoch=2, step=12, world=3)
    assert await phase(client, acme) == ("running", 2)

    await progress(client, epoch=2, step=20, world=3, finished=True)
    body = await status(client, acme)
    assert (body["phase"], body["progress"]["finished"]) == ("finished", True)
    await progress(client, epoch=2, step=20, world=3, finished=True)
    assert await phase(client, acme) == ("finished", 2), "the final report again"


def node_failure(clock: FakeClock, *, reason: str, epoch: int, host_id: str) -> dict[str, Any]:
    return {
        "tenant": "acme", "job": "train", "host": host_id, "epoch": epoch, "reason": reason, "step": 5,
        "detected_at": (clock() - timedelta(seconds=1)).isoformat(),
    }


async def test_failed_nodes_fail_the_job_until_its_epoch_moves_on(
    client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    await two_host_job(client, acme)
    await progress(client, epoch=1, step=5, world=4)
    assert await phase(client, acme) == ("running", 1)

    given_up = node_failure(clock, reason="out_of_restarts", epoch=1, host_id="h1")
    reply = await client.post("/v1/provider/node-failures", json=given_up, headers=ADMIN)
    assert reply.json() == {"outcome": "recorded"}
    body = await status(client, acme)
    assert (body["phase"], body["node_failures"][0]["reason"]) == ("failed", "out_of_restarts")
    await progress(client, epoch=1, step=6, world=4)
    assert await phase(client, acme) == ("failed", 1), "a report from before the node gave up, relayed late"

    hung = node_failure(clock, reason="frozen", epoch=1, host_id="h2")
    reply = await client.post("/v1/provider/node-failures", json=hung, headers=ADMIN)
    assert reply.json() == {"outcome": "released"}
    assert await phase(client, acme) == ("restarting", 2), "the hung node left: the rest restart without it"
    await progress(client, epoch=2, step=5, world=2)
    assert await phase(client, acme) == ("running", 2)

    down = await client.post("/v1/provider/hosts/h1/down", headers=ADMIN)
    assert down.status_code == 200, down.text
    assert await phase(client, acme) == ("failed", 3), "failures took the job's last worker"


async def test_0006_gives_existing_jobs_the_phase_their_state_implies(empty_settings: Settings) -> None:
    await migrate.upgrade_async(empty_settings, "0005")
    jobs = [("pending", 0, 0), ("placed", 1, 1), ("running", 1, 2), ("restarting", 1, 3)]
    statements = [_TENANT_ROW]
    for job_id, workers, epoch in jobs:
        statements += [
            _job_row(job_id, "8, 64"),
            f"UPDATE jobs SET desired_workers = {workers}, allocated_gpus = {workers}, placement_epoch = {epoch} "
            f"WHERE id = '{job_id}'",
        ]
    for job_id in ("running", "restarting"):
        statements.append(
            "INSERT INTO job_status (tenant_id, job_id, epoch, step, world_size, progress, reported_at) "
            f"VALUES ('acme', '{job_id}', 2, 7, 1, '{{}}', CURRENT_TIMESTAMP)"
        )
    await _execute(empty_settings, *statements)
    await migrate.upgrade_async(empty_settings, "0006")
    rows = await _execute(empty_settings, "SELECT id, phase FROM jobs ORDER BY id")
    assert sorted(rows) == sorted((job_id, job_id) for job_id, _, _ in jobs)
    await migrate.downgrade_async(empty_settings, "0005")
    assert len(await _execute(empty_settings, "SELECT id FROM jobs")) == len(jobs)


@pytest.mark.parametrize("event", [_E.NEW_EPOCH, _E.RELEASED_ALL, _E.LOST_ALL])
async def test_a_new_epoch_moves_the_phase_in_sql_as_the_table_says(event: JobEvent, empty_settings: Settings) -> None:
    """`phase_after` (how a new epoch's UPDATE moves the stored phase without reading it) agrees with the table for
    every phase, on the real database."""
    await migrate.upgrade_async(empty_settings)
    statements = [_TENANT_ROW]
    for phase in JobPhase:
        statements += [
            _job_row(phase.value, "8, 64"), f"UPDATE jobs SET phase = '{phase.value}' WHERE id = '{phase.value}'"
        ]
    await _execute(empty_settings, *statements)
    engine = make_engine(empty_settings.resolved_database_url, single_use=True)
    try:
        async with engine.begin() as connection:
            await connection.execute(update(Job).values(phase=phase_after(event)))
            rows = (await connection.execute(select(Job.id, Job.phase))).all()
    finally:
        await engine.dispose()
    assert {job_id: phase for job_id, phase in rows} == {phase.value: next_phase(phase, event) for phase in JobPhase}


def test_an_event_some_phase_refuses_cannot_be_applied_in_sql() -> None:
    with pytest.raises(ValueError, match="give_up has no transition from"):
        phase_after(_E.GIVE_UP)
