"""`assigned_jobs`: a job's entry made from its row's raw columns (JSON as stored text) equals the one made from the
job itself, on SQLite and PostgreSQL; entries are memoised by value; an assignment's payload spliced from its
entries' JSON is byte for byte the assignment's own serialisation."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select, update

from api.models import Job
from api.services.assigned_jobs import (
    ASSIGNED_COLUMNS,
    Entry,
    assignment_payload,
    entry,
    job_directives,
    job_ranges,
)
from api.services.placement_epochs import placement_hosts
from harmonaize.desired_state import AssignedJob, HostAssignment, MaintenanceApproval, RestartMode
from tests.api.api_testkit import TenantHandle, create_host, create_job

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
ENTRYPOINT = ["python", "-c", 'print("quotes \\\\ and \u00e9t\u00e9")', "--lr=1e-3"]
DIRECTIVES = {"version": 3, "checkpoint_requests": 2, "compression": "fp16", "batch_size": 32, "reason": "hot \"rack\""}


async def _row(app: FastAPI) -> tuple[object, ...]:
    async with app.state.sessionmaker() as session:
        return tuple((await session.execute(select(*ASSIGNED_COLUMNS).where(Job.id == "train"))).one())


async def _job(app: FastAPI) -> Job:
    async with app.state.sessionmaker() as session:
        job = await session.get(Job, ("acme", "train"))
        assert job is not None
        return job


@pytest.fixture
async def placed(app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle) -> FastAPI:
    await create_host(client, "h0", gpus=8, group="rack-a")
    await create_job(
        client, acme, "train", max_workers=4, initial_workers=2, entrypoint=ENTRYPOINT,
        gradient_compression={"allowed": ["none", "fp16"]},
    )
    async with app.state.sessionmaker() as session:
        await session.execute(update(Job).where(Job.id == "train").values(directives=DIRECTIVES))
        await session.commit()
    return app


async def test_an_entry_from_the_rows_stored_text_equals_the_jobs_own(placed: FastAPI) -> None:
    row, job = await _row(placed), await _job(placed)
    assert all(isinstance(row[i], str) for i in (4, 8, 11)), "JSON columns come back as their stored text"
    made = entry(row, workers=2)
    assert made.job == AssignedJob(
        tenant="acme", job="train", workers=2, gpus=2 * job.gpus_per_worker, parallel_plan=job.parallel_plan,
        entrypoint=tuple(ENTRYPOINT), epoch=job.placement_epoch, nodes=len(placement_hosts(job.placement)),
        restart=job.restart_mode, ranges=job_ranges(job), directives=job_directives(job),
    )
    assert made.job.directives.batch_size == 32 and made.job.entrypoint == tuple(ENTRYPOINT)
    assert made.job.nodes == 1 and made.json == made.job.model_dump_json()
    warm = entry(row, workers=1, standby_until=NOW)
    assert (warm.job.epoch, warm.job.nodes, warm.job.standby_until) == (job.placement_epoch + 1, 2, NOW)


async def test_entries_are_made_once_per_distinct_row(placed: FastAPI) -> None:
    first, again = await _row(placed), await _row(placed)
    assert first is not again and entry(first, workers=2) is entry(again, workers=2)
    assert entry(first, workers=1) is not entry(first, workers=2)
    async with placed.state.sessionmaker() as session:
        await session.execute(update(Job).where(Job.id == "train").values(directives={**DIRECTIVES, "version": 4}))
        await session.commit()
    changed = entry(await _row(placed), workers=2)
    assert changed.job.directives.version == 4, "a changed column is a new entry, not the memoised one"
    assert entry(first, workers=2).job.directives.version == 3


def _assigned(job: str, **fields: object) -> AssignedJob:
    return AssignedJob(tenant="acme", job=job, workers=1, gpus=1, **fields)


def entry_of(job: AssignedJob) -> Entry:
    return Entry(job, job.model_dump_json())


@pytest.mark.parametrize("jobs", [0, 1, 3])
def test_a_payload_spliced_from_entries_is_the_assignments_own_json(jobs: int) -> None:
    approval = MaintenanceApproval(negotiation="0" * 32, notice="notice-1")
    entries = [
        entry_of(_assigned(f"job-{i}", entrypoint=tuple(ENTRYPOINT), approvals=(approval,) * (i % 2)))
        for i in range(jobs)
    ]
    assignment = HostAssignment(
        host="h0", locality_group="rack-a", generation=7, jobs=tuple(e.job for e in entries),
        standby=(_assigned("warm", standby_until=NOW, restart=RestartMode.IMMEDIATE),), updated_at=NOW,
    )
    payload = assignment_payload(assignment, entries)
    assert payload == assignment.model_dump_json().encode()
    assert HostAssignment.model_validate_json(payload) == assignment
