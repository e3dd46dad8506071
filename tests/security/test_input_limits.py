"""Input limits: every input is bounded, bodies over the limit are a 413, values past what can be stored a 422.

The schema walk is the guarantee that keeps the bounds from eroding: a new string without a maximum length, a list
without a maximum size or a number without a range fails it, wherever it is added.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from api.limits import ApiLimits
from harmonaize.settings import Settings
from tests.api.api_testkit import ADMIN, TenantHandle, create_job, create_tenant, field_names, job_body
from tests.security.security_kit import Field, OpenApi, serving

KNOWN_UNBOUNDED: set[tuple[str, str, str]] = set()
"""Inputs without a bound: none (the contract's `JobProgress` counters are bounded by `MAX_COUNT`). Never grow it."""


def _unbounded(field: Field) -> bool:
    schema = field.schema
    if "enum" in schema or "const" in schema or schema.get("type") in ("boolean", "null"):
        return False
    kind = schema.get("type")
    if kind == "string":
        if schema.get("format") == "date-time" or "maxLength" in schema:
            return False
        pattern = re.sub(r"\\.", "", schema.get("pattern", ".*"))
        return "*" in pattern or "+" in pattern
    if kind == "array":
        return "maxItems" not in schema
    if kind in ("integer", "number"):
        has_max = "maximum" in schema or "exclusiveMaximum" in schema
        has_min = "minimum" in schema or "exclusiveMinimum" in schema
        return not (has_max and has_min)
    return True


async def test_every_input_is_bounded(app: FastAPI) -> None:
    fields = list(OpenApi(app).fields())
    assert len(fields) > 80, "the walk reaches nested body fields"
    unbounded = {(field.method, field.path, field.error_field) for field in fields if _unbounded(field)}
    assert unbounded == KNOWN_UNBOUNDED


def test_the_default_limits_are_the_settings_defaults() -> None:
    settings = Settings(_env_file=None)
    limits = ApiLimits.from_settings(settings)
    assert limits == ApiLimits() == ApiLimits(max_body_bytes=1024 * 1024, negotiation_rate_per_s=20.0,
                                              negotiation_burst=200)


LIMIT = 4096


@pytest.fixture
async def small_body_limit(migrated_settings: Settings) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    async with serving(migrated_settings, api_max_body_bytes=LIMIT) as served:
        yield served


def _padded(body: dict[str, object], size: int) -> bytes:
    """`body` as JSON padded with whitespace to exactly `size` bytes (still valid JSON)."""
    text = httpx.Request("POST", "/", json=body).content
    return text + b" " * (size - len(text))


async def test_bodies_over_the_limit_are_413_naming_the_limit(
    small_body_limit: tuple[FastAPI, httpx.AsyncClient],
) -> None:
    app, client = small_body_limit
    acme = await create_tenant(client, "acme")
    headers = {**acme.headers, "Content-Type": "application/json"}
    at_limit = await client.post("/v1/jobs", content=_padded(job_body("fits"), LIMIT), headers=headers)
    assert at_limit.status_code == 201, at_limit.text

    over = await client.post("/v1/jobs", content=_padded(job_body("big"), LIMIT + 1), headers=headers)
    assert over.status_code == 413, over.text
    assert f"{LIMIT + 1} bytes" in over.json()["reason"] and "HZ_API_MAX_BODY_BYTES" in over.json()["reason"]
    assert over.json()["errors"] == [{"field": "body", "message": f"at most {LIMIT} bytes (HZ_API_MAX_BODY_BYTES)"}]

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield b" " * (LIMIT // 2)

    streamed = await client.post("/v1/jobs", content=chunks(), headers=headers)
    assert streamed.status_code == 413 and "more than" in streamed.json()["reason"], streamed.text
    assert "content-length" not in streamed.request.headers, "the chunked path is the one exercised"
    assert [job["id"] for job in (await client.get("/v1/jobs", headers=acme.headers)).json()] == ["fits"]

    body_routes = [(m, p) for m, p, op in OpenApi(app).operations() if "requestBody" in op]
    assert len(body_routes) >= 12
    for method, path in body_routes:
        url = re.sub(r"\{\w+\}", "x", path)
        response = await client.request(method, url, content=b"{" + b" " * LIMIT + b"}", headers=headers)
        assert response.status_code == 413, (method, path, response.text)
    anonymous = await client.post("/v1/tenants", content=b" " * (LIMIT + 1))
    assert anonymous.status_code == 413, "refused before anything else is read or checked"


OUT_OF_RANGE_TIME = "9999-12-31T23:59:59-23:59"
"""A valid RFC 3339 timestamp that is past year 9999 in UTC, which neither Python nor the database can hold."""


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_values_past_what_can_be_stored_are_422_not_500(
    client: httpx.AsyncClient, acme: TenantHandle
) -> None:
    await create_job(client, acme, "train")
    progress = {
        "tenant": "acme", "job": "train", "epoch": 0, "step": 1, "world_size": 1, "parallel_plan": "ddp",
        "checkpoint_interval_steps": 100, "batch_size": 16, "updated_at": "2026-03-01T12:00:00Z",
    }
    for override in ({"step": 10**20}, {"epoch": 2**63}, {"world_size": 10**30}):
        response = await client.post("/v1/provider/progress", json={**progress, **override}, headers=ADMIN)
        assert response.status_code == 422, (override, response.text)
        [name] = override
        assert f"body.{name}" in [error["field"] for error in response.json()["errors"]], response.text
    assert (await client.post("/v1/provider/progress", json=progress, headers=ADMIN)).status_code == 202

    history = await client.get("/v1/negotiations", params={"until": OUT_OF_RANGE_TIME}, headers=acme.headers)
    assert history.status_code == 422, history.text
    deadline = {"job": "train", "kind": "defer", "terms": {"constraints": {"deadline": OUT_OF_RANGE_TIME}}}
    negotiation = await client.post(
        "/v1/negotiations", json=deadline, headers={**acme.headers, "Idempotency-Key": "far-future"}
    )
    assert negotiation.status_code == 422, negotiation.text
    assert (await client.get("/v1/negotiations", headers=acme.headers)).json()["items"] == []


async def test_list_and_string_bounds_name_the_field(client: httpx.AsyncClient, acme: TenantHandle) -> None:
    too_many = {"kinds": [], "jobs": [f"j{n}" for n in range(17)]}
    response = await client.put("/v1/event-consumers/ctl", json=too_many, headers=acme.headers)
    assert response.status_code == 422 and field_names(response) == {"body.jobs"}
    long_arg = job_body("train", entrypoint=["x" * 501])
    response = await client.post("/v1/jobs", json=long_arg, headers=acme.headers)
    assert response.status_code == 422 and field_names(response) == {"body.entrypoint.0"}
    many_args = job_body("train", entrypoint=["-m"] * 65)
    response = await client.post("/v1/jobs", json=many_args, headers=acme.headers)
    assert response.status_code == 422 and field_names(response) == {"body.entrypoint"}
    key = {**acme.headers, "Idempotency-Key": "k" * 201}
    response = await client.post("/v1/negotiations", json={"job": "j", "kind": "scale", "terms": {}}, headers=key)
    assert response.status_code == 422 and field_names(response) == {"header.Idempotency-Key"}
    response = await client.get("/v1/negotiations", params={"limit": 10**6}, headers=acme.headers)
    assert response.status_code == 422 and field_names(response) == {"query.limit"}
