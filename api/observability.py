"""Seeing faults: an access-log line per request, Prometheus metrics, and the callers' trace context.

`RequestObserver` (pure ASGI, the outermost of our middleware) opens the log context of each request (`log_context`):
a fresh request id, returned to the caller as `X-Request-Id` so a tenant can quote it, and the caller's W3C
`traceparent` when it sent a valid one (an invalid one is ignored, as the W3C spec asks, and never logged). When the
request ends it records the request in the metrics and writes one `api.access` record: method, route template,
status, duration, and every id bound meanwhile (tenant, job, negotiation). Tenant events the request causes carry the
same traceparent (`api.services.outbox`), so a trace continues from the tenant's controller, through the API, to the
NATS message headers of the events it reads back.

Metrics live in a registry per app (no process-global state: tests build many apps in one process). Request counts
and latencies are labelled by route template, never the raw path, so ids cannot explode the label space; requests
that match no route share one label. Fleet-wide numbers (negotiations by state, the outbox, the ledger) are read from
the database when scraped (`api.services.fleet_stats`), and the relay's own counters from the relay.

Access: `GET /v1/metrics` takes the admin token or a scrape-only `HZ_METRICS_TOKEN` (`api.routes.metrics`). It is not
left open on a separate path because it shows what the tenant views deliberately hide: exact fleet size and
utilisation (tenants only see bucketed free capacity) and every tenant's negotiation volume. A scrape-only token keeps
the admin token out of Prometheus's configuration.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import TypeAdapter, ValidationError
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.log_context import bind, log_context
from api.services.fleet_stats import FleetStats
from api.services.ledger_lock import LOCK_METRICS
from api.services.outbox_relay import OutboxRelay
from harmonaize.events.envelope import TraceParent

access_log = logging.getLogger("api.access")

REQUEST_ID_HEADER = "X-Request-Id"
UNMATCHED_ROUTE = "<unmatched>"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_traceparent = TypeAdapter(TraceParent)


def valid_traceparent(value: str | None) -> str | None:
    """`value` if it is a well-formed W3C traceparent, else None."""
    if not value:
        return None
    try:
        return _traceparent.validate_python(value)
    except ValidationError:
        return None


class ApiMetrics:
    """The app's Prometheus registry: request metrics, counted as requests end."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "hz_http_requests",
            "HTTP requests handled, by route template, method and status.",
            ("method", "route", "status"),
            registry=self.registry,
        )
        self.latency = Histogram(
            "hz_http_request_duration_seconds",
            "Time from the request's arrival to the end of its response, by route template and method.",
            ("method", "route"),
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def observe(self, *, method: str, route: str, status: int, seconds: float) -> None:
        method = method if method in _METHODS else "OTHER"
        self.requests.labels(method=method, route=route, status=str(status)).inc()
        self.latency.labels(method=method, route=route).observe(seconds)

    def render(self, stats: FleetStats, *, relay: OutboxRelay | None) -> bytes:
        """The exposition text: request metrics, the ledger lock's waits, holds and redone accepts, plus the fleet
        and relay as they are now."""
        return (
            generate_latest(self.registry) + generate_latest(LOCK_METRICS)
            + generate_latest(_snapshot_registry(stats, relay))
        )


def _snapshot_registry(stats: FleetStats, relay: OutboxRelay | None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    negotiations = Gauge("hz_negotiations", "Negotiations by current state.", ("state",), registry=registry)
    for state, count in stats.negotiations_by_state.items():
        negotiations.labels(state=state).set(count)
    outbox = Gauge(
        "hz_outbox_messages", "Outbox rows by topic, published (delivered) or pending.", ("topic", "status"),
        registry=registry,
    )
    for status, counts in (("delivered", stats.outbox_delivered), ("pending", stats.outbox_pending)):
        for topic, count in counts.items():
            outbox.labels(topic=topic, status=status).set(count)
    Gauge(
        "hz_outbox_oldest_pending_age_seconds", "Age of the oldest undelivered outbox row (0: none).", registry=registry
    ).set(stats.outbox_oldest_pending_s)
    hosts = Gauge("hz_hosts", "Registered hosts, up or down.", ("state",), registry=registry)
    hosts.labels(state="up").set(stats.hosts_up)
    hosts.labels(state="down").set(stats.hosts_down)
    gpus = Gauge("hz_ledger_gpus", "GPUs in the capacity ledger: total, allocated, on hosts that are down.", ("state",),
                 registry=registry)
    gpus.labels(state="total").set(stats.gpus_total)
    gpus.labels(state="allocated").set(stats.gpus_allocated)
    gpus.labels(state="down").set(stats.gpus_down)
    Gauge("hz_ledger_utilisation_ratio", "Allocated GPUs over the GPUs of hosts that are up.", registry=registry).set(
        stats.ledger_utilisation
    )
    tenants = Gauge("hz_tenants", "Tenants, active or revoked.", ("state",), registry=registry)
    tenants.labels(state="active").set(stats.tenants_active)
    tenants.labels(state="revoked").set(stats.tenants_revoked)
    if relay is not None:
        Counter("hz_outbox_relay_deliveries", "Messages this process's relay delivered (published or written).",
                registry=registry).inc(relay.delivered)
        Counter("hz_outbox_relay_failures", "Delivery attempts of this process's relay that failed.",
                registry=registry).inc(relay.failures)
    return registry


class RouteTemplates:
    """Map a request path to its route template (`/v1/jobs/{job_id}`), whatever FastAPI version routed it.

    Built on first use from the app's OpenAPI paths and its top-level routes; a path matching no template (a scan
    for `/wp-admin`) gets one shared label. Static templates win over parametrised ones.
    """

    def __init__(self, app: FastAPI) -> None:
        self._app = app
        self._patterns: list[tuple[re.Pattern[str], str]] | None = None

    def _build(self) -> list[tuple[re.Pattern[str], str]]:
        templates = set(self._app.openapi().get("paths", {}))
        templates.update(path for route in self._app.routes if isinstance(path := getattr(route, "path", None), str))
        ordered = sorted(templates, key=lambda template: (template.count("{"), template))
        return [(compile_path(template)[0], template) for template in ordered]

    def __call__(self, path: str) -> str:
        if self._patterns is None:
            self._patterns = self._build()
        for pattern, template in self._patterns:
            if pattern.match(path):
                return template
        return UNMATCHED_ROUTE


@dataclass
class _Response:
    status: int = 500


class RequestObserver:
    """Open the log context, add `X-Request-Id`, count and time the request, write the access-log line."""

    def __init__(self, app: ASGIApp, *, fastapi_app: FastAPI, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics
        self.templates = RouteTemplates(fastapi_app)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = secrets.token_hex(8)
        traceparent = valid_traceparent(_header(scope, b"traceparent"))
        response = _Response()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                response.status = int(message["status"])
                headers = [*message.get("headers", ()), (REQUEST_ID_HEADER.lower().encode(), request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        started = time.perf_counter()
        with log_context(request_id=request_id, traceparent=traceparent):
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                elapsed = time.perf_counter() - started
                route = self.templates(str(scope.get("path", "")))
                method = str(scope.get("method", ""))
                self.metrics.observe(method=method, route=route, status=response.status, seconds=elapsed)
                access_log.info(
                    "%s %s %d %.1f ms",
                    method,
                    route,
                    response.status,
                    elapsed * 1000,
                    extra={
                        "http": {
                            "method": method,
                            "route": route,
                            "path": scope.get("path", ""),
                            "status": response.status,
                            "duration_ms": round(elapsed * 1000, 3),
                        }
                    },
                )


async def bind_path_ids(request: Request) -> None:
    """Router dependency: the ids in the path (job, negotiation, tenant) join the request's log context.

    Values are as sent (validation comes later); the JSON formatter escapes them, so they cannot forge log lines.
    """
    params = request.path_params
    bind(job=params.get("job_id"), negotiation=params.get("negotiation_id"), tenant=params.get("tenant_id"))


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            text: str = value.decode("latin-1")
            return text
    return None


def install_observability(app: FastAPI) -> ApiMetrics:
    """Give `app` its metrics registry and the request observer (add it after every other middleware)."""
    metrics = ApiMetrics()
    app.state.metrics = metrics
    app.add_middleware(RequestObserver, fastapi_app=app, metrics=metrics)
    return metrics
