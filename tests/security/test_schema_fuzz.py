"""Schema fuzzing: schemathesis generates requests for every operation of the app's own OpenAPI document.

Each generated request is sent three times: with the admin token, with a tenant's token, and with no token, to the
real app (its lifespan run, on a SQLite database migrated by our fixtures), in process. It fails on:
* any 5xx (`not_a_server_error`);
* a response the document does not describe: undocumented status, content type, headers or body shape;
* a non-public operation that answers a caller without a token with anything but 401 (a well-formed request), or
  with a 2xx whatever it sent: no route ignores authentication.

Data are positive (valid for the schema) and negative (violating it), plus a positive pass whose path parameters name
objects that exist, so the requests reach the services rather than stopping at "not found". Bounded for CI: a few
examples per operation and mode, derandomized (the same requests on every run), no deadline; ~20-40 s here.
"""

from __future__ import annotations

import collections
import functools
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from anyio.from_thread import BlockingPortal, start_blocking_portal
from fastapi import FastAPI
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.app import create_app
from api.options import NegotiationOptions
from tests.api.api_memory_broker import InMemoryBroker
from tests.api.api_testkit import ADMIN_TOKEN, FakeClock, bearer, job_body
from tests.api.conftest import make_settings
from tests.api.test_api_scoping import PUBLIC_ROUTES

MAX_EXAMPLES = 12
"""Per operation and mode; with three callers each, ~2,800 requests in all."""
BASE_URL = "http://hz.test"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
TENANT = "fuzz-tenant-7f3a"
"""An id the generator will not stumble on (it would revoke the tenant whose token the run uses)."""
KNOWN_IDS_SKIP = {"DELETE /v1/tenants/{tenant_id}"}


@dataclass
class Served:
    """The app, running in its own event loop thread, and a blocking way to send it requests."""

    app: FastAPI
    portal: BlockingPortal
    client: httpx.AsyncClient

    def send(self, prepared: requests.PreparedRequest) -> httpx.Response:
        request = functools.partial(
            self.client.request, str(prepared.method), str(prepared.url),
            headers=dict(prepared.headers),  # type: ignore[arg-type]  # requests' stub allows bytes values; never here
            content=prepared.body,  # type: ignore[arg-type]  # a prepared body is bytes, str or None at this point
        )
        return self.portal.call(request)


@dataclass
class Tally:
    examples: int = 0
    requests: int = 0
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)


@pytest.fixture
def served(sqlite_template: Path, tmp_path: Path) -> Iterator[Served]:
    with sqlite3.connect(sqlite_template) as source, sqlite3.connect(tmp_path / "harmonaize.db") as target:
        source.backup(target)
    app = create_app(
        make_settings(data_dir=tmp_path),
        broker=InMemoryBroker(),
        negotiation=NegotiationOptions(clock=FakeClock(), sweep_interval_s=3600.0),
    )
    with start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(app.router.lifespan_context(app)):
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE_URL)
            try:
                yield Served(app, portal, client)
            finally:
                portal.call(client.aclose)


def _world(served: Served) -> tuple[str, dict[str, str]]:
    """A tenant with a placed job, a host, an open negotiation; its token and ids that exist."""
    admin = bearer(ADMIN_TOKEN)

    def post(path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        response = served.portal.call(functools.partial(served.client.post, path, json=body, headers=headers))
        assert response.status_code in (200, 201), response.text
        return dict(response.json())

    token = post("/v1/tenants", {"id": TENANT, "display_name": "Fuzz"}, admin)["api_token"]
    tenant = bearer(token)
    post("/v1/hosts", {"id": "h1", "gpus": 8, "locality_group": "rack-a"}, admin)
    post("/v1/jobs", job_body("train", initial_workers=1), tenant)
    negotiation = post(
        "/v1/negotiations",
        {"job": "train", "kind": "scale", "terms": {"desired_workers": 2}},
        {**tenant, "Idempotency-Key": "fuzz-1"},
    )
    allocation = served.portal.call(functools.partial(served.client.get, "/v1/allocations", headers=admin)).json()[0]
    known = {
        "tenant_id": TENANT, "job_id": "train", "host_id": "h1", "name": "ctl",
        "negotiation_id": negotiation["id"], "allocation_id": allocation["id"],
    }
    return token, known


def _prepare(case: schemathesis.Case[Any], token: str | None) -> requests.PreparedRequest:
    kwargs = case.as_transport_kwargs(base_url=BASE_URL)
    headers = {name: value for name, value in kwargs.pop("headers", {}).items() if name.lower() != "authorization"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    kwargs.pop("cookies", None)
    return requests.Request(headers=headers, **kwargs).prepare()


def _fuzz(
    served: Served,
    operation: Any,
    mode: GenerationMode,
    tokens: dict[str, str | None],
    tally: Tally,
    *,
    path_parameters: dict[str, str] | None = None,
) -> None:
    public = tuple(operation.label.split(" ", 1)) in PUBLIC_ROUTES

    @given(case=operation.as_strategy(generation_mode=mode, path_parameters=path_parameters))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: schemathesis.Case[Any]) -> None:
        tally.examples += 1
        for caller, token in tokens.items():
            prepared = _prepare(case, token)
            response = served.send(prepared)
            tally.requests += 1
            tally.statuses[response.status_code] += 1
            where = f"{operation.label} [{mode.value}, {caller}] {prepared.method} {prepared.url}"
            try:
                case.validate_response(response, checks=CHECKS)
            except BaseException as exc:  # schemathesis reports several failures as one exception group
                tally.failures.append(f"{where}: {type(exc).__name__}: {str(exc)[:600]}")
            if token is None and not public:
                refused = response.status_code == 401 if mode.is_positive else 400 <= response.status_code < 500
                if not refused:
                    tally.failures.append(f"{where}: no token, got {response.status_code} {response.text[:200]}")

    try:
        run()
    except Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE, operation.label  # nothing to violate: an operation without inputs


def test_every_operation_survives_the_fuzzer_with_each_kind_of_caller(served: Served) -> None:
    token, known = _world(served)
    schema = schemathesis.openapi.from_dict(served.app.openapi())
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]  # an Err fails here
    assert len(operations) >= 30
    tokens: dict[str, str | None] = {"admin": ADMIN_TOKEN, "tenant": token, "anonymous": None}
    tally = Tally()
    started = time.monotonic()
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(served, operation, mode, tokens, tally)
    for operation in operations:
        names = {parameter.name for parameter in operation.path_parameters}
        if names and operation.label not in KNOWN_IDS_SKIP:
            fixed = {name: known[name] for name in names}
            _fuzz(served, operation, GenerationMode.POSITIVE, tokens, tally, path_parameters=fixed)
    elapsed = time.monotonic() - started
    print(
        f"\nschemathesis: {len(operations)} operations, {tally.examples} examples, {tally.requests} requests "
        f"in {elapsed:.1f} s; statuses {dict(sorted(tally.statuses.items()))}"
    )
    assert not tally.failures, "\n".join(tally.failures[:20])
    assert tally.statuses[200] + tally.statuses[201] + tally.statuses[202] > 50, "some requests get through"
    assert not any(500 <= status for status in tally.statuses)
