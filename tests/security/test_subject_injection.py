"""Subject injection: an id that could widen a NATS subject or impersonate another id is a 422 naming its field.

Ids become subject tokens (`hz.t.<tenant>.events.<kind>.<job>`), account, stream and consumer names. `.`, `*` and `>`
would split or widen a subject, a space ends it, and unicode look-alikes (fullwidth or Cyrillic letters) would show
one tenant another's name. The walk finds every id-shaped input of every operation in the app's OpenAPI document
(path, query and body, nested list items included), so a route added later is covered without editing this file;
it then checks that nothing shaped by those requests reached the broker or the outbox (what is published to NATS).
"""

from __future__ import annotations

import re
from urllib.parse import quote

import httpx
from fastapi import FastAPI
from sqlalchemy import select

from api.models import OutboxMessage
from harmonaize.ids import ID_PATTERN
from tests.api.api_memory_broker import InMemoryBroker
from tests.api.api_testkit import ADMIN, TenantHandle, field_names
from tests.api.test_api_scoping import TENANT_ROUTES
from tests.security.security_kit import Field, OpenApi, nest

UUID = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
VALID_BY_PATTERN = {
    ID_PATTERN: "ok-id",
    UUID: "00000000-0000-7000-8000-000000000000",
    r"^[0-9a-f]{32}$": "0" * 32,
    r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$": "Region-1",
}
"""The id shapes the API accepts, each with a valid example."""
PATH_VALUES = {
    "job_id": "train", "tenant_id": "acme", "host_id": "h1", "name": "ctl",
    "negotiation_id": VALID_BY_PATTERN[UUID], "allocation_id": "0" * 32,
}
BAD_IDS = {
    "dot": "acme.globex",
    "star": "*",
    "gt": ">",
    "wildcard tail": "hz.t.globex.>",
    "space": "acme globex",
    "fullwidth": "\uff41\uff43\uff4d\uff45",  # ａｃｍｅ
    "cyrillic": "\u0430\u0441m\u0435",  # асmе: Cyrillic а, с, е
    "newline": "acme\n",
    "too long": "a" * 64,
    "empty": "",
}
EXPECTED_ID_FIELDS = {
    "path.job_id", "path.tenant_id", "path.host_id", "path.name", "path.negotiation_id", "path.allocation_id",
    "query.after", "query.job", "query.tenant_id", "query.job_id",
    "body.id", "body.job", "body.tenant", "body.tenant_id", "body.job_id", "body.host_id", "body.locality_group",
    "body.jobs.0", "body.region", "body.terms.region",
}


def _id_fields(app: FastAPI) -> list[Field]:
    return [
        field for field in OpenApi(app).fields()
        if field.schema.get("type") == "string" and field.schema.get("pattern") in VALID_BY_PATTERN
    ]


def _headers(field: Field, acme: TenantHandle) -> dict[str, str]:
    tenant_route = (field.method, field.path) in TENANT_ROUTES
    return {**(acme.headers if tenant_route else ADMIN), "Idempotency-Key": "injection"}


def _request(field: Field, value: str, acme: TenantHandle) -> httpx.Request:
    path_values = {**PATH_VALUES, **({field.name: value} if field.location == "path" else {})}
    url = re.sub(r"\{(\w+)\}", lambda m: quote(path_values[m.group(1)], safe=""), field.path)
    params = {field.name: value} if field.location == "query" else None
    body = nest(field.name, value) if field.location == "body" else None
    return httpx.Request(field.method, f"http://hz.test{url}", params=params, json=body, headers=_headers(field, acme))


async def test_bad_ids_are_422_naming_the_field_on_every_route(
    app: FastAPI, client: httpx.AsyncClient, broker: InMemoryBroker, acme: TenantHandle
) -> None:
    fields = _id_fields(app)
    assert {field.error_field for field in fields} >= EXPECTED_ID_FIELDS
    checked = 0
    for field in fields:
        for what, bad in BAD_IDS.items():
            if field.location == "path" and bad == "":
                continue  # an empty segment is another URL (a 404 or 405 of a different route), not this id
            response = await client.send(_request(field, bad, acme))
            where = (field.method, field.path, field.error_field, what)
            assert response.status_code == 422, (*where, response.text)
            assert field.error_field in field_names(response), (*where, response.text)
            assert field.error_field in response.json()["reason"], where
            checked += 1
        if field.location == "body":
            valid = VALID_BY_PATTERN[field.schema["pattern"]]
            control = await client.send(_request(field, valid, acme))
            assert control.status_code == 200 or field.error_field not in field_names(control), (
                "the error names the field only when the field is wrong", field.error_field, control.text
            )
    assert checked > 250

    consumers = {key: consumer.filter_subjects for key, consumer in broker.consumers.items()}
    assert consumers == {("acme", "ctl"): ["hz.t.acme.events.*.ok-id"]}, "only the valid control reached the broker"
    async with app.state.sessionmaker() as session:
        assert list(await session.scalars(select(OutboxMessage.subject))) == [], "nothing was queued for NATS"
