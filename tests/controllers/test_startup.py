"""Fast tier: what a controller does when the provider is not there yet, or refuses it."""

from __future__ import annotations

import asyncio

import pytest

from harmonaize.events import Failure
from tenant_controllers import AuthenticationError, Controller
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.nats_source import NatsEventSource
from tenant_controllers.runtime import ControllerRuntime
from tenant_controllers.store import HandledStore
from tests.controllers.fake_provider import FakeProvider
from tests.support import eventually


def guard() -> Controller:
    ctl = Controller(tenant="acme", job="llm-finetune", name="guard")

    @ctl.on(Failure)
    async def on_failure(event: Failure) -> None: ...

    return ctl


async def test_a_refused_token_stops_the_controller_with_the_servers_reason(
    provider: FakeProvider, store: HandledStore
) -> None:
    async with ProviderApi(base_url="http://provider", token="revoked", transport=provider.transport) as api:
        source = NatsEventSource(servers="nats://127.0.0.1:9", seed="unused", api=api)
        runtime = ControllerRuntime(guard(), source=source, api=api, store=store)
        with pytest.raises(AuthenticationError, match="invalid bearer token"):
            await asyncio.wait_for(runtime.run(asyncio.Event()), timeout=10)


async def test_an_unavailable_provider_or_broker_is_retried_until_stopped(
    provider: FakeProvider, store: HandledStore
) -> None:
    provider.fail_next(2, status=503, path_contains="/event-consumers")
    async with ProviderApi(base_url="http://provider", token=provider.token, transport=provider.transport,
                           attempts=1) as api:
        source = NatsEventSource(servers="nats://127.0.0.1:9",
                                 seed="SUACSSL3UAHUDXKFSNVUZRF5UHPMWZ6BFDTJ7M6USDXIEDNPPQYYYCU3VY",
                                 api=api, connect_timeout=0.2)
        runtime = ControllerRuntime(guard(), source=source, api=api, store=store)
        stop = asyncio.Event()
        task = asyncio.create_task(runtime.run(stop))
        try:
            await eventually(lambda: len(provider.consumers) == 1, timeout=10, what="PUT accepted after two 503s")
            await eventually(lambda: len(source.errors) >= 3, timeout=10, what="still trying to reach the broker")
            assert not runtime.ready.is_set() and not task.done()
        finally:
            stop.set()
            await asyncio.wait_for(task, timeout=10)
        assert sum(r.url.path.endswith("ctl-llm-finetune-guard") for r in provider.requests) == 3
