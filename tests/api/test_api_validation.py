"""Bad input is a 422 that names the field, never a 500; every error has a reason."""

from __future__ import annotations

from urllib.parse import quote

import httpx

from tests.api.api_testkit import ADMIN, TenantHandle, field_names, job_body

BAD_IDS = [
    "bad.id",  # NATS subject separator
    "a*",  # subject wildcard
    "a>",  # subject wildcard
    "A",  # uppercase
    "x y",  # whitespace
    "\u0430cme",  # Cyrillic а: looks like "acme"
    "acme\n",  # trailing newline ($ in Python's re would accept it)
    "-acme",  # must start with a letter or digit
    "a" * 64,  # too long
    "",
]
BAD_PATH_IDS = [bad for bad in BAD_IDS if bad]


async def test_bad_job_id_in_body(client: httpx.AsyncClient, acme: TenantHandle) -> None:
    for bad in BAD_IDS:
        response = await client.post("/v1/jobs", json=job_body(bad), headers=acme.headers)
        assert response.status_code == 422, (bad, response.text)
        assert field_names(response) == {"body.id"}, (bad, response.text)
        assert "body.id" in response.json()["reason"]
        assert "lowercase ASCII" in response.json()["errors"][0]["message"]
    assert (await client.get("/v1/jobs", headers=acme.headers)).json() == []


async def test_bad_ids_in_paths_and_other_bodies(client: httpx.AsyncClient, acme: TenantHandle) -> None:
    for bad in BAD_PATH_IDS:
        segment = quote(bad, safe="")
        cases = [
            (client.get(f"/v1/jobs/{segment}", headers=acme.headers), "path.job_id"),
            (client.get(f"/v1/jobs/{segment}/allocations", headers=acme.headers), "path.job_id"),
            (client.get(f"/v1/tenants/{segment}", headers=ADMIN), "path.tenant_id"),
            (client.post("/v1/tenants", json={"id": bad, "display_name": "x"}, headers=ADMIN), "body.id"),
            (client.post("/v1/hosts", json={"id": bad, "gpus": 1, "locality_group": "g"}, headers=ADMIN), "body.id"),
            (
                client.post("/v1/hosts", json={"id": "h", "gpus": 1, "locality_group": bad}, headers=ADMIN),
                "body.locality_group",
            ),
            (
                client.post("/v1/allocations", json={"tenant_id": bad, "job_id": "j", "gpus": 1}, headers=ADMIN),
                "body.tenant_id",
            ),
            (client.get("/v1/jobs", params={"after": bad}, headers=acme.headers), "query.after"),
        ]
        for request, field in cases:
            response = await request
            assert response.status_code == 422, (bad, field, response.text)
            assert field_names(response) == {field}, (bad, response.text)


async def test_bad_allocation_id_in_path(client: httpx.AsyncClient) -> None:
    for bad in ("1", "not-hex-" + "0" * 24, "0" * 33):
        response = await client.delete(f"/v1/allocations/{bad}", headers=ADMIN)
        assert response.status_code == 422
        assert field_names(response) == {"path.allocation_id"}


JOB_BODY_CASES: list[tuple[dict[str, object], str, list[str]]] = [
    ({"min_workers": 5, "max_workers": 2}, "body.min_workers", ["max_workers"]),
    ({"min_workers": 0}, "body.min_workers", []),
    ({"max_workers": 10**12}, "body.max_workers", []),
    ({"gpus_per_worker": 0}, "body.gpus_per_worker", []),
    ({"parallel_plan": "pipeline"}, "body.parallel_plan", []),
    ({"batch_size": {"min": 64, "max": 8}}, "body.batch_size.min", ["max"]),
    ({"batch_size": {"min": 8}}, "body.batch_size.max", []),
    ({"checkpoint_interval_steps": {"min": 0, "max": 10}}, "body.checkpoint_interval_steps.min", []),
    ({"gradient_accumulation": {"min": 4, "max": 2}}, "body.gradient_accumulation.min", []),
    ({"gradient_compression": {"allowed": ["powersgd"]}}, "body.gradient_compression.powersgd_max_rank", []),
    (
        {"gradient_compression": {"allowed": ["fp16"], "powersgd_max_rank": 4}},
        "body.gradient_compression.powersgd_max_rank",
        ["powersgd"],
    ),
    ({"gradient_compression": {"allowed": ["gzip"]}}, "body.gradient_compression.allowed.0", []),
    ({"gradient_compression": {"allowed": []}}, "body.gradient_compression.allowed", []),
    ({"name": "nul\u0000byte"}, "body.name", []),
    ({"name": "x" * 201}, "body.name", []),
    ({"min_worker": 1}, "body.min_worker", []),
    ({"global_batch": 0}, "body.global_batch", []),
    ({"global_batch": 256, "batch_size": None}, "body.global_batch", ["batch_size"]),
    ({"global_batch": 100, "min_workers": 3, "max_workers": 4}, "body.global_batch", ["at 3 worker(s)"]),
    ({"global_batch": 16, "max_workers": 4}, "body.global_batch", ["at 4 worker(s)"]),
]
"""(fields to override in a valid job, the field the 422 must name, words its message must contain)"""


async def test_bad_job_bodies_name_the_field(client: httpx.AsyncClient, acme: TenantHandle) -> None:
    for overrides, field, words in JOB_BODY_CASES:
        response = await client.post("/v1/jobs", json=job_body("train", **overrides), headers=acme.headers)
        assert response.status_code == 422, (overrides, response.text)
        assert field in field_names(response), (overrides, response.text)
        messages = " ".join(error["message"] for error in response.json()["errors"])
        for word in words:
            assert word in messages, (overrides, messages)
    assert (await client.get("/v1/jobs", headers=acme.headers)).json() == []


async def test_valid_job_round_trips(client: httpx.AsyncClient, acme: TenantHandle) -> None:
    body = job_body(
        "train",
        name="ResNet on ImageNet",
        min_workers=2,
        max_workers=4,
        gpus_per_worker=2,
        parallel_plan="hsdp",
        checkpoint_interval_steps={"min": 50, "max": 500},
        gradient_compression={"allowed": ["powersgd", "none", "powersgd"], "powersgd_max_rank": 8},
        gradient_accumulation={"min": 1, "max": 4},
        global_batch=256,
    )
    created = await client.post("/v1/jobs", json=body, headers=acme.headers)
    assert created.status_code == 201, created.text
    job = created.json()
    assert job["global_batch"] == 256
    assert job["gradient_compression"] == {"allowed": ["none", "powersgd"], "powersgd_max_rank": 8}
    assert job["parallel_plan"] == "hsdp"
    assert job["batch_size"] == {"min": 16, "max": 64}
    fetched = (await client.get("/v1/jobs/train", headers=acme.headers)).json()
    assert fetched == job


async def test_minimal_job_is_accepted(client: httpx.AsyncClient, acme: TenantHandle) -> None:
    """The README's example: no ranges given, so the provider may not change the batch size."""
    body = {"id": "llm-finetune", "name": "LLM fine-tune", "min_workers": 1, "max_workers": 4, "gpus_per_worker": 1}
    created = await client.post("/v1/jobs", json=body, headers=acme.headers)
    assert created.status_code == 201, created.text
    job = created.json()
    assert job["batch_size"] is None
    assert job["gradient_accumulation"] == {"min": 1, "max": 1}
    assert job["global_batch"] is None
    assert job["gradient_compression"] == {"allowed": ["none"], "powersgd_max_rank": None}
    assert (await client.get("/v1/jobs/llm-finetune", headers=acme.headers)).json() == job


async def test_malformed_requests(client: httpx.AsyncClient, acme: TenantHandle) -> None:
    not_json = await client.post(
        "/v1/jobs", content=b"{not json", headers={**acme.headers, "Content-Type": "application/json"}
    )
    assert not_json.status_code == 422 and field_names(not_json) == {"body"}
    assert "invalid JSON" in not_json.json()["errors"][0]["message"]
    not_object = await client.post("/v1/jobs", json=[1, 2], headers=acme.headers)
    assert not_object.status_code == 422 and not_object.json()["reason"]
    both = await client.post(
        "/v1/allocations",
        json={"tenant_id": "acme", "job_id": "j", "gpus": 1, "host_id": "h", "locality_group": "g"},
        headers=ADMIN,
    )
    assert both.status_code == 422 and field_names(both) == {"body.locality_group"}
    limit = await client.get("/v1/jobs", params={"limit": 0}, headers=acme.headers)
    assert limit.status_code == 422 and field_names(limit) == {"query.limit"}


async def test_unknown_objects_and_routes_have_reasons(client: httpx.AsyncClient, acme: TenantHandle) -> None:
    for response in (
        await client.get("/v1/jobs/nope", headers=acme.headers),
        await client.get("/v1/no-such-route"),
        await client.post(
            "/v1/allocations", json={"tenant_id": "acme", "job_id": "nope", "gpus": 1}, headers=ADMIN
        ),
    ):
        assert response.status_code == 404, response.text
        assert response.json()["reason"]
    wrong_method = await client.put("/v1/jobs", headers=acme.headers)
    assert wrong_method.status_code == 405 and wrong_method.json()["reason"]


async def test_healthz(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
