"""HTTP routes under /v1, one module per resource; each translates HTTP to a service call and back.

Tenant routes take `CurrentTenant` (the negotiation routes `NegotiationCall`, which authenticates the same way) and
query through its id; admin routes take `AdminDep`. A test walks every route of the app and checks that each one is
either in the tenant set or refuses tenant tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any, TypedDict

from fastapi import APIRouter, Depends, params

from api.limits import BODY_TOO_LARGE_RESPONSE, RATE_LIMITED_RESPONSE, limit_negotiation_writes
from api.observability import bind_path_ids
from api.routes import (
    allocations,
    capacity,
    event_consumers,
    event_stream,
    fleet,
    health,
    hosts,
    job_runs,
    jobs,
    maintenance_approvals,
    metrics,
    negotiations,
    tenants,
)
from api.schemas import ErrorPublic

_ERRORS: dict[int | str, dict[str, object]] = {
    **{status: {"model": ErrorPublic} for status in (401, 403, 404, 409, 422, 503)},
    **BODY_TOO_LARGE_RESPONSE,
}


class _RouterExtras(TypedDict, total=False):
    """The `include_router` arguments a module may add to the shared ones."""

    dependencies: Sequence[params.Depends]
    responses: dict[int | str, dict[str, Any]]


_LIMITED: dict[ModuleType, _RouterExtras] = {
    negotiations: {"dependencies": [Depends(limit_negotiation_writes)], "responses": RATE_LIMITED_RESPONSE}
}
"""Per-module extras: negotiation writes take a token from the tenant's bucket (`api.limits`)."""


def build_router() -> APIRouter:
    """All /v1 routes (a fresh router per app, so apps built in one process share no state)."""
    router = APIRouter(prefix="/v1", responses=_ERRORS, dependencies=[Depends(bind_path_ids)])
    # the hot path first: a request is matched against each module's routes in this order, and the negotiations
    # (whose paths no other module shares) are most of the load
    modules = (
        negotiations, health, tenants, jobs, hosts, allocations, capacity, event_consumers, maintenance_approvals,
        job_runs, metrics, fleet, event_stream,
    )
    for module in modules:
        router.include_router(module.router, **_LIMITED.get(module, _RouterExtras()))
    return router
