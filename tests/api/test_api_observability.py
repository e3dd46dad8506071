"""Observability: JSON logs carrying the ids of what they are about, Prometheus metrics, and trace context in NATS.

Logs are captured with the production handler set-up (`ContextFilter` + `JsonFormatter`) and parsed back as JSON.
Metrics are scraped through `GET /v1/metrics` and parsed with prometheus_client's own parser. Trace propagation is
checked end to end over a real nats-server: a request's `traceparent` reaches the NATS headers of the events it
caused, read with the tenant's own credentials, and the agents' publisher sets the header from the event.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import nats.errors
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from api.log_context import ContextFilter, JsonFormatter, log_context
from api.migrate import upgrade_async
from api.options import NegotiationOptions
from api.services.outbox_relay import OutboxRelay
from broker_config.accounts import UserKeys
from broker_config.provider_bus import NatsProviderBus
from broker_config.provisioner import NatsTenantBroker
from broker_config.render import TENANT_JS_PREFIX, tenant_stream_name
from broker_config.server import NatsServer
from harmonaize.events import Failure, FailureKind, Severity, agent_source, make_event, parse_event
from harmonaize.negotiation import RoundAction
from harmonaize.settings import Settings
from harmonaize.subjects import tenant_event_subject
from provider_agents.publisher import JetStreamPublisher
from provider_agents.runtime import connect_provider
from tests.api.api_memory_broker import InMemoryBroker
from tests.api.api_memory_bus import MemoryProviderBus
from tests.api.api_testkit import ADMIN, EPOCH, TenantHandle, create_host, create_job
from tests.api.negotiation_kit import act, negotiate
from tests.support import eventually

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
sqlite_only = pytest.mark.parametrize("backend", ["sqlite"])


@pytest.fixture
def json_logs() -> Iterator[io.StringIO]:
    """Every record of the `api` loggers, as the production handler writes it (one JSON object per line)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("api")
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


def _records(stream: io.StringIO, logger: str | None = None) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    return [record for record in records if logger is None or record["logger"] == logger]


@sqlite_only
async def test_access_log_lines_are_json_with_the_ids_of_the_request(
    client: httpx.AsyncClient, acme: TenantHandle, json_logs: io.StringIO
) -> None:
    await create_job(client, acme, "train")
    offer = await negotiate(client, acme, "train", key="k1", desired_workers=0)
    response = await client.get(
        f"/v1/negotiations/{offer['id']}", headers={**acme.headers, "traceparent": TRACEPARENT}
    )
    assert response.status_code == 200
    status = await client.get("/v1/jobs/train/status", headers=acme.headers)
    assert status.status_code == 200

    access = _records(json_logs, "api.access")
    by_request = {record["request_id"]: record for record in access}
    negotiation_line = by_request[response.headers["x-request-id"]]
    assert negotiation_line["tenant"] == "acme" and negotiation_line["negotiation"] == offer["id"]
    assert negotiation_line["traceparent"] == TRACEPARENT
    assert negotiation_line["http"] == {
        "method": "GET",
        "route": "/v1/negotiations/{negotiation_id}",
        "path": f"/v1/negotiations/{offer['id']}",
        "status": 200,
        "duration_ms": negotiation_line["http"]["duration_ms"],
    }
    status_line = by_request[status.headers["x-request-id"]]
    assert (status_line["tenant"], status_line["job"]) == ("acme", "train")
    assert "traceparent" not in status_line, "no traceparent sent, none logged"
    assert len(by_request) == len(access), "a fresh request id per request"


@sqlite_only
async def test_an_invalid_traceparent_is_ignored_and_never_logged(
    client: httpx.AsyncClient, acme: TenantHandle, json_logs: io.StringIO
) -> None:
    for bad in ("garbage", "00-00000000000000000000000000000000-00f067aa0ba902b7-01", "x" * 300):
        response = await client.get("/v1/tenant", headers={**acme.headers, "traceparent": bad})
        assert response.status_code == 200
    lines = _records(json_logs, "api.access")
    assert len(lines) == 3 and all("traceparent" not in line for line in lines)
    assert "garbage" not in json_logs.getvalue()


@sqlite_only
async def test_records_written_during_a_request_carry_its_ids(
    client: httpx.AsyncClient, acme: TenantHandle, json_logs: io.StringIO
) -> None:
    response = await client.get(
        "/v1/negotiations", params={"until": "9999-12-31T23:59:59-23:59"},
        headers={**acme.headers, "traceparent": TRACEPARENT},
    )
    assert response.status_code == 422
    (warning,) = _records(json_logs, "api.errors")
    assert warning["level"] == "WARNING" and "out-of-range" in warning["message"]
    assert warning["request_id"] == response.headers["x-request-id"]
    assert (warning["tenant"], warning["traceparent"]) == ("acme", TRACEPARENT)


class LoggingBus(MemoryProviderBus):
    """An in-memory bus that logs each publish, as a real bus logs a retry."""

    async def publish_event(self, subject: str, payload: bytes, msg_id: str) -> None:
        logging.getLogger("api.test_bus").info("publishing to %s", subject)
        await super().publish_event(subject, payload, msg_id)


@sqlite_only
async def test_the_relay_logs_with_the_event_id_and_events_carry_the_requests_traceparent(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, json_logs: io.StringIO
) -> None:
    await create_host(client, "h1", gpus=4, group="rack-a")
    await create_job(client, acme, "train", initial_workers=1)
    response = await client.post(
        "/v1/negotiations",
        json={"job": "train", "kind": "scale", "terms": {"desired_workers": 2}},
        headers={**acme.headers, "Idempotency-Key": "k1", "traceparent": TRACEPARENT},
    )
    assert response.status_code == 201
    bus = LoggingBus()
    await OutboxRelay(app.state.sessionmaker, bus).deliver_pending()
    (event,) = [parse_event(payload) for _, payload, _ in bus.events]
    assert event.traceparent == TRACEPARENT, "the event continues the trace of the request that caused it"
    (published,) = _records(json_logs, "api.test_bus")
    assert published["event"] == event.id and "request_id" not in published


def _metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@sqlite_only
async def test_metrics_show_requests_negotiations_outbox_and_ledger(
    app: FastAPI, client: httpx.AsyncClient, acme: TenantHandle, globex: TenantHandle
) -> None:
    await create_host(client, "h1", gpus=6, group="rack-a")
    await create_job(client, acme, "train", initial_workers=2)
    offered = await negotiate(client, acme, "train", key="k1", desired_workers=3)
    withdrawn = await negotiate(client, acme, "train", key="k2", desired_workers=4)
    assert (await act(client, acme, withdrawn["id"], RoundAction.CANCEL)).status_code == 200
    assert offered["state"] == "offered"
    await create_host(client, "h2", gpus=2, group="rack-b")
    await client.get("/v1/jobs/nope", headers=acme.headers)
    await client.get("/wp-admin")
    assert (await client.post("/v1/provider/hosts/h2/down", headers=ADMIN)).status_code == 200
    assert (await client.delete("/v1/tenants/globex", headers=ADMIN)).status_code == 200

    assert (await client.get("/v1/metrics", headers=acme.headers)).status_code == 403
    assert (await client.get("/v1/metrics")).status_code == 401
    scraped = await client.get("/v1/metrics", headers=ADMIN)
    assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
    metrics = _metrics(scraped.text)

    def value(name: str, **labels: str) -> float:
        return metrics[(name, tuple(sorted(labels.items())))]

    assert value("hz_http_requests_total", method="POST", route="/v1/negotiations", status="201") == 2
    assert value("hz_http_requests_total", method="GET", route="/v1/jobs/{job_id}", status="404") == 1
    assert value("hz_http_requests_total", method="GET", route="<unmatched>", status="404") == 1
    assert value("hz_http_requests_total", method="GET", route="/v1/metrics", status="403") == 1
    assert value("hz_http_request_duration_seconds_count", method="POST", route="/v1/negotiations") == 2
    assert value("hz_negotiations", state="offered") == 1 and value("hz_negotiations", state="cancelled") == 1
    pending = value("hz_outbox_messages", topic="tenant_event", status="pending")
    assert pending == 3 and value("hz_outbox_messages", topic="desired_state", status="pending") >= 1
    assert value("hz_outbox_oldest_pending_age_seconds") >= 0
    assert value("hz_ledger_gpus", state="total") == 8 and value("hz_ledger_gpus", state="allocated") == 2
    assert value("hz_ledger_gpus", state="down") == 2
    assert value("hz_ledger_utilisation_ratio") == pytest.approx(2 / 6)
    assert (value("hz_hosts", state="up"), value("hz_hosts", state="down")) == (1, 1)
    assert (value("hz_tenants", state="active"), value("hz_tenants", state="revoked")) == (1, 1)
    assert not any("acme" in str(key) or "globex" in str(key) or "h1" in str(key) for key in metrics), (
        "fleet-wide numbers only: no tenant or host ids in labels"
    )

    await OutboxRelay(app.state.sessionmaker, MemoryProviderBus()).deliver_pending()
    after = _metrics((await client.get("/v1/metrics", headers=ADMIN)).text)
    delivered = ("hz_outbox_messages", (("status", "delivered"), ("topic", "tenant_event")))
    assert after[delivered] == 3
    assert ("hz_outbox_messages", (("status", "pending"), ("topic", "tenant_event"))) not in after


@sqlite_only
async def test_the_relays_counters_are_exported(migrated_settings: Settings) -> None:
    bus = MemoryProviderBus()
    options = NegotiationOptions(clock=lambda: EPOCH, sweep_interval_s=3600.0, relay_poll_interval_s=0.02)
    app = create_app(migrated_settings, broker=InMemoryBroker(), bus=bus, negotiation=options)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://hz.test") as client:
            assert (await client.post("/v1/hosts", json={"id": "h1", "gpus": 2, "locality_group": "g"},
                                      headers=ADMIN)).status_code == 201
            tenant = await client.post("/v1/tenants", json={"id": "acme", "display_name": "A"}, headers=ADMIN)
            headers = {"Authorization": f"Bearer {tenant.json()['api_token']}"}
            assert (await client.post("/v1/jobs", json={"id": "t", "min_workers": 1, "max_workers": 2,
                                                        "initial_workers": 1}, headers=headers)).status_code == 201
            await eventually(lambda: app.state.relay.delivered >= 1, what="the relay delivering the placement")
            metrics = _metrics((await client.get("/v1/metrics", headers=ADMIN)).text)
    assert metrics[("hz_outbox_relay_deliveries_total", ())] >= 1
    assert metrics[("hz_outbox_relay_failures_total", ())] == 0


# ---- trace context over a real nats-server ------------------------------------------------------------------------


@pytest.fixture
async def nats_settings(tmp_path: Path, provider_secret: bytes) -> Settings:
    settings = Settings(
        _env_file=None, data_dir=tmp_path / "hz", admin_token=ADMIN["Authorization"].removeprefix("Bearer "),
        provider_secret=provider_secret.decode(),
    )
    await upgrade_async(settings)
    return settings


async def _tenant_messages(
    nats_server: NatsServer, tenant_broker: NatsTenantBroker, tenant: str, seed: str, count: int,
    *, event_type: str | None = None,
) -> list[Any]:
    """The first `count` messages on the tenant's stream (of type `event_type`, if given), read with the tenant's own
    credentials (what a controller sees). Other types are skipped: the sweeper's start-up pass may publish a capacity
    event for a job created meanwhile, before or between the ones a test looks for."""
    await tenant_broker.ensure_consumer(tenant, "trace-reader")
    client = await nats.connect(nats_server.url, nkeys_seed_str=seed)
    found: list[Any] = []
    try:
        js = client.jetstream(prefix=TENANT_JS_PREFIX)
        subscription = await js.pull_subscribe_bind("trace-reader", stream=tenant_stream_name(tenant))
        for _ in range(10):  # bounded: each fetch waits at most 5 s
            try:
                batch = await subscription.fetch(count - len(found), timeout=5.0)
            except nats.errors.TimeoutError:
                continue  # nothing yet: the relay has not published the rest
            for message in batch:
                await message.ack()
                if event_type is None or parse_event(message.data).type == event_type:
                    found.append(message)
            if len(found) >= count:
                break
        return found
    finally:
        await client.close()


async def test_a_requests_traceparent_reaches_the_nats_headers_of_the_events_it_caused(
    nats_settings: Settings, tenant_broker: NatsTenantBroker, nats_server: NatsServer, provider_secret: bytes
) -> None:
    bus = NatsProviderBus([nats_server.url], provider_secret=provider_secret, connect_timeout=1.0)
    options = NegotiationOptions(relay_poll_interval_s=0.05, relay_backoff_max_s=0.3, sweep_interval_s=3600.0)
    app = create_app(nats_settings, broker=tenant_broker, bus=bus, negotiation=options)
    try:
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://hz") as client:
                created = await client.post("/v1/tenants", json={"id": "acme", "display_name": "Acme"}, headers=ADMIN)
                acme = created.json()
                headers = {"Authorization": f"Bearer {acme['api_token']}"}
                await create_host(client, "h1", gpus=4, group="rack-a")
                job = {"id": "train", "min_workers": 1, "max_workers": 4, "initial_workers": 1}
                assert (await client.post("/v1/jobs", json=job, headers=headers)).status_code == 201
                traced = {**headers, "traceparent": TRACEPARENT}
                opened = await client.post(
                    "/v1/negotiations",
                    json={"job": "train", "kind": "scale", "terms": {"desired_workers": 2}},
                    headers={**traced, "Idempotency-Key": "k1"},
                )
                assert opened.status_code == 201, opened.text
                untraced = await act(client, _handle(acme), opened.json()["id"], RoundAction.ACCEPT)
                assert untraced.status_code == 200
                await eventually(lambda: app.state.relay.delivered >= 4, what="the relay publishing every row")
        offered, accepted = await _tenant_messages(
            nats_server, tenant_broker, "acme", acme["nats"]["seed"], 2, event_type="io.harmonaize.negotiation.v1"
        )
    finally:
        await bus.close()
    assert parse_event(offered.data).traceparent == TRACEPARENT
    assert offered.headers["traceparent"] == TRACEPARENT, "the header equals the event's extension"
    assert parse_event(accepted.data).traceparent is None and "traceparent" not in (accepted.headers or {})


def _handle(created: dict[str, Any]) -> TenantHandle:
    return TenantHandle(id=created["id"], token=created["api_token"], seed=created["nats"]["seed"], created=created)


async def test_the_agents_publisher_puts_the_events_traceparent_in_the_nats_headers(
    nats_server: NatsServer, tenant_broker: NatsTenantBroker, two_tenants: dict[str, UserKeys], provider_secret: bytes
) -> None:
    data = Failure(
        kind=FailureKind.GPU_ERROR, host="h-0123456789abcdef", gpu_index=0, detected_at=EPOCH,
        severity=Severity.CRITICAL,
    )
    source = agent_source("h-0123456789abcdef")
    traced = make_event(data, source=source, subject="train", traceparent=TRACEPARENT, tracestate="hz=1")
    plain = make_event(data, source=source, subject="train")
    nc = await connect_provider(nats_server.url, provider_secret, name="test-trace-publisher")
    publisher = JetStreamPublisher(nc.jetstream())
    publisher.start()
    try:
        for event in (traced, plain):
            await publisher.submit(tenant_event_subject("acme", "failure", "train"), event)
        assert await publisher.drain(5.0)
    finally:
        await publisher.close()
        await nc.close()
    first, second = await _tenant_messages(nats_server, tenant_broker, "acme", two_tenants["acme"].seed, 2)
    assert parse_event(first.data).id == traced.id
    assert (first.headers["traceparent"], first.headers["tracestate"]) == (TRACEPARENT, "hz=1")
    assert first.headers["Nats-Msg-Id"] == traced.id
    assert "traceparent" not in (second.headers or {}) and second.headers["Nats-Msg-Id"] == plain.id


def test_log_context_is_restored_and_bindings_outside_a_context_are_ignored() -> None:
    from api.log_context import bind, current

    bind(tenant="nobody")
    assert current() == {}
    with log_context(request_id="r1"):
        bind(tenant="acme", job=None)
        with log_context(event="e1"):
            assert current() == {"event": "e1"}
        assert current() == {"request_id": "r1", "tenant": "acme"}
    assert current() == {}
