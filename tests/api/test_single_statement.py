"""A new negotiation without BEGIN and COMMIT on PostgreSQL, and in a transaction where it needs one.

Single-statement mode (`api.single_statement`) lets a use case whose one write is its commit's statement skip the
transaction's two round trips. Here, on real PostgreSQL: an offer that only writes its own rows sends no BEGIN, and
is stored whole (negotiation, both rounds, key, event) and replayed by its key; an offer that starts warm joiners,
which lock the ledger and rewrite a host, is made again in a transaction and stored once. Then the guards, one by
one: a data-changing statement, a flush, the ledger's lock, an early write of the queue and a commit of more than one
statement each raise `NeedsTransaction` before the database sees them, and leave nothing written; a commit of one
statement writes it. SQLite has no such mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import Table, event, func, select, update

from api.commit_inserts import MAX_CHAIN, queue_insert, write_queued
from api.db import make_engine, make_sessionmaker
from api.models import IdempotencyKey, Job, Negotiation, NegotiationRound, OutboxMessage, OutboxTopic, Tenant
from api.models_standby import StandbyNode
from api.services.ledger_lock import lock_ledger
from api.single_statement import NeedsTransaction, begin_single_statement, in_single_statement
from tests.api.api_testkit import TenantHandle
from tests.api.negotiation_kit import negotiate, outbox
from tests.api.test_negotiation_standby import standing_by, two_host_job, writes


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest) -> str:
    """PostgreSQL only: the mode exists there alone (SQLite's is checked below without the app)."""
    return str(request.param)


@contextmanager
def transactions(app: FastAPI) -> Iterator[list[str]]:
    """BEGINs the app's engine sends (a connection in autocommit sends none) while the block runs."""
    begun: list[str] = []

    def on_begin(conn: Any) -> None:
        if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
            begun.append("BEGIN")

    engine = app.state.engine.sync_engine
    event.listen(engine, "begin", on_begin)
    try:
        yield begun
    finally:
        event.remove(engine, "begin", on_begin)


async def _count(app: FastAPI, model: Any, *where: Any) -> int:
    async with app.state.sessionmaker() as session:
        return int(await session.scalar(select(func.count()).select_from(model).where(*where)) or 0)


async def test_an_offer_writing_only_its_rows_sends_no_transaction_and_one_warming_joiners_is_made_in_one(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    await two_host_job(client, acme)
    events = len(await outbox(app, OutboxTopic.TENANT_EVENT))
    with transactions(app) as begun:
        shrink = await negotiate(client, acme, "train", key="shrink", desired_workers=1)
    assert shrink["state"] == "offered" and begun == [], "its reads and its one write, each its own transaction"
    assert [step["action"] for step in shrink["rounds"]] == ["request", "offer"]
    assert await _count(app, NegotiationRound, NegotiationRound.negotiation_id == shrink["id"]) == 2
    assert await _count(app, IdempotencyKey, IdempotencyKey.key == "shrink") == 1
    assert len(await outbox(app, OutboxTopic.TENANT_EVENT)) == events + 1, "the tenant's event, written with it"
    with transactions(app) as begun:
        again = await client.post(
            "/v1/negotiations", json={"job": "train", "kind": "scale", "terms": {"desired_workers": 1}},
            headers={**acme.headers, "Idempotency-Key": "shrink"},
        )
    assert again.status_code == 201 and again.json() == shrink and begun == [], "a replay reads one row, no ROLLBACK"

    before = len(await writes(app))
    with transactions(app) as begun:
        grow = await negotiate(client, acme, "train", key="grow", desired_workers=4)
    assert grow["state"] == "offered" and begun == ["BEGIN"], "its warm joiner locks the ledger: a transaction"
    assert [(a.host, standing_by(a)) for a in (await writes(app))[before:]] == [("h3", [("train", 2, 2)])]
    assert await _count(app, StandbyNode, StandbyNode.negotiation_id == grow["id"]) == 1
    assert await _count(app, Negotiation, Negotiation.job_id == "train") == 2, "made again, stored once"
    assert await _count(app, NegotiationRound, NegotiationRound.negotiation_id == grow["id"]) == 2
    assert len(await outbox(app, OutboxTopic.TENANT_EVENT)) == events + 2


def _desired_state_row(n: int) -> dict[str, Any]:
    from datetime import UTC, datetime

    return {"topic": OutboxTopic.DESIRED_STATE, "subject": f"single-statement-{n}", "payload": b"{}",
            "msg_id": f"single-statement-{n}", "created_at": datetime.now(UTC), "attempts": 0}


async def _outbox_rows(app: FastAPI) -> int:
    return await _count(app, OutboxMessage, OutboxMessage.subject.like("single-statement-%"))


async def test_whatever_needs_the_transaction_raises_before_the_database_sees_it(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    await two_host_job(client, acme)
    outbox_table = cast("Table", OutboxMessage.__table__)
    async with app.state.sessionmaker() as session:
        assert await begin_single_statement(session) and in_single_statement(session)
        job = await session.scalar(select(Job).where(Job.id == "train"))
        assert job is not None, "reads run"
        with pytest.raises(NeedsTransaction, match="update"):
            await session.execute(update(Job).where(Job.id == "train").values(desired_workers=3))
        await session.rollback()
        assert not in_single_statement(session), "the mode ends with its transaction"

        assert await begin_single_statement(session)
        session.add(Tenant(id="other", display_name="Other", token_id="t" * 32, token_hash="x" * 64,
                           nats_user_public_key="U" * 56))
        with pytest.raises(NeedsTransaction, match="flush"):
            await session.flush()
        await session.rollback()

        assert await begin_single_statement(session)
        with pytest.raises(NeedsTransaction, match="ledger"):
            await lock_ledger(session)
        queue_insert(session, outbox_table, _desired_state_row(0))
        with pytest.raises(NeedsTransaction, match="before the commit"):
            await write_queued(session)
        await session.rollback()

        assert await begin_single_statement(session)
        for n in range(MAX_CHAIN + 1):  # more than one statement's worth: an executemany
            queue_insert(session, outbox_table, _desired_state_row(n))
        with pytest.raises(NeedsTransaction, match="more than one statement"):
            await session.commit()
        await session.rollback()
    assert await _count(app, Job, Job.desired_workers == 3) == 0
    assert await _count(app, Tenant, Tenant.id == "other") == 0
    assert await _outbox_rows(app) == 0, "nothing of those reached the database"

    with transactions(app) as begun:
        async with app.state.sessionmaker() as session:
            assert await begin_single_statement(session)
            queue_insert(session, outbox_table, _desired_state_row(1))
            await session.commit()
    assert begun == [] and await _outbox_rows(app) == 1, "one statement: written, without BEGIN"

    async with app.state.sessionmaker() as session:
        await session.scalar(select(Job.id).limit(1))
        assert not await begin_single_statement(session), "a transaction already begun stays one"
        await session.rollback()


async def test_sqlite_has_no_single_statement_mode(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite+aiosqlite:///{tmp_path / 'single.db'}")
    try:
        async with make_sessionmaker(engine)() as session:
            assert not await begin_single_statement(session) and not in_single_statement(session)
    finally:
        await engine.dispose()
