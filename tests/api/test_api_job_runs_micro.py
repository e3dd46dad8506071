"""Running jobs over HTTP, on SQLite and PostgreSQL: micro-loop directives, progress reports, the tenant's views.

Directives are proposed and progress is relayed with the admin token (the provider's own components); the tenant
reads `/v1/jobs/{job}/status|timeline|directives`. Tenant events and desired state are read from the outbox (no bus).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from api.models import OutboxTopic
from harmonaize.desired_state import HostAssignment
from harmonaize.events import DirectiveUpdate, EventData, JobUpdate, parse_event_as
from tests.api.api_testkit import ADMIN, FakeClock, TenantHandle, create_host, create_job
from tests.api.negotiation_kit import outbox

DIRECTIVES = "/v1/provider/jobs/acme/train/directives"
IN_RANGE = {"checkpoint_interval_steps": 200, "compression": "powersgd", "powersgd_rank": 2, "reason": "congested"}


@pytest.fixture
async def running(client: httpx.AsyncClient, acme: TenantHandle) -> TenantHandle:
    """acme's 2-worker job on h1 (epoch 1): intervals 50..500, compression none or powersgd (rank <= 4), no batch
    size range, accumulation 1..4."""
    await create_host(client, "h1", gpus=2, group="rack-a")
    await create_job(
        client, acme, "train", initial_workers=2, entrypoint=["-m", "workloads.examples.mlp"], batch_size=None,
        checkpoint_interval_steps={"min": 50, "max": 500},
        gradient_compression={"allowed": ["none", "powersgd"], "powersgd_max_rank": 4},
        gradient_accumulation={"min": 1, "max": 4},
    )
    return acme


async def events(app: FastAPI, kind: str) -> list[Any]:
    """acme's queued `kind` events about job train, oldest first (payloads parsed)."""
    models: dict[str, type[EventData]] = {"directive": DirectiveUpdate, "job": JobUpdate}
    model = models[kind]
    rows = [r for r in await outbox(app, OutboxTopic.TENANT_EVENT) if r.subject == f"hz.t.acme.events.{kind}.train"]
    return [parse_event_as(row.payload, model).data for row in rows]


async def current_directives(app: FastAPI) -> tuple[int, int]:
    """(number of desired-state writes, directives version in h1's latest assignment)."""
    rows = await outbox(app, OutboxTopic.DESIRED_STATE)
    (job,) = HostAssignment.model_validate_json(rows[-1].payload).jobs
    return len(rows), job.directives.version


async def history(client: httpx.AsyncClient, tenant: TenantHandle) -> list[dict[str, Any]]:
    response = await client.get("/v1/jobs/train/directives", headers=tenant.headers)
    assert response.status_code == 200, response.text
    return response.json()


async def test_directives_are_versioned_deduplicated_and_visible_to_the_tenant(
    app: FastAPI, client: httpx.AsyncClient, running: TenantHandle, clock: FakeClock
) -> None:
    assert (await client.put(DIRECTIVES, json=IN_RANGE, headers=running.headers)).status_code == 403
    missing = await client.put("/v1/provider/jobs/acme/nothing/directives", json=IN_RANGE, headers=ADMIN)
    assert missing.status_code == 404
    assert await history(client, running) == [] and await current_directives(app) == (1, 0)

    first = await client.put(DIRECTIVES, json=IN_RANGE, headers=ADMIN)
    assert first.status_code == 200, first.text
    issued = first.json()
    assert (issued["version"], issued["state"], issued["refusals"], issued["step"]) == (1, "issued", [], None)
    assert issued["settings"] == {
        "version": 1, "checkpoint_requests": 0, "checkpoint_interval_steps": 200, "compression": "powersgd",
        "powersgd_rank": 2, "batch_size": None, "gradient_accumulation": None, "reason": "congested",
    }
    assert await current_directives(app) == (2, 1)

    clock.advance(seconds=1)
    repeated = await client.put(DIRECTIVES, json=IN_RANGE, headers=ADMIN)
    assert (repeated.status_code, repeated.json()) == (200, None), "an unchanged proposal is a no-op"
    assert await current_directives(app) == (2, 1) and len(await history(client, running)) == 1

    for expected_requests in (1, 2):
        clock.advance(seconds=1)
        now = await client.put(DIRECTIVES, json={**IN_RANGE, "checkpoint_now": True}, headers=ADMIN)
        assert now.status_code == 200, now.text
        settings = now.json()["settings"]
        assert (now.json()["version"], settings["checkpoint_requests"]) == (1 + expected_requests, expected_requests)
        assert settings["checkpoint_interval_steps"] == 200
    clock.advance(seconds=1)
    changed = await client.put(DIRECTIVES, json={"checkpoint_interval_steps": 100, "gradient_accumulation": 2},
                               headers=ADMIN)
    assert changed.status_code == 200 and changed.json()["version"] == 4
    assert changed.json()["settings"]["checkpoint_requests"] == 2, "the counter only grows"
    assert changed.json()["settings"]["compression"] is None
    assert await current_directives(app) == (5, 4)

    listed = await history(client, running)
    assert [(d["version"], d["state"]) for d in listed] == [(4, "issued"), (3, "issued"), (2, "issued"), (1, "issued")]
    assert listed[-1] == issued
    limited = await client.get("/v1/jobs/train/directives", params={"limit": 2}, headers=running.headers)
    assert [d["version"] for d in limited.json()] == [4, 3]
    published = await events(app, "directive")
    assert [(e.version, e.state, e.checkpoint_requests) for e in published] == [
        (1, "issued", 0), (2, "issued", 1), (3, "issued", 2), (4, "issued", 2),
    ]
    assert published[0].compression == "powersgd" and published[0].reason == "congested"


REFUSED = [
    ({"compression": "fp16"}, "compression"),
    ({"compression": "powersgd", "powersgd_rank": 8}, "powersgd_rank"),
    ({"compression": "powersgd"}, "powersgd_rank"),
    ({"batch_size": 32}, "batch_size"),
    ({"checkpoint_interval_steps": 20}, "checkpoint_interval_steps"),
    ({"checkpoint_interval_steps": 600}, "checkpoint_interval_steps"),
    ({"gradient_accumulation": 8}, "gradient_accumulation"),
]


async def test_out_of_range_proposals_are_refused_stored_and_published(
    app: FastAPI, client: httpx.AsyncClient, running: TenantHandle, clock: FakeClock
) -> None:
    assert (await client.put(DIRECTIVES, json=IN_RANGE, headers=ADMIN)).status_code == 200
    before = await current_directives(app)
    for index, (proposal, field) in enumerate(REFUSED, start=1):
        clock.advance(seconds=1)
        response = await client.put(DIRECTIVES, json=proposal, headers=ADMIN)
        assert response.status_code == 422, (proposal, response.text)
        reason = response.json()["reason"]
        assert reason.startswith("directive refused: ") and field in reason, (proposal, reason)

        newest = (await history(client, running))[0]
        assert (newest["state"], newest["version"], newest["step"]) == ("refused", None, None), proposal
        assert any(field in refusal for refusal in newest["refusals"]), (proposal, newest)
        assert newest["created_at"] == clock().isoformat().replace("+00:00", "Z")
        refused = await events(app, "directive")
        assert len(refused) == 1 + index and refused[-1].state == "refused", proposal
        assert any(field in refusal for refusal in refused[-1].refusals), proposal
        assert await current_directives(app) == before, "nothing reaches the job's hosts"

    listed = await history(client, running)
    assert [d["state"] for d in listed] == ["refused"] * len(REFUSED) + ["issued"]
    assert [d["version"] for d in listed] == [None] * len(REFUSED) + [1]
    again = await client.put(DIRECTIVES, json={**IN_RANGE, "checkpoint_now": True}, headers=ADMIN)
    assert again.json()["version"] == 2, "refusals use no version"
    bad_reason = await client.put(DIRECTIVES, json={"reason": "a\nb"}, headers=ADMIN)
    assert bad_reason.status_code == 422 and bad_reason.json()["errors"][0]["field"] == "body.reason"


def report(**overrides: Any) -> dict[str, Any]:
    """A progress report of acme's job train (epoch 1, step 10, 2 workers, ddp), overridden field by field."""
    body: dict[str, Any] = {
        "tenant": "acme", "job": "train", "epoch": 1, "step": 10, "world_size": 2, "parallel_plan": "ddp",
        "checkpoint_interval_steps": 200, "batch_size": 32, "updated_at": "2026-03-01T12:00:00Z",
    }
    body.update(overrides)
    return body


async def post_progress(client: httpx.AsyncClient, body: dict[str, Any]) -> bool:
    response = await client.post("/v1/provider/progress", json=body, headers=ADMIN)
    assert response.status_code == 202, response.text
    return response.json()["newer"]


async def status(client: httpx.AsyncClient, tenant: TenantHandle) -> dict[str, Any]:
    response = await client.get("/v1/jobs/train/status", headers=tenant.headers)
    assert response.status_code == 200, response.text
    return response.json()


async def timeline(client: httpx.AsyncClient, tenant: TenantHandle) -> list[tuple[Any, ...]]:
    response = await client.get("/v1/jobs/train/timeline", headers=tenant.headers)
    assert response.status_code == 200, response.text
    fields = ("epoch", "world_size", "parallel_plan", "step", "resumed_from_step")
    return [tuple(entry[name] for name in fields) for entry in response.json()]


async def test_progress_is_applied_monotonically_and_outcomes_once(
    app: FastAPI, client: httpx.AsyncClient, running: TenantHandle, clock: FakeClock
) -> None:
    for version in (1, 2):
        body = {**IN_RANGE, "checkpoint_now": version == 2}
        assert (await client.put(DIRECTIVES, json=body, headers=ADMIN)).json()["version"] == version
    blank = await status(client, running)
    assert (blank["progress"], blank["reported_at"], blank["placement_epoch"], blank["desired_workers"]) == (
        None, None, 1, 2)
    assert await timeline(client, running) == []
    refused = await client.post("/v1/provider/progress", json=report(), headers=running.headers)
    assert refused.status_code == 403
    assert (await status(client, running))["progress"] is None

    clock.advance(seconds=10)
    assert await post_progress(client, report()) is True
    assert await timeline(client, running) == [(1, 2, "ddp", 0, None)]
    assert [(e.epoch, e.world_size, e.parallel_plan, e.step) for e in await events(app, "job")] == [(1, 2, "ddp", 0)]

    clock.advance(seconds=10)
    latest_at = clock().isoformat().replace("+00:00", "Z")
    assert await post_progress(client, report(step=20, loss=1.5)) is True
    shown = await status(client, running)
    assert (shown["progress"]["step"], shown["progress"]["loss"], shown["reported_at"]) == (20, 1.5, latest_at)
    assert len(await timeline(client, running)) == 1 and len(await events(app, "job")) == 1, "same shape"

    clock.advance(seconds=10)
    applied = {"version": 1, "status": "applied", "step": 15}
    assert await post_progress(client, report(step=5, loss=9.0, outcomes=[applied])) is False
    assert await post_progress(client, report(epoch=0, step=500, world_size=4)) is False
    shown = await status(client, running)
    assert (shown["progress"]["epoch"], shown["progress"]["step"], shown["progress"]["loss"]) == (1, 20, 1.5)
    assert shown["reported_at"] == latest_at, "an older report does not overwrite the newer one"
    assert await timeline(client, running) == [(1, 2, "ddp", 0, None)], "nor adds a shape"
    by_version = {d["version"]: d for d in await history(client, running)}
    assert (by_version[1]["state"], by_version[1]["step"]) == ("applied", 15), "its outcomes still count"
    assert by_version[2]["state"] == "issued"
    directive_events = await events(app, "directive")
    assert [(e.version, e.state, e.step) for e in directive_events[2:]] == [(1, "applied", 15)]

    tenant_events = len(await outbox(app, OutboxTopic.TENANT_EVENT))
    assert await post_progress(client, report(step=6, outcomes=[applied])) is False
    assert len(await outbox(app, OutboxTopic.TENANT_EVENT)) == tenant_events, "an outcome is recorded once"

    clock.advance(seconds=10)
    runtime_refusal = {"version": 2, "status": "refused", "step": 21, "reasons": ["powersgd is not built here"]}
    unknown = {"version": 99, "status": "applied", "step": 21}
    resumed = report(epoch=2, step=21, world_size=1, resumed_from_step=20, outcomes=[applied, runtime_refusal, unknown])
    assert await post_progress(client, resumed) is True
    assert await timeline(client, running) == [(1, 2, "ddp", 0, None), (2, 1, "ddp", 20, 20)]
    assert [(e.epoch, e.world_size, e.step, e.resumed_from_step) for e in await events(app, "job")] == [
        (1, 2, 0, None), (2, 1, 20, 20),
    ]
    assert len(await outbox(app, OutboxTopic.TENANT_EVENT)) == tenant_events + 2, "a job event and v2's outcome"
    by_version = {d["version"]: d for d in await history(client, running)}
    assert (by_version[2]["state"], by_version[2]["step"]) == ("refused", 21)
    assert by_version[2]["refusals"] == ["powersgd is not built here"]
    assert (by_version[1]["state"], by_version[1]["step"]) == ("applied", 15), "not overwritten by the repeat"
    last = (await events(app, "directive"))[-1]
    assert (last.version, last.state, last.step, last.refusals) == (2, "refused", 21, ("powersgd is not built here",))
    assert (await status(client, running))["progress"]["world_size"] == 1

    clock.advance(seconds=10)
    assert await post_progress(client, report(epoch=2, step=30, world_size=1, parallel_plan="fsdp")) is True
    assert (await timeline(client, running))[-1] == (2, 1, "fsdp", 0, None), "a new plan is a new shape"


async def test_progress_is_kept_over_time_downsampled_each_shape_and_the_end_kept(
    client: httpx.AsyncClient, running: TenantHandle, clock: FakeClock
) -> None:
    async def kept() -> list[tuple[int, int, int, float | None]]:
        response = await client.get("/v1/jobs/train/progress", headers=running.headers)
        assert response.status_code == 200, response.text
        return [(s["epoch"], s["step"], s["world_size"], s["loss"]) for s in response.json()]

    assert await kept() == []
    clock.advance(seconds=1)
    assert await post_progress(client, report(step=1, loss=4.0))
    clock.advance(seconds=0.3)
    assert await post_progress(client, report(step=2, loss=3.9))  # sooner than the period: the status only
    clock.advance(seconds=0.8)
    assert await post_progress(client, report(step=3, loss=3.5))  # 1.1 s after the last sample
    clock.advance(seconds=0.1)
    assert await post_progress(client, report(epoch=2, step=4, world_size=3, loss=3.4))  # a new shape: kept at once
    clock.advance(seconds=0.1)
    assert not await post_progress(client, report(step=9, loss=0.1))  # older epoch: neither status nor sample
    assert await post_progress(client, report(epoch=2, step=5, world_size=3, loss=3.3, finished=True))  # the end
    assert await kept() == [(1, 1, 2, 4.0), (1, 3, 2, 3.5), (2, 4, 3, 3.4), (2, 5, 3, 3.3)]
    limited = await client.get("/v1/jobs/train/progress?limit=2", headers=running.headers)
    assert [s["step"] for s in limited.json()] == [4, 5], "the latest samples, oldest first"
    too_many = await client.get("/v1/jobs/train/progress?limit=5000", headers=running.headers)
    assert too_many.status_code == 422


async def test_another_tenant_sees_none_of_it_and_unknown_jobs_are_404(
    client: httpx.AsyncClient, running: TenantHandle, globex: TenantHandle
) -> None:
    assert (await client.put(DIRECTIVES, json=IN_RANGE, headers=ADMIN)).status_code == 200
    assert await post_progress(client, report()) is True
    for view in ("status", "timeline", "directives", "progress"):
        response = await client.get(f"/v1/jobs/train/{view}", headers=globex.headers)
        assert (response.status_code, response.json()["reason"]) == (404, "job not found"), view

    for body in (report(job="nothing"), report(tenant="globex"), report(tenant="nobody")):
        response = await client.post("/v1/provider/progress", json=body, headers=ADMIN)
        assert response.status_code == 404, (body, response.text)
    theirs = await client.put("/v1/provider/jobs/globex/train/directives", json=IN_RANGE, headers=ADMIN)
    assert theirs.status_code == 404

    await create_job(client, globex, "train")
    own = await status(client, globex)
    assert (own["progress"], own["placement_epoch"], own["desired_workers"]) == (None, 0, 0)
    assert await timeline(client, globex) == [] and await history(client, globex) == []
    assert (await status(client, running))["progress"]["step"] == 10
    assert len(await history(client, running)) == 1
