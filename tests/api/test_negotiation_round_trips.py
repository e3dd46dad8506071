"""Database round trips per negotiation request, on SQLite and PostgreSQL: a deterministic guard on throughput.

Each SQL statement the API sends is one round trip to the database (on PostgreSQL a network hop, on SQLite a call
into the driver's thread), so the count per request bounds the negotiation throughput (`bench/bench_negotiations.py`)
far more steadily than a timed test could. Counted with SQLAlchemy's `before_cursor_execute` on the app's engine,
plus one for each BEGIN / COMMIT / ROLLBACK (`begin`, `commit`, `rollback` events, except on an autocommit
connection, which sends none), which are round trips too.

The operations are the ones the benchmark times: a new negotiation (request -> an offer to grow the job), the same
POST replayed (same key), an accept that grows the job (places a worker) and one that shrinks it (releases one); and
a counter (answered with a new offer) and a reject. Then a grow that needs a host the job does not run on: its offer
starts a warm joiner there (`api.services.standby`), so it writes in a transaction after all, holding the whole
ledger (on PostgreSQL its single-statement try is redone: open 2 -> 11), and its accept drops the joiner's row and
rewrites both hosts (accept 13 -> 15). A provider's 8-GPU hosts under jobs of 8 GPUs a worker make every grow one of
these; `bench/bench_negotiations.py`'s jobs (1 GPU a worker, grown on the host they run on) make none.
Counted as the API runs under load: the tenant's token verified moments ago (`api.services.token_cache`) and, on
PostgreSQL, the request's connection used moments ago, so not pinged (`api.db`); both windows are stretched here so
that a slow machine cannot turn "moments ago" into "idle" between two requests. Not counted: the negotiation pace's
token bucket on PostgreSQL (`api.shared_buckets`), which has an engine of its own.
The limits are the counts as they are: a change that adds a statement to one of these paths fails here, and must
either remove one elsewhere or raise the limit on purpose. `HZ_TEST_PRINT_SQL=1` prints each operation's statements
(run with `-s`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import event

from harmonaize.settings import Settings
from tests.api.api_testkit import TenantHandle, create_host, create_job

ENTRYPOINT = ["-m", "workloads.examples.mlp"]

LIMITS: dict[str, dict[str, int]] = {
    "sqlite": {"open": 7, "replay": 3, "accept_grow": 14, "accept_shrink": 14, "counter": 7, "reject": 6,
               "open_warm": 13, "accept_warm": 16},
    "postgresql": {"open": 2, "replay": 1, "accept_grow": 10, "accept_shrink": 10, "counter": 6, "reject": 5,
                   "open_warm": 13, "accept_warm": 13},
}
"""Round trips per operation and dialect, at most (before issue 20, in this order: 16 / 4 / 29 / 28 / 19 / 10 on
SQLite, 18 / 5 / 31 / 30 / 22 / 12 on PostgreSQL, which then pinged the connection and read the token every time;
PostgreSQL takes the ledger's advisory lock in an accept, and writes the rows a transaction only inserts in fewer
statements, `api.commit_inserts`, and pairs of ledger writes as one statement, `api.services.ledger_rows` and
`host_assignments`). An accept on PostgreSQL reads its job a second time once it holds that lock, so that its first
read, its state change and its round can come before the lock; the state change's own statement takes it, once its
row is written (`ledger_lock.lock_in_next_statement`: grow 12 -> 11, shrink 12 -> 11). An accept that resizes the
job reads it again with the update of its counters (`ledger.change_job_workers_reading`), so that costs no statement
of its own, and a grow's update reads the hosts its placement starts from too (`ledger_hosts.snapshot_column`: grow
11 -> 10, warm 14 -> 13), a shrink's the allocations it releases (11 -> 10). Its lock is shared with accepts on
other hosts, and its hosts' rows are locked before they are written (`api.services.ledger_lock`): a grow's in one
statement of their own (one round trip more, for accepts on different hosts no longer waiting for each other),
unless its one host is the one its grant's update writes, which then takes that lock itself
(`ledger_lock.lock_left_to_update`: grow 13 -> 12); a shrink's by the update of its job's counters.
A new request on PostgreSQL sends no BEGIN or COMMIT (`api.single_statement`): its read and its commit's one
statement, each a transaction of its own; that read has the hosts too (`ledger_hosts.snapshot_column`): open 5 -> 2
and replay 3 -> 1 on PostgreSQL, open 8 -> 7 on SQLite."""


@pytest.fixture
async def migrated_settings(migrated_settings: Settings) -> Settings:
    """The backend's settings with the token cache's and the idle ping's windows longer than the test."""
    return migrated_settings.model_copy(update={"api_token_cache_s": 3600.0, "database_ping_after_idle_s": 3600.0})


@contextmanager
def counting(app: FastAPI) -> Iterator[list[str]]:
    """Every statement (and BEGIN / COMMIT / ROLLBACK) the app's engine sends while the block runs."""
    engine = app.state.engine.sync_engine
    statements: list[str] = []

    def on_execute(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement != "BEGIN":  # SQLite's explicit BEGIN (api.db): counted once, by the `begin` event
            statements.append(" ".join(statement.split())[:160])

    def on_transaction(name: str) -> Any:
        def listener(conn: Any) -> None:
            if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":  # those send nothing
                statements.append(name)

        return listener

    listeners = {
        "before_cursor_execute": on_execute,
        "begin": on_transaction("BEGIN"),
        "commit": on_transaction("COMMIT"),
        "rollback": on_transaction("ROLLBACK"),
    }
    dialect = engine.dialect
    ping = dialect.do_ping

    def counted_ping(dbapi_connection: Any) -> bool:  # the pool's pre-ping on checkout (PostgreSQL: api.db)
        statements.append("(pre-ping)")
        return bool(ping(dbapi_connection))

    for name, listener in listeners.items():
        event.listen(engine, name, listener)
    dialect.do_ping = counted_ping
    try:
        yield statements
    finally:
        dialect.do_ping = ping
        for name, listener in listeners.items():
            event.remove(engine, name, listener)


async def test_round_trips_per_negotiation_request(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    await create_host(client, "h1", gpus=2, group="rack-a")
    await create_host(client, "h2", gpus=2, group="rack-a")
    await create_job(client, acme, "train", max_workers=2, initial_workers=1, entrypoint=ENTRYPOINT)
    await create_job(client, acme, "warm-up", max_workers=2, initial_workers=1, entrypoint=ENTRYPOINT)
    # one request first, so that nothing a first request does once per process (the tenant's first lookup, a
    # connection opening) is counted
    terms = {"desired_workers": 2, "accept_workers": {"min": 1, "max": 2}}
    body: dict[str, Any] = {"job": "warm-up", "kind": "scale", "terms": terms}
    warm = await client.post("/v1/negotiations", json=body, headers={**acme.headers, "Idempotency-Key": "warm"})
    assert warm.status_code == 201, warm.text

    counts: dict[str, int] = {}
    printed: dict[str, list[str]] = {}

    async def measure(name: str, method: str, url: str, payload: Any, *, key: str | None, status: int) -> Any:
        headers = acme.headers if key is None else {**acme.headers, "Idempotency-Key": key}
        with counting(app) as statements:
            response = await client.request(method, url, json=payload, headers=headers)
        assert response.status_code == status, response.text
        counts[name] = len(statements)
        printed[name] = statements
        return response.json()

    grow = {"job": "train", "kind": "scale", "terms": terms}
    opened = await measure("open", "POST", "/v1/negotiations", grow, key="grow", status=201)
    assert opened["state"] == "offered", opened
    replayed = await measure("replay", "POST", "/v1/negotiations", grow, key="grow", status=201)
    assert replayed == opened
    await measure("accept_grow", "POST", f"/v1/negotiations/{opened['id']}/accept", {"option": 0}, key=None, status=200)
    shrink = {"job": "train", "kind": "scale", "terms": {"desired_workers": 1, "accept_workers": {"min": 1, "max": 1}}}
    down = await client.post("/v1/negotiations", json=shrink, headers={**acme.headers, "Idempotency-Key": "shrink"})
    assert down.status_code == 201 and down.json()["state"] == "offered", down.text
    accepted = await measure(
        "accept_shrink", "POST", f"/v1/negotiations/{down.json()['id']}/accept", {"option": 0}, key=None, status=200
    )
    assert accepted["state"] == "accepted"
    again = await client.post("/v1/negotiations", json=grow, headers={**acme.headers, "Idempotency-Key": "again"})
    assert again.status_code == 201 and again.json()["state"] == "offered", again.text
    answered = f"/v1/negotiations/{again.json()['id']}"
    countered = await measure("counter", "POST", f"{answered}/counter", {"desired_workers": 2}, key=None, status=200)
    assert countered["state"] == "offered" and len(countered["rounds"]) == 4, countered
    rejected = await measure("reject", "POST", f"{answered}/reject", {"reason": "later"}, key=None, status=200)
    assert [step["action"] for step in rejected["rounds"]] == ["request", "offer", "counter", "offer", "reject"]

    # A grow onto a host the job does not run on: the offer starts a warm joiner there (`api.services.standby`),
    # rewriting that host's assignment under the whole ledger's lock; the accept places the worker on it.
    await create_host(client, "h3", gpus=2, group="rack-b")
    await create_host(client, "h4", gpus=2, group="rack-b")
    await create_job(client, acme, "wide", max_workers=2, initial_workers=1, gpus_per_worker=2, entrypoint=ENTRYPOINT)
    wide = {"job": "wide", "kind": "scale", "terms": terms}
    warm_offer = await measure("open_warm", "POST", "/v1/negotiations", wide, key="wide", status=201)
    assert any("INSERT INTO standby_nodes" in statement for statement in printed["open_warm"]), printed["open_warm"]
    await measure("accept_warm", "POST", f"/v1/negotiations/{warm_offer['id']}/accept", {"option": 0}, key=None,
                  status=200)

    dialect = app.state.engine.dialect.name
    if os.environ.get("HZ_TEST_PRINT_SQL"):
        for name, statements in printed.items():
            print(f"\n== {dialect} {name}: {len(statements)}")
            for statement in statements:
                print("  ", statement)
    over = {name: (count, LIMITS[dialect][name]) for name, count in counts.items() if count > LIMITS[dialect][name]}
    assert not over, f"more round trips than allowed on {dialect} (count, limit): {over}; all: {counts}"
