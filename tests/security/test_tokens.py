"""API tokens: compared in constant time, revocable everywhere at once, and never a key to the wrong kind of route.

Storage as hashes is proven in tests/api/test_api_tenants.py (the database holds the SHA-256, never the token), and
"admin routes refuse tenant tokens" for every route in tests/api/test_api_scoping.py; this file adds what was
missing: a revoked token is refused on every tenant route (and on the admin and metrics routes), comparisons go
through `hmac.compare_digest`, and the scrape-only metrics token opens the metrics and nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from fastapi import FastAPI
from pydantic import SecretStr

from api.app import create_app
from harmonaize.settings import Settings
from tests.api.api_memory_broker import InMemoryBroker
from tests.api.api_testkit import ADMIN, ADMIN_TOKEN, TenantHandle, bearer, create_job, create_tenant
from tests.api.test_api_scoping import ID_ROUTE_BODIES, PUBLIC_ROUTES, TENANT_ROUTES

METRICS_TOKEN = "test-metrics-token-5f0c1e"
VALUES = {"job_id": "train", "negotiation_id": "00000000-0000-7000-8000-000000000000", "name": "ctl"}


def _routes(app: FastAPI) -> list[tuple[str, str]]:
    return sorted(
        (method.upper(), path) for path, operations in app.openapi()["paths"].items() for method in operations
    )


def _fill(path: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda match: VALUES.get(match.group(1), "x"), path)


def _body(method: str, path: str) -> dict[str, object] | None:
    if method not in ("POST", "PUT"):
        return None
    return ID_ROUTE_BODIES.get(path, {})


async def test_a_revoked_token_is_refused_on_every_route(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, globex: TenantHandle
) -> None:
    await create_job(client, acme, "train")
    assert (await client.get("/v1/jobs/train", headers=acme.headers)).status_code == 200
    assert (await client.delete("/v1/tenants/acme", headers=ADMIN)).status_code == 200

    routes = [route for route in _routes(app) if route not in PUBLIC_ROUTES]
    tenant_routes = [route for route in routes if route in TENANT_ROUTES]
    assert len(tenant_routes) == len(TENANT_ROUTES) >= 17, "every tenant route is walked"
    for method, path in routes:
        headers = {**acme.headers, "Idempotency-Key": "after-revocation"}
        response = await client.request(method, _fill(path), json=_body(method, path), headers=headers)
        assert response.status_code == 401, (method, path, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        if (method, path) in TENANT_ROUTES:
            assert response.json()["reason"] == "this tenant has been revoked", (method, path)
        assert "train" not in response.text
    assert (await client.get("/v1/jobs", headers=globex.headers)).status_code == 200, "others are unaffected"


async def test_tokens_and_digests_are_compared_in_constant_time(
    monkeypatch: pytest.MonkeyPatch, client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    """Every secret comparison goes through `hmac.compare_digest` (and a tenant token is compared as its hash)."""
    compared: list[tuple[bytes, bytes]] = []
    real: Callable[[bytes, bytes], bool] = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((bytes(a), bytes(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert (await client.get("/v1/tenant", headers=acme.headers)).status_code == 200
    digest = hashlib.sha256(acme.token.encode()).hexdigest().encode()
    assert (digest, digest) in compared, "the tenant token is checked by comparing its digest with compare_digest"

    compared.clear()
    assert (await client.get("/v1/tenants", headers=ADMIN)).status_code == 200
    assert (ADMIN_TOKEN.encode(), ADMIN_TOKEN.encode()) in compared

    compared.clear()
    tampered = acme.token[:-1] + ("A" if acme.token[-1] != "A" else "B")
    assert (await client.get("/v1/tenant", headers=bearer(tampered))).status_code == 401
    assert any(a != b for a, b in compared), "a wrong secret with a valid token id is still compared, not short-cut"


@pytest.fixture
async def metrics_client(migrated_settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    settings = migrated_settings.model_copy(update={"metrics_token": SecretStr(METRICS_TOKEN)})
    application = create_app(settings, broker=InMemoryBroker())
    async with application.router.lifespan_context(application):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://hz.test") as http:
            yield http


async def test_the_metrics_token_opens_the_metrics_and_nothing_else(metrics_client: httpx.AsyncClient) -> None:
    acme = await create_tenant(metrics_client, "acme")
    scraped = await metrics_client.get("/v1/metrics", headers=bearer(METRICS_TOKEN))
    assert scraped.status_code == 200 and "hz_tenants" in scraped.text
    for method, path in (("GET", "/v1/tenants"), ("POST", "/v1/hosts"), ("GET", "/v1/allocations")):
        refused = await metrics_client.request(method, path, headers=bearer(METRICS_TOKEN), json={})
        assert refused.status_code == 401, (method, path, refused.text)
    assert (await metrics_client.get("/v1/jobs", headers=bearer(METRICS_TOKEN))).status_code == 401
    assert (await metrics_client.get("/v1/metrics", headers=acme.headers)).status_code == 403
    assert (await metrics_client.get("/v1/metrics", headers=bearer(METRICS_TOKEN + "x"))).status_code == 401
    assert (await metrics_client.get("/v1/metrics", headers=ADMIN)).status_code == 200
