"""Negotiations over HTTP, on SQLite and PostgreSQL: rounds and history, idempotency, expiry, refused moves, acceptance.

Time is a `FakeClock` the tests move by hand (expiry without sleeping). The outbox is inspected in the database:
these tests run without a bus; delivery is tested in test_outbox_relay.py and tests/e2e.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from api.models import OutboxTopic
from api.services.negotiation_lifecycle import TENANT_ACTIONS, TRANSITIONS, InvalidTransitionError, Step, next_status
from api.services.sweeper import sweep_once
from harmonaize.desired_state import HostAssignment
from harmonaize.events import NegotiationUpdate, parse_event_as
from harmonaize.negotiation import NegotiationState, RoundAction
from tests.api.api_testkit import ADMIN, FakeClock, TenantHandle, create_host, create_job, field_names
from tests.api.negotiation_kit import act, ledger_totals, negotiate, outbox


@pytest.fixture
async def demo(client: httpx.AsyncClient, acme: TenantHandle) -> TenantHandle:
    """The demo's situation: a 1-4 worker job placed on 2 of host h1's 3 GPUs (room for one more worker)."""
    await create_host(client, "h1", gpus=3, group="rack-a")
    job = await create_job(client, acme, "train", initial_workers=2)
    assert job["desired_workers"] == 2
    return acme


async def test_two_rounds_then_accept_with_full_history_and_privacy(
    app: FastAPI, client: httpx.AsyncClient, demo: TenantHandle, globex: TenantHandle, clock: FakeClock
) -> None:
    first = await negotiate(client, demo, "train", key="k1", desired_workers=4, accept_workers={"min": 2, "max": 4})
    assert first["state"] == "offered" and first["round"] == 1
    (option,) = first["offer"]["options"]
    assert option["workers"] == 3 and "3 workers now" in option["reason"], "room for one more: 3, not 4"

    clock.advance(seconds=5)
    countered = await act(client, demo, first["id"], RoundAction.COUNTER, {"desired_workers": 3})
    assert countered.status_code == 200, countered.text
    second = countered.json()
    assert (second["state"], second["round"], second["terms"]["desired_workers"]) == ("offered", 2, 3)

    clock.advance(seconds=5)
    accepted = await act(client, demo, first["id"], RoundAction.ACCEPT, {"option": 0})
    assert accepted.status_code == 200, accepted.text
    final = accepted.json()
    assert final["state"] == "accepted" and final["accepted_option"]["workers"] == 3
    steps = [(r["round"], r["actor"], r["action"], r["option"]) for r in final["rounds"]]
    assert steps == [
        (1, "tenant", "request", None), (1, "provider", "offer", None),
        (2, "tenant", "counter", None), (2, "provider", "offer", None), (2, "tenant", "accept", 0),
    ]
    times = [r["at"] for r in final["rounds"]]
    assert times == sorted(times) and len(set(times)) == 3, "every step is timestamped (three moments here)"
    assert final["rounds"][0]["terms"]["accept_workers"] == {"min": 2, "max": 4}
    assert final["rounds"][3]["offer"]["options"][0]["workers"] == 3

    assert (await client.get(f"/v1/negotiations/{first['id']}", headers=demo.headers)).json() == final
    job = (await client.get("/v1/jobs/train", headers=demo.headers)).json()
    assert job["desired_workers"] == 3
    assert len((await client.get("/v1/jobs/train/allocations", headers=demo.headers)).json()) == 3
    assert await ledger_totals(app) == (3, 3, 3)

    for response in (
        await client.get(f"/v1/negotiations/{first['id']}", headers=globex.headers),
        await act(client, globex, first["id"], RoundAction.CANCEL),
    ):
        assert response.status_code == 404 and response.json()["reason"] == "negotiation not found"
    assert (await client.get("/v1/negotiations", headers=globex.headers)).json() == {"items": [], "next_cursor": None}

    events = [parse_event_as(row.payload, NegotiationUpdate) for row in await outbox(app, OutboxTopic.TENANT_EVENT)]
    assert [(e.data.state, e.data.round) for e in events] == [("offered", 1), ("offered", 2), ("accepted", 2)]
    assert {e.subject for e in events} == {"train"}
    rows = await outbox(app, OutboxTopic.TENANT_EVENT)
    assert {row.subject for row in rows} == {"hz.t.acme.events.negotiation.train"}
    assert [row.msg_id for row in rows] == [e.id for e in events]
    desired = [HostAssignment.model_validate_json(row.payload) for row in await outbox(app, OutboxTopic.DESIRED_STATE)]
    assert [(d.host, d.generation, d.jobs[0].workers) for d in desired] == [("h1", 1, 2), ("h1", 2, 3)]


async def test_idempotency_key_replays_refuses_reuse_and_settles_races(
    client: httpx.AsyncClient, demo: TenantHandle, globex: TenantHandle
) -> None:
    body = {"job": "train", "kind": "scale", "terms": {"desired_workers": 3}}
    headers = {**demo.headers, "Idempotency-Key": "same-key"}
    first = await client.post("/v1/negotiations", json=body, headers=headers)
    assert first.status_code == 201
    assert (await act(client, demo, first.json()["id"], RoundAction.CANCEL)).status_code == 200
    again = await client.post("/v1/negotiations", json=dict(reversed(list(body.items()))), headers=headers)
    assert (again.status_code, again.json()) == (201, first.json()), "replayed verbatim, though since cancelled"

    other = await client.post("/v1/negotiations", json={**body, "terms": {"desired_workers": 2}}, headers=headers)
    assert other.status_code == 422 and "Idempotency-Key" in other.json()["reason"]
    missing = await client.post("/v1/negotiations", json=body, headers=demo.headers)
    assert missing.status_code == 422 and "header.Idempotency-Key" in missing.json()["reason"]
    too_long = await client.post("/v1/negotiations", json=body, headers={**demo.headers, "Idempotency-Key": "k" * 201})
    assert too_long.status_code == 422

    await create_job(client, globex, "train")
    theirs = await client.post("/v1/negotiations", json=body, headers={**globex.headers, "Idempotency-Key": "same-key"})
    assert theirs.status_code == 201 and theirs.json()["id"] != first.json()["id"], "keys are per tenant"

    race = {**demo.headers, "Idempotency-Key": "raced"}
    responses = await asyncio.gather(*(client.post("/v1/negotiations", json=body, headers=race) for _ in range(8)))
    assert {response.status_code for response in responses} == {201}
    assert len({json.dumps(response.json(), sort_keys=True) for response in responses}) == 1
    listed = (await client.get("/v1/negotiations", headers=demo.headers)).json()["items"]
    assert len(listed) == 2, "one negotiation per key"


async def test_an_expired_offer_cannot_be_accepted(
    app: FastAPI, client: httpx.AsyncClient, demo: TenantHandle, clock: FakeClock
) -> None:
    offered = await negotiate(client, demo, "train", key="e1", desired_workers=3)
    swept = await negotiate(client, demo, "train", key="e2", desired_workers=3)
    assert offered["offer"]["expires_at"] == "2026-03-01T12:01:00Z", "60 s by default"
    clock.advance(seconds=59)
    assert (await client.get(f"/v1/negotiations/{offered['id']}", headers=demo.headers)).json()["state"] == "offered"
    clock.advance(seconds=1)

    refused = await act(client, demo, offered["id"], RoundAction.ACCEPT)
    assert refused.status_code == 409
    assert refused.json()["reason"] == "negotiation is expired: cannot accept"
    after = (await client.get(f"/v1/negotiations/{offered['id']}", headers=demo.headers)).json()
    assert after["state"] == "expired"
    assert (after["rounds"][-1]["actor"], after["rounds"][-1]["action"]) == ("provider", "expire")
    assert (await client.get("/v1/jobs/train", headers=demo.headers)).json()["desired_workers"] == 2
    assert await ledger_totals(app) == (2, 2, 2)

    assert await sweep_once(app.state.sessionmaker, now=clock()) == 1
    listed = (await client.get("/v1/negotiations", params={"state": "expired"}, headers=demo.headers)).json()
    assert {item["id"] for item in listed["items"]} == {offered["id"], swept["id"]}
    states = [NegotiationUpdate.model_validate(json.loads(row.payload)["data"]).state
              for row in await outbox(app, OutboxTopic.TENANT_EVENT)]
    assert states.count(NegotiationState.EXPIRED) == 2, "the tenant's feed hears of both expiries"


@pytest.mark.parametrize(("state", "action"), [(s, a) for s in NegotiationState for a in RoundAction])
def test_the_transition_table_refuses_everything_it_does_not_list(state: NegotiationState, action: RoundAction) -> None:
    if (state, action) in TRANSITIONS:
        assert state is NegotiationState.OFFERED
        return
    with pytest.raises(InvalidTransitionError, match=f"^negotiation is {state.value}: cannot {action.value}$"):
        next_status(state, action)
    assert next_status(Step.NEW, RoundAction.REQUEST) is Step.AWAITING_PROVIDER


async def test_every_refused_move_is_a_409_naming_the_current_state(
    client: httpx.AsyncClient, demo: TenantHandle, clock: FakeClock
) -> None:
    """One negotiation in each terminal state, then every tenant action the table does not allow from it."""
    ids: dict[NegotiationState, str] = {}
    for state, action in [
        (NegotiationState.ACCEPTED, RoundAction.ACCEPT),
        (NegotiationState.REJECTED, RoundAction.REJECT),
        (NegotiationState.CANCELLED, RoundAction.CANCEL),
    ]:
        created = await negotiate(client, demo, "train", key=state.value, desired_workers=2)
        assert (await act(client, demo, created["id"], action)).status_code == 200
        ids[state] = created["id"]
    declined = await negotiate(client, demo, "train", key="declined", desired_workers=9,
                               accept_workers={"min": 9, "max": 9})
    assert declined["state"] == "declined" and declined["offer"] is None
    assert "9" in declined["rounds"][-1]["note"]
    ids[NegotiationState.DECLINED] = declined["id"]
    ids[NegotiationState.EXPIRED] = (await negotiate(client, demo, "train", key="expired", desired_workers=2))["id"]
    clock.advance(minutes=5)

    checked = 0
    for state, negotiation in ids.items():
        for action in TENANT_ACTIONS:
            assert (state, action) not in TRANSITIONS
            response = await act(client, demo, negotiation, action)
            assert response.status_code == 409, (state, action, response.text)
            assert response.json()["reason"] == f"negotiation is {state.value}: cannot {action.value}"
            checked += 1
    assert checked == 20


async def test_acceptance_is_atomic_when_capacity_is_gone_and_rejects_bad_options(
    app: FastAPI, client: httpx.AsyncClient, demo: TenantHandle
) -> None:
    one = await negotiate(client, demo, "train", key="a", desired_workers=3)
    other = await negotiate(client, demo, "train", key="b", desired_workers=3)
    assert (await act(client, demo, one["id"], RoundAction.ACCEPT, {"option": 5})).status_code == 422
    assert (await act(client, demo, one["id"], RoundAction.ACCEPT, {"option": -1})).status_code == 422
    assert (await act(client, demo, one["id"], RoundAction.ACCEPT)).status_code == 200

    gone = await act(client, demo, other["id"], RoundAction.ACCEPT)
    assert gone.status_code == 200, "absolute target: the job already has 3 workers, nothing to add"
    assert gone.json()["state"] == "accepted"

    third = await negotiate(client, demo, "train", key="c", desired_workers=4, accept_workers={"min": 3, "max": 4})
    assert third["state"] == "declined" and "no room now" in third["rounds"][-1]["note"]
    await create_host(client, "h2", gpus=1, group="rack-b")
    fourth = await negotiate(client, demo, "train", key="d", desired_workers=4)
    squatter = await create_job(client, demo, "squatter")
    taken = await client.post("/v1/allocations", json={"tenant_id": "acme", "job_id": squatter["id"], "gpus": 1},
                              headers=ADMIN)
    assert taken.status_code == 201
    writes = len(await outbox(app, OutboxTopic.DESIRED_STATE))
    refused = await act(client, demo, fourth["id"], RoundAction.ACCEPT)
    assert refused.status_code == 409
    assert "capacity for this option is gone" in refused.json()["reason"] and "counter" in refused.json()["reason"]
    still = (await client.get(f"/v1/negotiations/{fourth['id']}", headers=demo.headers)).json()
    assert still["state"] == "offered" and still["rounds"][-1]["action"] == "offer", "nothing half-applied"
    assert (await client.get("/v1/jobs/train", headers=demo.headers)).json()["desired_workers"] == 3
    assert await ledger_totals(app) == (4, 4, 4)
    countered = await act(client, demo, fourth["id"], RoundAction.COUNTER, {"desired_workers": 4})
    assert countered.json()["state"] == "declined", "the tenant can still counter"
    after = [HostAssignment.model_validate_json(row.payload) for row in await outbox(app, OutboxTopic.DESIRED_STATE)]
    assert len(after) == writes + 1, "the refused accept wrote no desired state, the declined counter one"
    assert (after[-1].host, [job.job for job in after[-1].jobs], after[-1].standby) == ("h2", [squatter["id"]], ()), (
        "the offer's warm joiner on h2 is stopped when the counter is declined; only the squatter stays there"
    )


async def test_scale_down_repartition_and_a_later_start(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    await create_host(client, "a1", gpus=4, group="rack-a")
    await create_host(client, "b1", gpus=4, group="rack-b")
    await create_job(client, acme, "big", min_workers=1, max_workers=4, gpus_per_worker=2, initial_workers=3)
    placed = (await client.get("/v1/jobs/big/allocations", headers=acme.headers)).json()
    assert sorted(a["gpus"] for a in placed) == [2, 2, 2] and len({a["host"] for a in placed}) == 2

    plan = await negotiate(client, acme, "big", key="p", kind="repartition", parallel_plan="hsdp")
    assert (await act(client, acme, plan["id"], RoundAction.ACCEPT)).status_code == 200
    desired = [HostAssignment.model_validate_json(r.payload) for r in await outbox(app, OutboxTopic.DESIRED_STATE)]
    assert {d.host for d in desired[-2:]} == {"a1", "b1"}
    assert all(d.jobs[0].parallel_plan == "hsdp" for d in desired[-2:])

    down = await negotiate(client, acme, "big", key="down", desired_workers=1)
    assert (await act(client, acme, down["id"], RoundAction.ACCEPT)).status_code == 200
    assert (await client.get("/v1/jobs/big", headers=acme.headers)).json()["desired_workers"] == 1
    assert await ledger_totals(app) == (2, 2, 2)

    later = await negotiate(client, acme, "big", key="later", kind="defer", desired_workers=2,
                            constraints={"deadline": "2026-03-02T12:00:00Z"})
    (option,) = later["offer"]["options"]
    assert option["start_at"] is not None and option["expected_carbon_g_per_kwh"] < 332
    assert (await act(client, acme, later["id"], RoundAction.ACCEPT)).status_code == 200
    assert await ledger_totals(app) == (4, 4, 4), "reserved at acceptance"
    count = len(await outbox(app, OutboxTopic.DESIRED_STATE))
    latest = HostAssignment.model_validate_json((await outbox(app, OutboxTopic.DESIRED_STATE))[-1].payload)
    assert sum(job.workers for job in latest.jobs) <= 1, "the reserved worker is not announced before its start"
    assert await sweep_once(app.state.sessionmaker, now=clock()) == 0
    clock.now = datetime.fromisoformat(option["start_at"])
    assert await sweep_once(app.state.sessionmaker, now=clock()) == 1
    rows = await outbox(app, OutboxTopic.DESIRED_STATE)
    assert len(rows) == count + 1
    announced = HostAssignment.model_validate_json(rows[-1].payload)
    assert announced.jobs[0].workers >= 1 and announced.updated_at == clock()
    assert await sweep_once(app.state.sessionmaker, now=clock()) == 0, "announced once"


async def test_an_accept_on_a_host_announces_another_jobs_reservation_that_started_there(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, clock: FakeClock
) -> None:
    """An accept compares only its own job's placement (plus started reservations), not every job on the hosts it
    rewrites: a reservation of another job on such a host that has started since the host was last written must
    get its new epoch in that rewrite, since the sweeper then sees the host as written after the start."""
    await create_host(client, "a1", gpus=8, group="rack-a")
    await create_job(client, acme, "big", min_workers=1, max_workers=4, gpus_per_worker=2, initial_workers=1)
    await create_job(client, acme, "small", min_workers=1, max_workers=2, gpus_per_worker=2, initial_workers=1)
    later = await negotiate(client, acme, "big", key="later", kind="defer", desired_workers=2,
                            constraints={"deadline": "2026-03-02T12:00:00Z"})
    (option,) = later["offer"]["options"]
    assert option["start_at"] is not None
    assert (await act(client, acme, later["id"], RoundAction.ACCEPT)).status_code == 200

    def big_on_a1() -> Any:
        return next(job for job in written[-1].jobs if job.job == "big")

    written = [HostAssignment.model_validate_json(r.payload) for r in await outbox(app, OutboxTopic.DESIRED_STATE)]
    before = big_on_a1()
    assert before.workers == 1, "the reserved worker is not announced before its start"

    clock.now = datetime.fromisoformat(option["start_at"])  # started; the sweeper has not run
    grow = await negotiate(client, acme, "small", key="small", desired_workers=2)  # on a1 already: no warm joiner
    assert (await act(client, acme, grow["id"], RoundAction.ACCEPT)).status_code == 200
    written = [HostAssignment.model_validate_json(r.payload) for r in await outbox(app, OutboxTopic.DESIRED_STATE)]
    assert written[-1].host == "a1" and {job.job for job in written[-1].jobs} == {"big", "small"}
    after = big_on_a1()
    assert (after.workers, after.epoch) == (2, before.epoch + 1), "the started reservation joins big's next epoch"
    assert await sweep_once(app.state.sessionmaker, now=clock()) == 0, "nothing left for the sweeper to announce"


async def test_history_filters_and_cursor_pages(
    client: httpx.AsyncClient, demo: TenantHandle, clock: FakeClock
) -> None:
    await create_job(client, demo, "other")
    created = []
    for index in range(5):
        job = "train" if index % 2 == 0 else "other"
        created.append(await negotiate(client, demo, job, key=f"h{index}", desired_workers=1))
        clock.advance(seconds=1)
    newest_first = [n["id"] for n in reversed(created)]
    seen, cursor = [], None
    while True:
        params: dict[str, Any] = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = (await client.get("/v1/negotiations", params=params, headers=demo.headers)).json()
        seen += [item["id"] for item in page["items"]]
        assert "rounds" not in page["items"][0] and page["items"][0]["terms"]["desired_workers"] == 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == newest_first

    async def ids(**params: Any) -> list[str]:
        response = await client.get("/v1/negotiations", params=params, headers=demo.headers)
        assert response.status_code == 200, response.text
        return [item["id"] for item in response.json()["items"]]

    assert await ids(job="other") == [created[3]["id"], created[1]["id"]]
    assert await ids(kind="repartition") == []
    assert await ids(state="offered", kind="scale") == newest_first
    assert await ids(since="2026-03-01T12:00:02Z") == newest_first[:3]
    assert await ids(since="2026-03-01T12:00:02Z", until="2026-03-01T12:00:04Z") == newest_first[1:3]
    for bad in ({"cursor": "bm9wZQ"}, {"cursor": "%%%"}, {"limit": 0}, {"limit": 201},
                {"since": "2026-03-01T12:00:00"}, {"state": "pending"}):
        response = await client.get("/v1/negotiations", params=bad, headers=demo.headers)
        assert response.status_code == 422 and response.json()["reason"], bad


async def test_history_times_are_rfc3339_only_and_a_number_is_a_422_naming_the_field(
    client: httpx.AsyncClient, demo: TenantHandle
) -> None:
    for name in ("since", "until"):
        for bad in ("0.5", "1767225600", "2026-03-01", "2026-03-01T12:00:00"):
            response = await client.get("/v1/negotiations", params={name: bad}, headers=demo.headers)
            assert response.status_code == 422, (name, bad, response.text)
            assert field_names(response) == {f"query.{name}"} and f"query.{name}" in response.json()["reason"]
        fine = await client.get("/v1/negotiations", params={name: "2026-03-01T13:00:00+01:00"}, headers=demo.headers)
        assert fine.status_code == 200, fine.text
