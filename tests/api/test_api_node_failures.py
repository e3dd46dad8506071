"""Node failures on healthy hosts over HTTP, on SQLite and PostgreSQL: a hung node leaves its job like a failed host's
workers (new epoch, immediate restart, host still up); a node out of restarts keeps its place; both reach the job's
status and the tenant's events under the tenant's pseudonym; reports are idempotent and stale ones change nothing.

Desired state and tenant events are read from the outbox (no bus); time is the app's `FakeClock`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
from fastapi import FastAPI

from api.models import OutboxTopic
from harmonaize.desired_state import RestartMode
from harmonaize.events import Failure, FailureKind, Severity, parse_event_as
from harmonaize.pseudonyms import host_pseudonym
from tests.api.api_testkit import ADMIN, PROVIDER_SECRET, FakeClock, TenantHandle
from tests.api.negotiation_kit import ledger_totals, outbox
from tests.api.test_api_job_runs_placement import desired, host, job_epoch, shape, two_host_job

REPORTS = "/v1/provider/node-failures"


def report(
    clock: FakeClock, *, reason: str = "frozen", epoch: int = 1, host_id: str = "h2", **extra: Any
) -> dict[str, Any]:
    return {
        "tenant": "acme", "job": "train", "host": host_id, "epoch": epoch, "reason": reason, "step": 41,
        "detected_at": (clock() - timedelta(seconds=1)).isoformat(), "detail": "local rank 0 frozen: no beat for 5.2 s",
        **extra,
    }


async def failure_events(app: FastAPI) -> list[Failure]:
    rows = [r for r in await outbox(app, OutboxTopic.TENANT_EVENT) if r.subject == "hz.t.acme.events.failure.train"]
    return [parse_event_as(row.payload, Failure).data for row in rows]


async def status(client: httpx.AsyncClient, tenant: TenantHandle) -> dict[str, Any]:
    reply = await client.get("/v1/jobs/train/status", headers=tenant.headers)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


async def test_a_hung_node_leaves_its_job_at_once_and_the_tenant_is_told(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    await two_host_job(client, acme)
    count = len(await desired(app))
    refused = await client.post(REPORTS, json=report(clock), headers=acme.headers)
    assert refused.status_code == 403, "a tenant cannot report node failures"

    clock.advance(seconds=30)
    reply = await client.post(REPORTS, json=report(clock), headers=ADMIN)
    assert (reply.status_code, reply.json()) == (200, {"outcome": "released"})
    after = (await desired(app))[count:]
    assert [shape(a) for a in after] == [("h1", 2, 2, 1, RestartMode.IMMEDIATE, "ddp"), ("h2", None)]
    assert await job_epoch(client, acme, "train") == (2, 2)
    assert await ledger_totals(app) == (2, 2, 2)
    h2 = await host(client, "h2")
    assert (h2["down_at"], h2["allocated_gpus"]) == (None, 0), "the host stays up and its GPUs are free again"

    pseudonym = host_pseudonym(PROVIDER_SECRET.encode(), "acme", "h2")
    [event] = await failure_events(app)
    assert (event.kind, event.host, event.reason, event.severity) == (
        FailureKind.NODE_HUNG, pseudonym, "frozen", Severity.CRITICAL,
    )
    [failure] = (await status(client, acme))["node_failures"]
    assert failure == {
        "host": pseudonym, "epoch": 1, "kind": "node_hung", "reason": "frozen", "step": 41, "left_job": True,
        "detected_at": "2026-03-01T12:00:29Z",
    }
    assert "h2" not in str(failure) and "rank" not in str(failure), "no provider names or internal detail"


async def test_reporting_a_node_again_or_from_an_old_epoch_changes_nothing(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    await two_host_job(client, acme)
    assert (await client.post(REPORTS, json=report(clock), headers=ADMIN)).json() == {"outcome": "released"}
    count = len(await desired(app))
    again = await client.post(REPORTS, json=report(clock), headers=ADMIN)
    assert (again.status_code, again.json()) == (200, {"outcome": "duplicate"})
    old = await client.post(REPORTS, json=report(clock, host_id="h1", reason="stalled"), headers=ADMIN)
    assert (old.status_code, old.json()) == (200, {"outcome": "stale"}), "epoch 1 is over: h1 already restarted"
    gone = await client.post(REPORTS, json=report(clock, epoch=2, host_id="h2"), headers=ADMIN)
    assert gone.json() == {"outcome": "stale"}, "the job no longer runs on h2"
    assert len(await desired(app)) == count and await job_epoch(client, acme, "train") == (2, 2)
    assert len(await failure_events(app)) == 1 and len((await status(client, acme))["node_failures"]) == 1


async def test_a_node_out_of_restarts_keeps_its_place_and_shows_in_the_status(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    await two_host_job(client, acme)
    count = len(await desired(app))
    reply = await client.post(REPORTS, json=report(clock, reason="out_of_restarts", step=None), headers=ADMIN)
    assert (reply.status_code, reply.json()) == (200, {"outcome": "recorded"})
    assert len(await desired(app)) == count and await job_epoch(client, acme, "train") == (4, 1)
    [event] = await failure_events(app)
    assert (event.kind, event.reason) == (FailureKind.NODE_FAILED, "out_of_restarts")
    body = await status(client, acme)
    assert body["placement_epoch"] == 1
    assert [(f["kind"], f["epoch"], f["left_job"], f["step"]) for f in body["node_failures"]] == [
        ("node_failed", 1, False, None)
    ]


async def test_bad_reports_are_refused_naming_what_is_wrong(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    await two_host_job(client, acme)
    cases = [
        (report(clock, job="nope"), 404, "no job 'nope'"),
        (report(clock, host_id="nowhere"), 404, "no host 'nowhere'"),
        (report(clock, epoch=7), 409, "epoch 7 is ahead of the job's placement epoch 1"),
        (report(clock, reason="sleepy"), 422, "reason"),
        (report(clock, detected_at="2026-03-01T12:00:00"), 422, "detected_at"),
    ]
    for body, code, reason in cases:
        reply = await client.post(REPORTS, json=body, headers=ADMIN)
        assert reply.status_code == code, (body, reply.text)
        assert reason in reply.text, reply.text
    assert await failure_events(app) == [] and (await status(client, acme))["node_failures"] == []
