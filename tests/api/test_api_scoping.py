"""Tenant scoping and the provider's privacy: walk every route of the app as the wrong caller.

Routes are discovered from the app itself (its OpenAPI document), so a route added later is covered automatically:
unless it is listed below as a tenant route, it must refuse tenant tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from tests.api.api_testkit import ADMIN, TenantHandle, create_host, create_job, job_body

TENANT_ROUTES = {
    ("GET", "/v1/tenant"),
    ("GET", "/v1/capacity"),
    ("POST", "/v1/jobs"),
    ("GET", "/v1/jobs"),
    ("GET", "/v1/jobs/{job_id}"),
    ("GET", "/v1/jobs/{job_id}/allocations"),
    ("GET", "/v1/jobs/{job_id}/status"),
    ("GET", "/v1/jobs/{job_id}/timeline"),
    ("GET", "/v1/jobs/{job_id}/directives"),
    ("GET", "/v1/jobs/{job_id}/progress"),
    ("PUT", "/v1/event-consumers/{name}"),
    ("POST", "/v1/negotiations"),
    ("GET", "/v1/negotiations"),
    ("GET", "/v1/negotiations/{negotiation_id}"),
    ("POST", "/v1/negotiations/{negotiation_id}/accept"),
    ("POST", "/v1/negotiations/{negotiation_id}/counter"),
    ("POST", "/v1/negotiations/{negotiation_id}/reject"),
    ("POST", "/v1/negotiations/{negotiation_id}/cancel"),
}
ID_ROUTE_BODIES: dict[str, dict[str, object]] = {
    "/v1/negotiations/{negotiation_id}/accept": {"option": 0},
    "/v1/negotiations/{negotiation_id}/counter": {"desired_workers": 2},
}
"""Valid bodies for tenant id routes that need one, so the request reaches the lookup (a 422 would hide a leak)."""
NEVER_EXISTED = {"job_id": "no-such-job", "negotiation_id": "00000000-0000-7000-8000-000000000000"}
OWN_NAMESPACE_ROUTES = {("PUT", "/v1/event-consumers/{name}")}
"""Tenant routes whose path names something in the caller's own namespace (a consumer on the caller's own stream), so
there is no other tenant's object to probe: the same name used by two tenants names two different consumers."""
PUBLIC_ROUTES = {("GET", "/v1/healthz")}
HOSTS = [("gpu-node-017", 4, "rack-a"), ("gpu-node-018", 4, "rack-b")]
PROVIDER_NAMES = ["gpu-node-017", "gpu-node-018", "rack-a", "rack-b"]


@dataclass(frozen=True)
class World:
    acme: TenantHandle
    globex: TenantHandle
    globex_job: str
    globex_allocation: str
    globex_negotiation: str


def _routes(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every /v1 operation, read from the app's OpenAPI document (FastAPI's public view of its
    routes; only the live event stream is left out of it, and tests/console checks its scoping)."""
    return sorted(
        (method.upper(), path)
        for path, operations in app.openapi()["paths"].items()
        if path.startswith("/v1/")
        for method in operations
    )


def _fill(path: str, values: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)\}", lambda match: values[match.group(1)], path)


@pytest.fixture
async def world(client: httpx.AsyncClient, acme: TenantHandle, globex: TenantHandle) -> World:
    for host_id, gpus, group in HOSTS:
        await create_host(client, host_id, gpus=gpus, group=group)
    await create_job(client, acme, "acme-train")
    await create_job(client, globex, "globex-train")
    for tenant, job in (("acme", "acme-train"), ("globex", "globex-train")):
        response = await client.post(
            "/v1/allocations",
            json={"tenant_id": tenant, "job_id": job, "gpus": 2, "host_id": "gpu-node-017"},
            headers=ADMIN,
        )
        assert response.status_code == 201, response.text
        if tenant == "globex":
            globex_allocation = response.json()["id"]
    negotiation = await client.post(
        "/v1/negotiations",
        json={"job": "globex-train", "kind": "scale", "terms": {"desired_workers": 3}},
        headers={**globex.headers, "Idempotency-Key": "globex-1"},
    )
    assert negotiation.status_code == 201, negotiation.text
    assert negotiation.json()["state"] == "offered"
    return World(
        acme=acme,
        globex=globex,
        globex_job="globex-train",
        globex_allocation=globex_allocation,
        globex_negotiation=negotiation.json()["id"],
    )


def _globex_secrets(world: World) -> list[str]:
    return [
        "globex",
        "Globex Secret Projects",
        world.globex.token,
        world.globex.created["nats_user_public_key"],
        world.globex_allocation,
        world.globex_negotiation,
        *PROVIDER_NAMES,
    ]


async def test_every_route_is_classified(app: FastAPI) -> None:
    routes = set(_routes(app))
    assert TENANT_ROUTES <= routes
    assert PUBLIC_ROUTES <= routes
    assert len(routes - TENANT_ROUTES - PUBLIC_ROUTES) >= 8, "admin routes missing?"


async def test_admin_routes_refuse_tenant_tokens_and_anonymous_callers(
    app: FastAPI, client: httpx.AsyncClient, world: World
) -> None:
    values = {
        "tenant_id": "acme",
        "job_id": "acme-train",
        "allocation_id": world.globex_allocation,
        "host_id": "gpu-node-017",
    }
    admin_routes = [route for route in _routes(app) if route not in TENANT_ROUTES | PUBLIC_ROUTES]
    for method, path in admin_routes:
        url = _fill(path, values)
        body: dict[str, Any] | None = {} if method in ("POST", "PUT") else None
        as_tenant = await client.request(method, url, json=body, headers=world.acme.headers)
        assert as_tenant.status_code == 403, (method, path, as_tenant.text)
        assert "admin" in as_tenant.json()["reason"]
        anonymous = await client.request(method, url, json=body)
        assert anonymous.status_code == 401, (method, path, anonymous.text)
        assert anonymous.json()["reason"]
    assert (await client.get("/v1/tenants/acme", headers=ADMIN)).json()["revoked_at"] is None


async def test_tenant_routes_answer_404_for_another_tenants_ids(
    app: FastAPI, client: httpx.AsyncClient, world: World
) -> None:
    globex_values = {"job_id": world.globex_job, "negotiation_id": world.globex_negotiation}
    id_routes = [
        (method, path)
        for method, path in _routes(app)
        if (method, path) in TENANT_ROUTES - OWN_NAMESPACE_ROUTES and "{" in path
    ]
    assert len(id_routes) >= 7
    for method, path in id_routes:
        body = ID_ROUTE_BODIES.get(path)
        url = _fill(path, globex_values)
        response = await client.request(method, url, json=body, headers=world.acme.headers)
        assert response.status_code == 404, (method, path, response.text)
        never_existed = await client.request(method, _fill(path, NEVER_EXISTED), json=body, headers=world.acme.headers)
        assert response.json() == never_existed.json(), "a foreign id must look exactly like a missing one"
        leaked = [secret for secret in _globex_secrets(world) if secret not in url and secret in response.text]
        assert not leaked, (path, leaked)
    mine = await client.get(f"/v1/negotiations/{world.globex_negotiation}", headers=world.globex.headers)
    assert mine.status_code == 200 and mine.json()["state"] == "offered", "the probes changed nothing"


async def test_tenant_views_never_show_provider_names_or_other_tenants(
    client: httpx.AsyncClient, world: World
) -> None:
    acme = world.acme
    responses = [
        await client.get("/v1/tenant", headers=acme.headers),
        await client.get("/v1/jobs", headers=acme.headers),
        await client.get("/v1/jobs/acme-train", headers=acme.headers),
        await client.get("/v1/jobs/acme-train/allocations", headers=acme.headers),
        await client.get("/v1/capacity", headers=acme.headers),
        await client.get("/v1/negotiations", headers=acme.headers),
    ]
    for response in responses:
        assert response.status_code == 200, response.text
        for secret in _globex_secrets(world):
            assert secret not in response.text, (str(response.url), secret)

    jobs = responses[1].json()
    assert [job["id"] for job in jobs] == ["acme-train"]
    (allocation,) = responses[3].json()
    assert re.fullmatch(r"h-[0-9a-f]{16}", allocation["host"])
    assert re.fullmatch(r"g-[0-9a-f]{16}", allocation["locality_group"])

    capacity = responses[4].json()["groups"]
    assert all(re.fullmatch(r"g-[0-9a-f]{16}", group["locality_group"]) for group in capacity)


async def _capacity_groups(client: httpx.AsyncClient, tenant: TenantHandle) -> set[str]:
    response = await client.get("/v1/capacity", headers=tenant.headers)
    return {group["locality_group"] for group in response.json()["groups"]}


async def test_same_host_has_unlinkable_pseudonyms_across_tenants(client: httpx.AsyncClient, world: World) -> None:
    acme_view = (await client.get("/v1/jobs/acme-train/allocations", headers=world.acme.headers)).json()
    globex_view = (await client.get("/v1/jobs/globex-train/allocations", headers=world.globex.headers)).json()
    assert acme_view[0]["host"] != globex_view[0]["host"], "both allocations are on gpu-node-017"
    assert acme_view[0]["locality_group"] != globex_view[0]["locality_group"]
    acme_groups = await _capacity_groups(client, world.acme)
    globex_groups = await _capacity_groups(client, world.globex)
    assert acme_view[0]["locality_group"] in acme_groups
    assert not acme_groups & globex_groups


async def test_job_ids_are_per_tenant(client: httpx.AsyncClient, world: World) -> None:
    """Creating a job with an id another tenant uses must succeed, or the 409 would confirm that job exists."""
    body = job_body(world.globex_job, max_workers=2)
    created = await client.post("/v1/jobs", json=body, headers=world.acme.headers)
    assert created.status_code == 201, created.text
    duplicate = await client.post("/v1/jobs", json=body, headers=world.acme.headers)
    assert duplicate.status_code == 409
    mine = (await client.get(f"/v1/jobs/{world.globex_job}", headers=world.acme.headers)).json()
    assert mine["max_workers"] == 2
    theirs = (await client.get(f"/v1/jobs/{world.globex_job}", headers=world.globex.headers)).json()
    assert theirs["max_workers"] == 4


async def test_capacity_is_bucketed(client: httpx.AsyncClient, world: World) -> None:
    """rack-a: 4 GPUs, 4 allocated -> "0"; rack-b: 4 free -> "4-7"."""
    groups = (await client.get("/v1/capacity", headers=world.acme.headers)).json()["groups"]
    assert sorted((group["free_gpus"], group["free_gpus_at_least"]) for group in groups) == [("0", 0), ("4-7", 4)]


async def test_event_consumers_live_in_the_callers_own_slice(
    app: FastAPI, client: httpx.AsyncClient, world: World
) -> None:
    body = {"kinds": ["failure"], "jobs": [world.globex_job]}
    for handle in (world.globex, world.acme):
        response = await client.put("/v1/event-consumers/ctl", json=body, headers=handle.headers)
        assert response.status_code == 200, response.text
    acme_view = response.json()
    assert acme_view["stream"] == "HZ_T_acme"
    assert acme_view["filter_subjects"] == ["hz.t.acme.events.failure.globex-train"]
    consumers = app.state.broker.consumers
    assert consumers[("globex", "ctl")].filter_subjects == ["hz.t.globex.events.failure.globex-train"]
    assert consumers[("acme", "ctl")].stream == "HZ_T_acme"
