"""Constants and small helpers shared by the API tests (imported by tests; fixtures live in conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

ADMIN_TOKEN = "test-admin-token-0123456789abcdef"
PROVIDER_SECRET = "test-provider-secret-fedcba9876543210"


EPOCH = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
"""Where every test's clock starts: the carbon trace is anchored here too (trace hour 0: 332 g/kWh)."""


class FakeClock:
    """A clock that moves only when told to: expiry and delayed starts are tested without sleeping."""

    def __init__(self, now: datetime = EPOCH) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> datetime:
        self.now += timedelta(**delta)
        return self.now


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


ADMIN = bearer(ADMIN_TOKEN)


@dataclass(frozen=True)
class TenantHandle:
    """A tenant created through the API, with the secrets returned once at creation."""

    id: str
    token: str
    seed: str
    created: dict[str, Any]

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.token)


def job_body(job_id: str, **overrides: Any) -> dict[str, Any]:
    """A valid job request; override any field to make it invalid."""
    body: dict[str, Any] = {"id": job_id, "min_workers": 1, "max_workers": 4, "batch_size": {"min": 16, "max": 64}}
    body.update(overrides)
    return body


async def create_tenant(client: httpx.AsyncClient, tenant_id: str, *, display_name: str | None = None) -> TenantHandle:
    response = await client.post(
        "/v1/tenants", json={"id": tenant_id, "display_name": display_name or tenant_id.title()}, headers=ADMIN
    )
    assert response.status_code == 201, response.text
    created = response.json()
    return TenantHandle(id=tenant_id, token=created["api_token"], seed=created["nats"]["seed"], created=created)


async def create_host(client: httpx.AsyncClient, host_id: str, *, gpus: int, group: str) -> dict[str, Any]:
    response = await client.post(
        "/v1/hosts", json={"id": host_id, "gpus": gpus, "locality_group": group}, headers=ADMIN
    )
    assert response.status_code == 201, response.text
    return response.json()


async def create_job(client: httpx.AsyncClient, tenant: TenantHandle, job_id: str, **overrides: Any) -> dict[str, Any]:
    response = await client.post("/v1/jobs", json=job_body(job_id, **overrides), headers=tenant.headers)
    assert response.status_code == 201, response.text
    return response.json()


def field_names(response: httpx.Response) -> set[str]:
    """The `field` of every validation error in an error response."""
    return {error["field"] for error in response.json()["errors"]}
