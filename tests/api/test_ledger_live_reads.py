"""The ledger's reads reach the live allocations without walking the released ones.

Released allocations are kept (history, audit), so a host or job that has been busy for a while holds far more
released rows than live ones; a negotiation that visited them all would slow down with the age of the cloud. This
guard asks SQLite for the plan of every statement that touches `allocations` during the negotiation write paths
(open, accept that grows, accept that shrinks, counter, reject), after the host has built up a history of released
allocations, and requires each to reach the table by a seek on the release time (or by primary key), never by the
host or job alone, and never by a scan. Plans without statistics (the app never runs ANALYZE) are what a cloud runs.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import event

from tests.api.api_testkit import TenantHandle, create_host, create_job

pytestmark = pytest.mark.parametrize("backend", ["sqlite"])

ENTRYPOINT = ["-m", "workloads.examples.mlp"]
HISTORY_CYCLES = 12
"""Grow-and-shrink cycles before the statements are planned: released rows exist on the host and for the job."""


@contextmanager
def allocation_statements(app: FastAPI) -> Iterator[list[tuple[str, Any]]]:
    """Every statement (with its DB-API parameters) that mentions the allocations table while the block runs."""
    engine = app.state.engine.sync_engine
    seen: list[tuple[str, Any]] = []

    def on_execute(_conn: Any, _cursor: Any, statement: str, parameters: Any, _context: Any, many: bool) -> None:
        if "allocations" in statement:
            seen.append((statement, parameters[0] if many else parameters))

    event.listen(engine, "before_cursor_execute", on_execute)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", on_execute)


def _allocation_steps(database: str, statement: str, parameters: Any) -> list[str]:
    """SQLite's plan steps for `statement` that read the allocations table."""
    with closing(sqlite3.connect(database)) as connection:
        plan = connection.execute(f"EXPLAIN QUERY PLAN {statement}", parameters).fetchall()
    return [str(row[3]) for row in plan if " allocations " in f" {row[3]} "]


def _walks_history(step: str) -> bool:
    """A plan step that can visit released rows: a scan, or a seek constrained by neither release time nor id.

    A seek reads `SEARCH allocations USING INDEX <name> (<constraints>)[ LEFT-JOIN]`: only the constraints count,
    not the index's name.
    """
    seek = re.fullmatch(r"SEARCH allocations USING (?:COVERING )?INDEX \S+ \(([^()]*)\)( LEFT-JOIN)?", step)
    if seek is None:
        return True
    constraints = seek.group(1).split(" AND ")
    return not any(term.startswith("released_at") or term == "id=?" for term in constraints)


async def _negotiate(
    client: httpx.AsyncClient, tenant: TenantHandle, key: str, workers: int, *, accept: bool
) -> dict[str, Any]:
    body = {"job": "train", "kind": "scale",
            "terms": {"desired_workers": workers, "accept_workers": {"min": 1, "max": workers}}}
    opened = await client.post("/v1/negotiations", json=body, headers={**tenant.headers, "Idempotency-Key": key})
    assert opened.status_code == 201 and opened.json()["state"] == "offered", opened.text
    if not accept:
        return dict(opened.json())
    accepted = await client.post(
        f"/v1/negotiations/{opened.json()['id']}/accept", json={"option": 0}, headers=tenant.headers
    )
    assert accepted.status_code == 200, accepted.text
    return dict(accepted.json())


async def test_negotiation_writes_never_walk_released_allocations(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    await create_host(client, "h1", gpus=4, group="rack-a")
    await create_job(client, acme, "train", max_workers=2, initial_workers=1, entrypoint=ENTRYPOINT)
    for cycle in range(HISTORY_CYCLES):
        await _negotiate(client, acme, f"grow-{cycle}", 2, accept=True)
        await _negotiate(client, acme, f"shrink-{cycle}", 1, accept=True)

    with allocation_statements(app) as statements:
        await _negotiate(client, acme, "grow", 2, accept=True)
        await _negotiate(client, acme, "shrink", 1, accept=True)
        offered = await _negotiate(client, acme, "counter-me", 2, accept=False)
        path = f"/v1/negotiations/{offered['id']}"
        countered = await client.post(f"{path}/counter", json={"desired_workers": 2}, headers=acme.headers)
        assert countered.status_code == 200, countered.text
        rejected = await client.post(f"{path}/reject", json={"reason": "later"}, headers=acme.headers)
        assert rejected.status_code == 200, rejected.text

    database = app.state.engine.url.database
    with closing(sqlite3.connect(database)) as connection:
        released = connection.execute(
            "SELECT count(*) FROM allocations WHERE host_id = 'h1' AND released_at IS NOT NULL"
        ).fetchone()[0]
    assert released >= HISTORY_CYCLES, "the host should have a history of released allocations"
    assert len(statements) >= 8, f"the write paths read the allocations: {statements}"
    plans = {
        " ".join(statement.split())[:200]: _allocation_steps(database, statement, parameters)
        for statement, parameters in statements
    }
    walking = {statement: steps for statement, steps in plans.items() if any(map(_walks_history, steps))}
    assert not walking, f"statements whose plan can visit released allocations: {walking}"
