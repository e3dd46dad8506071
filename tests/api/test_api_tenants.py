"""Tenants, tokens and the broker: secrets shown once and stored hashed, admin-only routes, broker failures roll
back."""

from __future__ import annotations

import hashlib

import httpx
import nkeys
from fastapi import FastAPI
from sqlalchemy import text

from api.app import create_app
from api.db import make_engine
from harmonaize.settings import Settings
from tests.api.api_memory_broker import FailingBroker, InMemoryBroker
from tests.api.api_testkit import ADMIN, TenantHandle, bearer, create_tenant


async def _dump_tenant_rows(settings: Settings) -> str:
    engine = make_engine(settings.resolved_database_url, single_use=True)
    try:
        async with engine.connect() as connection:
            rows = (await connection.execute(text("SELECT * FROM tenants"))).all()
    finally:
        await engine.dispose()
    return repr(rows)


async def test_create_tenant_returns_secrets_once_and_applies_the_broker(
    client: httpx.AsyncClient, broker: InMemoryBroker
) -> None:
    acme = await create_tenant(client, "acme", display_name="Acme Corporation")
    assert acme.created["id"] == "acme" and acme.created["display_name"] == "Acme Corporation"
    assert acme.token.startswith("hzt_")
    nats = acme.created["nats"]
    assert nats["account"] == "T_acme" and nats["subject_prefix"] == "hz.t.acme."
    public_key = nkeys.from_seed(bytearray(acme.seed.encode())).public_key.decode()
    assert public_key == nats["user_public_key"] == acme.created["nats_user_public_key"]
    assert [account.tenant for account in broker.serving] == ["acme"]
    assert broker.serving[0].user_public_key == public_key

    fetched = (await client.get("/v1/tenants/acme", headers=ADMIN)).json()
    assert "api_token" not in fetched and "nats" not in fetched
    assert acme.token not in repr(fetched) and acme.seed not in repr(fetched)
    listed = (await client.get("/v1/tenants", headers=ADMIN)).json()
    assert [tenant["id"] for tenant in listed] == ["acme"]
    own = await client.get("/v1/tenant", headers=acme.headers)
    assert own.status_code == 200 and own.json()["id"] == "acme"


async def test_tokens_are_stored_only_as_hashes(
    client: httpx.AsyncClient, migrated_settings: Settings, acme: TenantHandle
) -> None:
    dump = await _dump_tenant_rows(migrated_settings)
    secret_part = acme.token.split("_", 2)[2]
    assert acme.token not in dump
    assert secret_part not in dump
    assert acme.seed not in dump
    assert hashlib.sha256(acme.token.encode()).hexdigest() in dump


async def test_duplicate_tenant_is_a_conflict(client: httpx.AsyncClient, acme: TenantHandle) -> None:
    again = await client.post("/v1/tenants", json={"id": "acme", "display_name": "Again"}, headers=ADMIN)
    assert again.status_code == 409
    assert "already exists" in again.json()["reason"]


async def test_unknown_tenant_is_404(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/tenants/nobody", headers=ADMIN)
    assert response.status_code == 404 and response.json()["reason"]


async def test_broker_failure_rolls_back_tenant_creation(migrated_settings: Settings) -> None:
    broker = FailingBroker(fail_after=1)
    app = create_app(migrated_settings, broker=broker)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://hz.test") as client:
            failed = await client.post("/v1/tenants", json={"id": "acme", "display_name": "Acme"}, headers=ADMIN)
            assert failed.status_code == 503
            reason = failed.json()["reason"]
            assert "broker" in reason and "not created" in reason
            assert (await client.get("/v1/tenants", headers=ADMIN)).json() == []
            assert (await client.get("/v1/tenants/acme", headers=ADMIN)).status_code == 404
            assert "acme" not in await _dump_tenant_rows(migrated_settings)

            broker.fail_after = 1_000
            retried = await client.post("/v1/tenants", json={"id": "acme", "display_name": "Acme"}, headers=ADMIN)
            assert retried.status_code == 201, retried.text
    assert [account.tenant for account in broker.serving] == ["acme"]


async def test_start_up_reconciles_the_broker_with_the_registry(
    client: httpx.AsyncClient, migrated_settings: Settings, acme: TenantHandle, globex: TenantHandle
) -> None:
    """A broker that lost its state (a fresh one here) serves every tenant again once the API starts."""
    fresh = InMemoryBroker()
    second: FastAPI = create_app(migrated_settings, broker=fresh)
    async with second.router.lifespan_context(second):
        assert [account.tenant for account in fresh.serving] == ["acme", "globex"]
        assert fresh.serving[0].user_public_key == acme.created["nats_user_public_key"]


async def test_revoked_tenant_gets_401_and_leaves_the_broker(
    client: httpx.AsyncClient, broker: InMemoryBroker, acme: TenantHandle, globex: TenantHandle
) -> None:
    assert (await client.get("/v1/tenant", headers=acme.headers)).status_code == 200
    revoked = await client.delete("/v1/tenants/acme", headers=ADMIN)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    refused = await client.get("/v1/jobs", headers=acme.headers)
    assert refused.status_code == 401
    assert "revoked" in refused.json()["reason"]
    assert refused.headers["www-authenticate"] == "Bearer"
    assert [account.tenant for account in broker.serving] == ["globex"]
    assert (await client.delete("/v1/tenants/acme", headers=ADMIN)).status_code == 409
    assert (await client.get("/v1/tenant", headers=globex.headers)).status_code == 200


async def test_bad_credentials_are_401(client: httpx.AsyncClient, acme: TenantHandle) -> None:
    tampered = acme.token[:-4] + ("AAAA" if not acme.token.endswith("AAAA") else "BBBB")
    for headers in ({}, bearer("nonsense"), bearer(tampered), {"Authorization": f"Basic {acme.token}"}):
        response = await client.get("/v1/tenant", headers=headers)
        assert response.status_code == 401, (headers, response.text)
        assert response.json()["reason"]


async def test_admin_token_is_not_a_tenant_token(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/jobs", headers=ADMIN)
    assert response.status_code == 403
    assert "tenant" in response.json()["reason"]
