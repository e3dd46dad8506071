"""Prometheus metrics for the provider's operator: the admin token or the scrape-only `HZ_METRICS_TOKEN`.

Why not an open endpoint: see `api.observability` (it would show tenants the exact fleet size and utilisation their
own views bucket, and other tenants' negotiation volume).
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from api.deps import BearerToken, NowDep, SessionDep, SettingsDep, is_admin_token
from api.observability import ApiMetrics
from api.services.fleet_stats import fleet_stats
from api.services.tenants import authenticate

router = APIRouter(tags=["metrics"])

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


async def require_metrics_reader(token: BearerToken, session: SessionDep, settings: SettingsDep) -> None:
    """The admin token or the metrics token; a tenant token is told plainly that this is not for tenants."""
    if is_admin_token(token, settings):
        return
    scrape = settings.metrics_token
    if scrape is not None and scrape.get_secret_value():
        if hmac.compare_digest(token.encode(), scrape.get_secret_value().encode()):
            return
    tenant = await authenticate(session, token)
    if tenant is not None and tenant.revoked_at is None:
        raise HTTPException(
            403, "this route is for the provider's admin or metrics scraper: tenant tokens are not accepted"
        )
    raise HTTPException(401, "invalid admin or metrics token", headers=_CHALLENGE)


MetricsReaderDep = Annotated[None, Depends(require_metrics_reader)]


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text."}},
)
async def metrics(request: Request, _reader: MetricsReaderDep, session: SessionDep, now: NowDep) -> Response:
    """Request counts and latencies, negotiations by state, the outbox, the ledger (Prometheus text format)."""
    app_metrics: ApiMetrics = request.app.state.metrics
    stats = await fleet_stats(session, now=now)
    body = app_metrics.render(stats, relay=request.app.state.relay)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
