"""Maintenance approvals over HTTP, on SQLite and PostgreSQL: the tenant's `approve_maintenance` negotiation, the
command to the agents that its accept puts into the job's hosts' desired state, and the agents' reports as rounds.

The control plane does not know notices, so it offers "approve now" to a job that runs somewhere and declines one
that runs nowhere; the accept lists the approval in the desired state of every host of the job (in the accept's
transaction: when the accept is refused, nothing of it is queued); the agents' outcome is an idempotent provider
round; a final one takes the approval off the desired state, and the sweeper gives up on an approval nobody settles.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select

from api.models import OutboxTopic
from api.models_approvals import ApprovalStatus, MaintenanceApprovalRow
from api.services.approval_commands import APPROVAL_TTL, MAX_OPEN_APPROVALS
from api.services.approval_lifecycle import TRANSITIONS, ApprovalConflictError, next_approval_status
from api.services.maintenance_approvals import expire_approvals
from api.services.negotiation_policy import DEFAULT_OFFER_TTL, Decline, FreeCapacity, JobSnapshot, Regions, decide
from harmonaize.desired_state import HostAssignment, MaintenanceApproval
from harmonaize.jobs import ParallelPlan
from harmonaize.negotiation import NegotiationKind, NegotiationTerms, Offer, OfferOption, RoundAction
from tests.api.api_testkit import ADMIN, FakeClock, TenantHandle, create_host, create_job, field_names
from tests.api.negotiation_kit import act, negotiate, outbox

NOTICE = "m-0123456789abcdef"
OTHER_NOTICE = "m-fedcba9876543210"


@pytest.fixture
async def placed(client: httpx.AsyncClient, acme: TenantHandle) -> TenantHandle:
    """acme's job `train` on hosts h1 and h2 (one worker each, 4 GPUs each: a whole host), `idle` placed nowhere."""
    await create_host(client, "h1", gpus=4, group="rack-a")
    await create_host(client, "h2", gpus=4, group="rack-a")
    job = await create_job(client, acme, "train", gpus_per_worker=4, initial_workers=2)
    assert job["desired_workers"] == 2
    await create_job(client, acme, "idle", gpus_per_worker=4)
    return acme


async def approve(
    client: httpx.AsyncClient, tenant: TenantHandle, job: str = "train", *, key: str, notice: str = NOTICE
) -> dict[str, Any]:
    return await negotiate(client, tenant, job, key=key, kind="approve_maintenance", notice_id=notice)


async def report(client: httpx.AsyncClient, negotiation: str, outcome: str, note: str = "") -> httpx.Response:
    body = {"negotiation": negotiation, "outcome": outcome, "note": note}
    return await client.post("/v1/provider/approvals", json=body, headers=ADMIN)


async def desired(app: FastAPI) -> dict[str, HostAssignment]:
    """The latest desired state queued for each host."""
    latest: dict[str, HostAssignment] = {}
    for row in await outbox(app, OutboxTopic.DESIRED_STATE):
        assignment = HostAssignment.model_validate_json(row.payload)
        latest[assignment.host] = assignment
    return latest


def approvals_of(assignment: HostAssignment, tenant: str, job: str) -> tuple[MaintenanceApproval, ...]:
    (assigned,) = [j for j in assignment.jobs if (j.tenant, j.job) == (tenant, job)]
    return assigned.approvals


async def approval_rows(app: FastAPI) -> list[MaintenanceApprovalRow]:
    async with app.state.sessionmaker() as session:
        return list(await session.scalars(select(MaintenanceApprovalRow)))


async def test_approve_now_is_offered_to_a_placed_job_and_declined_to_one_placed_nowhere(
    client: httpx.AsyncClient, placed: TenantHandle
) -> None:
    offered = await approve(client, placed, key="a1")
    assert (offered["kind"], offered["state"]) == ("approve_maintenance", "offered")
    assert offered["terms"]["notice_id"] == NOTICE
    (option,) = offered["offer"]["options"]
    assert option["workers"] is None and option["parallel_plan"] is None
    assert f"approve maintenance {NOTICE} now" in option["reason"]
    assert "only once they approve it too" in option["reason"], "the shared-host rule, stated as a rule"

    declined = await approve(client, placed, "idle", key="a2")
    assert (declined["state"], declined["offer"]) == ("declined", None)
    assert declined["rounds"][-1]["note"] == "the job runs on no host now: there is no maintenance of it to approve"

    listed = (await client.get("/v1/negotiations", params={"kind": "approve_maintenance"}, headers=placed.headers))
    assert {item["id"] for item in listed.json()["items"]} == {offered["id"], declined["id"]}
    other = await client.get("/v1/negotiations", params={"kind": "scale"}, headers=placed.headers)
    assert other.json()["items"] == []


async def test_the_accept_queues_the_approval_for_every_host_of_the_job_in_its_own_transaction(
    app: FastAPI, client: httpx.AsyncClient, placed: TenantHandle, clock: FakeClock
) -> None:
    offered = await approve(client, placed, key="a1")
    before = len(await outbox(app, OutboxTopic.DESIRED_STATE))
    epochs = {host: a.jobs[0].epoch for host, a in (await desired(app)).items()}
    clock.advance(seconds=5)
    accepted = await act(client, placed, offered["id"], RoundAction.ACCEPT)
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["state"] == "accepted"
    assert [r["action"] for r in accepted.json()["rounds"]] == ["request", "offer", "accept"]

    assert len(await outbox(app, OutboxTopic.DESIRED_STATE)) == before + 2, "one new assignment per host of the job"
    expected = (MaintenanceApproval(negotiation=offered["id"], notice=NOTICE),)
    latest = await desired(app)
    assert {host: approvals_of(a, "acme", "train") for host, a in latest.items()} == {"h1": expected, "h2": expected}
    assert {host: a.jobs[0].epoch for host, a in latest.items()} == epochs, "a command, not a new placement"
    (row,) = await approval_rows(app)
    assert (row.status, row.notice_id, row.accepted_at) == (ApprovalStatus.QUEUED, NOTICE, clock())
    job = (await client.get("/v1/jobs/train", headers=placed.headers)).json()
    assert job["desired_workers"] == 2, "no capacity changes hands"

    # The job loses its hosts before a second approval is accepted: the accept is refused and nothing of it is queued.
    second = await approve(client, placed, key="a2", notice=OTHER_NOTICE)
    for host in ("h1", "h2"):
        assert (await client.post(f"/v1/provider/hosts/{host}/down", headers=ADMIN)).status_code == 200
    queued = len(await outbox(app))
    refused = await act(client, placed, second["id"], RoundAction.ACCEPT)
    assert refused.status_code == 409
    assert refused.json()["reason"] == "the job runs on no host now: there is no maintenance of it to approve"
    assert len(await outbox(app)) == queued, "no desired state, no event: the accept rolled back whole"
    assert [r.negotiation_id for r in await approval_rows(app)] == [offered["id"]]
    still = (await client.get(f"/v1/negotiations/{second['id']}", headers=placed.headers)).json()
    assert (still["state"], len(still["rounds"])) == ("offered", 2)


async def test_a_rejected_or_expired_approval_queues_nothing(
    app: FastAPI, client: httpx.AsyncClient, placed: TenantHandle, clock: FakeClock
) -> None:
    rejected = await approve(client, placed, key="a1")
    assert (await act(client, placed, rejected["id"], RoundAction.REJECT)).status_code == 200
    expired = await approve(client, placed, key="a2")
    clock.advance(minutes=5)
    late = await act(client, placed, expired["id"], RoundAction.ACCEPT)
    assert late.status_code == 409 and late.json()["reason"] == "negotiation is expired: cannot accept"
    assert await approval_rows(app) == []
    assert all(not job.approvals for a in (await desired(app)).values() for job in a.jobs)
    for negotiation in (rejected["id"], expired["id"]):
        assert (await report(client, negotiation, "approved")).status_code == 404


async def test_the_agents_reports_are_idempotent_rounds_and_a_final_one_clears_the_desired_state(
    app: FastAPI, client: httpx.AsyncClient, placed: TenantHandle, clock: FakeClock
) -> None:
    offered = await approve(client, placed, key="a1")
    assert (await act(client, placed, offered["id"], RoundAction.ACCEPT)).status_code == 200

    clock.advance(seconds=1)
    waiting = await report(client, offered["id"], "approval_pending", "waiting for the other tenants on the host")
    assert waiting.status_code == 200 and waiting.json() == {"outcome": "recorded", "status": "pending"}
    again = await report(client, offered["id"], "approval_pending", "waiting for the other tenants on the host")
    assert again.json() == {"outcome": "duplicate", "status": "pending"}
    assert approvals_of((await desired(app))["h1"], "acme", "train"), "still waiting: still asked"

    clock.advance(seconds=1)
    done = await report(client, offered["id"], "approved", "approved at the cloud")
    assert done.json() == {"outcome": "recorded", "status": "approved"}
    for outcome in ("approved", "approval_pending"):
        assert (await report(client, offered["id"], outcome)).json()["outcome"] == "duplicate"
    contradicted = await report(client, offered["id"], "approval_failed", "the cloud refused")
    assert contradicted.status_code == 409
    assert contradicted.json()["reason"] == "the maintenance approval is approved: cannot record approval_failed"

    negotiation = (await client.get(f"/v1/negotiations/{offered['id']}", headers=placed.headers)).json()
    assert negotiation["state"] == "accepted"
    rounds = [(r["actor"], r["action"], r["note"]) for r in negotiation["rounds"][2:]]
    assert rounds == [
        ("tenant", "accept", rounds[0][2]),
        ("provider", "approval_pending", "waiting for the other tenants on the host"),
        ("provider", "approved", "approved at the cloud"),
    ]
    assert negotiation["updated_at"] == "2026-03-01T12:00:02Z"
    latest = await desired(app)
    assert {host: approvals_of(a, "acme", "train") for host, a in latest.items()} == {"h1": (), "h2": ()}

    failed = await approve(client, placed, key="a2", notice=OTHER_NOTICE)
    assert (await act(client, placed, failed["id"], RoundAction.ACCEPT)).status_code == 200
    answer = await report(client, failed["id"], "approval_failed")
    assert answer.json() == {"outcome": "recorded", "status": "failed"}
    (last,) = (await client.get(f"/v1/negotiations/{failed['id']}", headers=placed.headers)).json()["rounds"][3:]
    assert last["action"] == "approval_failed"
    assert last["note"] == "not approved: the maintenance keeps its scheduled time", "the default note"


async def test_an_approval_nobody_settles_is_given_up_by_the_sweeper(
    app: FastAPI, client: httpx.AsyncClient, placed: TenantHandle, clock: FakeClock
) -> None:
    offered = await approve(client, placed, key="a1")
    assert (await act(client, placed, offered["id"], RoundAction.ACCEPT)).status_code == 200
    async with app.state.sessionmaker() as session:
        assert await expire_approvals(session, now=clock()) == 0
    clock.advance(seconds=APPROVAL_TTL.total_seconds())
    async with app.state.sessionmaker() as session:
        assert await expire_approvals(session, now=clock()) == 1
    async with app.state.sessionmaker() as session:
        assert await expire_approvals(session, now=clock()) == 0, "once"
    last = (await client.get(f"/v1/negotiations/{offered['id']}", headers=placed.headers)).json()["rounds"][-1]
    assert (last["actor"], last["action"]) == ("provider", "approval_failed")
    assert last["note"] == "not approved within 30 minutes of the accept: the maintenance keeps its scheduled time"
    assert all(not job.approvals for a in (await desired(app)).values() for job in a.jobs)
    assert (await report(client, offered["id"], "approved")).status_code == 409, "too late for the agent"


async def test_another_tenant_can_neither_read_nor_approve_nor_report(
    client: httpx.AsyncClient, placed: TenantHandle, globex: TenantHandle
) -> None:
    offered = await approve(client, placed, key="a1")
    for response in (
        await client.get(f"/v1/negotiations/{offered['id']}", headers=globex.headers),
        await act(client, globex, offered["id"], RoundAction.ACCEPT),
        await act(client, globex, offered["id"], RoundAction.COUNTER, {"notice_id": OTHER_NOTICE}),
    ):
        assert response.status_code == 404 and response.json()["reason"] == "negotiation not found"
    foreign_job = await client.post(
        "/v1/negotiations",
        json={"job": "train", "kind": "approve_maintenance", "terms": {"notice_id": NOTICE}},
        headers={**globex.headers, "Idempotency-Key": "g1"},
    )
    assert foreign_job.status_code == 404 and foreign_job.json()["reason"] == "job not found"
    listed = await client.get("/v1/negotiations", params={"kind": "approve_maintenance"}, headers=globex.headers)
    assert listed.json()["items"] == []

    as_tenant = await client.post(
        "/v1/provider/approvals", json={"negotiation": offered["id"], "outcome": "approved"}, headers=placed.headers
    )
    assert as_tenant.status_code == 403 and "admin" in as_tenant.json()["reason"]
    mine = (await client.get(f"/v1/negotiations/{offered['id']}", headers=placed.headers)).json()
    assert (mine["state"], len(mine["rounds"])) == ("offered", 2), "nothing the others tried changed it"


@pytest.mark.parametrize(
    ("kind", "terms", "field", "message"),
    [
        ("approve_maintenance", {}, "body.terms.notice_id", "approve_maintenance needs notice_id: the maintenance"),
        ("approve_maintenance", {"notice_id": NOTICE, "desired_workers": 2}, "body.terms",
         "approve_maintenance takes notice_id only"),
        ("scale", {"desired_workers": 2, "notice_id": NOTICE}, "body.terms.notice_id",
         "notice_id is for approve_maintenance requests, not scale"),
        ("approve_maintenance", {"notice_id": "M-Upper"}, "body.terms.notice_id", "must be an id"),
        ("approve_maintenance", {"notice_id": "m-" + "a" * 62}, "body.terms.notice_id", "must be an id"),
        ("approve_maintenance", {"notice_id": "hz.t.globex.>"}, "body.terms.notice_id", "must be an id"),
    ],
)
async def test_bad_requests_are_422_naming_the_field_and_why(
    app: FastAPI, client: httpx.AsyncClient, placed: TenantHandle, kind: str, terms: dict[str, Any], field: str,
    message: str,
) -> None:
    response = await client.post(
        "/v1/negotiations",
        json={"job": "train", "kind": kind, "terms": terms},
        headers={**placed.headers, "Idempotency-Key": "bad"},
    )
    assert response.status_code == 422, response.text
    assert response.json()["reason"] == f"invalid request: {field}"
    (error,) = response.json()["errors"]
    assert error["field"] == field and message in error["message"]
    assert await approval_rows(app) == []


async def test_bad_counters_and_reports_are_refused_with_reasons(
    app: FastAPI, client: httpx.AsyncClient, placed: TenantHandle
) -> None:
    offered = await approve(client, placed, key="a1")
    countered = await act(client, placed, offered["id"], RoundAction.COUNTER, {"desired_workers": 3})
    assert countered.status_code == 200 and countered.json()["state"] == "declined"
    assert countered.json()["rounds"][-1]["note"] == (
        "approve_maintenance needs notice_id: the maintenance to approve, as its event names it"
    )

    scale = await negotiate(client, placed, "train", key="s1", desired_workers=2)
    assert (await act(client, placed, scale["id"], RoundAction.ACCEPT)).status_code == 200
    pending = await approve(client, placed, key="a2")
    unknown = "0190a0a0-0000-7000-8000-000000000000"
    for negotiation in (scale["id"], pending["id"], unknown):
        refused = await report(client, negotiation, "approved")
        assert refused.status_code == 404
        assert refused.json()["reason"] == "no accepted maintenance approval with this id"

    assert (await act(client, placed, pending["id"], RoundAction.ACCEPT)).status_code == 200
    for body, fields in (
        ({"negotiation": pending["id"], "outcome": "accept"}, {"body.outcome"}),
        ({"negotiation": "not-a-uuid", "outcome": "approved"}, {"body.negotiation"}),
        ({"negotiation": pending["id"], "outcome": "approved", "note": "x" * 301}, {"body.note"}),
        ({"negotiation": pending["id"], "outcome": "approved", "note": "a\nb"}, {"body.note"}),
        ({"negotiation": pending["id"], "outcome": "approved", "event_id": "f020ba2e"}, {"body.event_id"}),
    ):
        response = await client.post("/v1/provider/approvals", json=body, headers=ADMIN)
        assert response.status_code == 422, (body, response.text)
        assert field_names(response) == fields
    (row,) = await approval_rows(app)
    assert row.status is ApprovalStatus.QUEUED, "no bad report moved it"


async def test_a_job_may_have_only_so_many_approvals_waiting(
    app: FastAPI, client: httpx.AsyncClient, placed: TenantHandle
) -> None:
    for number in range(MAX_OPEN_APPROVALS):
        offered = await approve(client, placed, key=f"k{number}", notice=f"m-{number:016x}")
        assert (await act(client, placed, offered["id"], RoundAction.ACCEPT)).status_code == 200
    one_more = await approve(client, placed, key="more", notice="m-ffffffffffffffff")
    refused = await act(client, placed, one_more["id"], RoundAction.ACCEPT)
    assert refused.status_code == 409 and "wait for their outcome first" in refused.json()["reason"]
    assert len(approvals_of((await desired(app))["h1"], "acme", "train")) == MAX_OPEN_APPROVALS


@pytest.mark.parametrize(("placed_hosts", "offered"), [(0, False), (1, True), (3, True)])
def test_the_policy_offers_approve_now_exactly_when_the_job_runs_somewhere(placed_hosts: int, offered: bool) -> None:
    snapshot = JobSnapshot(min_workers=1, max_workers=4, gpus_per_worker=4, desired_workers=placed_hosts,
                           parallel_plan=ParallelPlan.DDP, placed_hosts=placed_hosts)
    now = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    answer = decide(NegotiationKind.APPROVE_MAINTENANCE, NegotiationTerms(notice_id=NOTICE), job=snapshot,
                    capacity=FreeCapacity(), carbon=(), regions=Regions(current="DE", known=("DE",)), now=now)
    if not offered:
        assert answer == Decline("the job runs on no host now: there is no maintenance of it to approve")
        return
    assert isinstance(answer, Offer) and answer.expires_at == now + DEFAULT_OFFER_TTL
    (option,) = answer.options
    assert option == OfferOption(reason=option.reason) and NOTICE in option.reason, "no workers, plan, start or region"
    counter = decide(NegotiationKind.APPROVE_MAINTENANCE, NegotiationTerms(desired_workers=2), job=snapshot,
                     capacity=FreeCapacity(), carbon=(), regions=Regions(current="DE", known=("DE",)), now=now)
    assert counter == Decline("approve_maintenance needs notice_id: the maintenance to approve, as its event names it")


def test_the_approval_table_lists_only_moves_forward_and_takes_repeats_as_duplicates() -> None:
    outcomes = (RoundAction.APPROVAL_PENDING, RoundAction.APPROVED, RoundAction.APPROVAL_FAILED)
    for status in ApprovalStatus:
        for outcome in outcomes:
            if (status, outcome) in TRANSITIONS:
                assert status in (ApprovalStatus.QUEUED, ApprovalStatus.PENDING)
                assert next_approval_status(status, outcome) is TRANSITIONS[(status, outcome)]
            elif _repeat(status, outcome):
                assert next_approval_status(status, outcome) is None
            else:
                with pytest.raises(ApprovalConflictError):
                    next_approval_status(status, outcome)


def _repeat(status: ApprovalStatus, outcome: RoundAction) -> bool:
    """A report that changes nothing: the status it leads to, or a late "waiting" after the outcome."""
    return (status, outcome) in {
        (ApprovalStatus.PENDING, RoundAction.APPROVAL_PENDING),
        (ApprovalStatus.APPROVED, RoundAction.APPROVED),
        (ApprovalStatus.APPROVED, RoundAction.APPROVAL_PENDING),
        (ApprovalStatus.FAILED, RoundAction.APPROVAL_FAILED),
        (ApprovalStatus.FAILED, RoundAction.APPROVAL_PENDING),
    }
