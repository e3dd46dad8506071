"""Helpers for the security suite: an app with its own settings, and a walk over the app's OpenAPI document."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI

from api.app import create_app
from api.options import NegotiationOptions
from harmonaize.settings import Settings
from tests.api.api_memory_broker import InMemoryBroker


@asynccontextmanager
async def serving(
    settings: Settings, *, negotiation: NegotiationOptions | None = None, **overrides: Any
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """An app on `settings` with `overrides` (already-typed values: SecretStr for secrets), started, and a client."""
    application = create_app(settings.model_copy(update=overrides), broker=InMemoryBroker(), negotiation=negotiation)
    async with application.router.lifespan_context(application):
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://hz.test") as client:
            yield application, client


@dataclass(frozen=True)
class Field:
    """One input of one operation: where it goes (`path`, `query`, `body`) and its dotted name under that."""

    method: str
    path: str
    location: str
    name: str
    schema: dict[str, Any]

    @property
    def error_field(self) -> str:
        """How the API's 422 names it (`path.job_id`, `body.jobs.0`)."""
        return f"{self.location}.{self.name.replace('*', '0')}"


class OpenApi:
    """The app's OpenAPI document, with `$ref`s resolved and optional (`anyOf [X, null]`) wrappers unwrapped."""

    def __init__(self, app: FastAPI) -> None:
        self.doc = app.openapi()
        self._components = self.doc.get("components", {}).get("schemas", {})

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            schema = self._components[schema["$ref"].rsplit("/", 1)[-1]]
        return schema

    def variants(self, schema: dict[str, Any]) -> list[dict[str, Any]]:
        """The alternatives of a schema (one, unless anyOf/oneOf), resolved, without `null`."""
        schema = self.resolve(schema)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return [v for sub in schema[key] for v in self.variants(sub) if v.get("type") != "null"]
        return [schema]

    def operations(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        for path, operations in self.doc["paths"].items():
            for method, operation in operations.items():
                yield method.upper(), path, operation

    def fields(self) -> Iterator[Field]:
        """Every input leaf of every operation: parameters, and body properties down to array items."""
        for method, path, operation in self.operations():
            for parameter in operation.get("parameters", []):
                yield from self._leaves(method, path, parameter["in"], parameter["name"], parameter["schema"])
            body = operation.get("requestBody")
            if body is not None:
                schema = body["content"]["application/json"]["schema"]
                yield from self._leaves(method, path, "body", "", schema)

    def _leaves(self, method: str, path: str, location: str, name: str, schema: dict[str, Any]) -> Iterator[Field]:
        for variant in self.variants(schema):
            if variant.get("type") == "object" or "properties" in variant:
                for prop, sub in variant.get("properties", {}).items():
                    yield from self._leaves(method, path, location, f"{name}.{prop}".lstrip("."), sub)
            elif variant.get("type") == "array":
                yield Field(method, path, location, name, variant)
                if "items" in variant:
                    yield from self._leaves(method, path, location, f"{name}.*", variant["items"])
            else:
                yield Field(method, path, location, name, variant)


def nest(name: str, value: Any) -> Any:
    """A body holding `value` at dotted `name` and nothing else (`a.*.b` -> {"a": [{"b": value}]})."""
    if not name:
        return value
    head, _, rest = name.partition(".")
    inner = nest(rest, value)
    return [inner] if head == "*" else {head: inner}
