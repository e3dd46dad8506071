"""Helpers for the negotiation tests: open and answer negotiations over HTTP, read the outbox and the ledger."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import FastAPI
from sqlalchemy import bindparam, func, select, text

from api.models import Allocation, Host, Job, OutboxMessage, OutboxTopic
from harmonaize.negotiation import RoundAction
from tests.api.api_testkit import TenantHandle

ACTION_BODIES: dict[RoundAction, dict[str, Any]] = {
    RoundAction.ACCEPT: {"option": 0},
    RoundAction.COUNTER: {"desired_workers": 3},
    RoundAction.REJECT: {"reason": "too late"},
    RoundAction.CANCEL: {},
}
"""A valid body for each tenant action."""


async def negotiate(
    client: httpx.AsyncClient, tenant: TenantHandle, job: str, *, key: str, kind: str = "scale", **terms: Any
) -> dict[str, Any]:
    """Open a negotiation (asserting 201) and return the provider's answer."""
    response = await client.post(
        "/v1/negotiations",
        json={"job": job, "kind": kind, "terms": terms},
        headers={**tenant.headers, "Idempotency-Key": key},
    )
    assert response.status_code == 201, response.text
    return response.json()


async def act(
    client: httpx.AsyncClient, tenant: TenantHandle, negotiation: str, action: RoundAction, body: Any = None
) -> httpx.Response:
    """POST a tenant action (with a default valid body)."""
    payload = ACTION_BODIES[action] if body is None else body
    return await client.post(f"/v1/negotiations/{negotiation}/{action.value}", json=payload, headers=tenant.headers)


async def outbox(app: FastAPI, topic: OutboxTopic | None = None) -> list[OutboxMessage]:
    """Outbox rows in delivery order (one topic, or all)."""
    async with app.state.sessionmaker() as session:
        query = select(OutboxMessage).order_by(OutboxMessage.id)
        if topic is not None:
            query = query.where(OutboxMessage.topic == topic)
        return list(await session.scalars(query))


async def ledger_totals(app: FastAPI) -> tuple[int, int, int]:
    """(hosts' allocated GPUs, live allocation rows' GPUs, jobs' allocated GPUs): always equal."""
    async with app.state.sessionmaker() as session:
        hosts = await session.scalar(select(func.coalesce(func.sum(Host.allocated_gpus), 0)))
        rows = await session.scalar(
            select(func.coalesce(func.sum(Allocation.gpus), 0)).where(Allocation.released_at.is_(None))
        )
        jobs = await session.scalar(select(func.coalesce(func.sum(Job.allocated_gpus), 0)))
    return int(hosts or 0), int(rows or 0), int(jobs or 0)


ADVISORY = ("advisory",)
"""`waiting`: the ledger's advisory lock (`api.services.ledger_lock`)."""
ROW = ("transactionid", "tuple")
"""`waiting`: another transaction's row."""
_WAITING = text(
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
    " AND wait_event_type = 'Lock' AND wait_event IN :events"
).bindparams(bindparam("events", expanding=True))


async def waiting(app: FastAPI, events: tuple[str, ...], *, at_least: int) -> bool:
    """Whether `at_least` transactions of this PostgreSQL database wait for a lock of these kinds."""
    async with app.state.sessionmaker() as session:
        waiters = await session.scalar(_WAITING, {"events": list(events)})
    return (waiters or 0) >= at_least
