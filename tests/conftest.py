"""Fixtures shared by every test tier: a real nats-server on a free port with our rendered config."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Mapping
from pathlib import Path

import pytest

from broker_config.accounts import TenantAccount, UserKeys
from broker_config.keys import ProviderKeys
from broker_config.provisioner import NatsTenantBroker
from broker_config.render import render_accounts
from broker_config.server import NatsServer
from harmonaize.event_loop import resolve_event_loop

PROVIDER_SECRET = b"test-provider-secret-0123456789abcdef"
_NATS_SERVER = pytest.StashKey[NatsServer]()

ON_BOTH_LOOPS = frozenset({"test_pull_stream.py", "test_agents_publisher.py", "test_real_broker.py"})
"""Modules whose async tests also run on uvloop, the loop the shipped processes use where it is installed: the code
that talks to the broker across reconnects and restarts (continuous pull, publish-until-acked, the runtime over a real
broker), where two loops could differ in callback order or socket handling. The rest run on asyncio only; the CLI
processes that tests start (controllers, agents, the fault tests' publishers) run on the default, i.e. uvloop."""


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
    if item.path.name in ON_BOTH_LOOPS and resolve_event_loop("auto") == "uvloop":
        import uvloop

        factories["uvloop"] = uvloop.new_event_loop
    return factories


@pytest.fixture(autouse=True)
def _clean_hz_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test builds its own Settings; a developer's HZ_* variables must not leak into it."""
    for name in list(os.environ):
        if name.startswith("HZ_") and not name.startswith("HZ_TEST_"):
            monkeypatch.delenv(name)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A test that failed (in set-up, body or teardown) with the `nats_server` fixture reports that server's state
    and log tail: a broker that refused connections midway once left nothing to tell whether it had exited, and why."""
    report = yield
    server = item.stash.get(_NATS_SERVER, None)
    if report.failed and server is not None:
        report.sections.append((f"nats-server ({report.when})", server.describe()))
    return report


@pytest.fixture
def provider_secret() -> bytes:
    return PROVIDER_SECRET


@pytest.fixture
def nats_server(request: pytest.FixtureRequest, tmp_path: Path, provider_secret: bytes) -> Iterator[NatsServer]:
    """A nats-server from the wheel, on a free port, serving our accounts (no tenants yet)."""
    server = NatsServer(tmp_path / "nats", accounts_text=render_accounts(ProviderKeys(provider_secret), []))
    request.node.stash[_NATS_SERVER] = server  # for the failure report above
    server.start()
    yield server
    server.stop()


@pytest.fixture
def tenant_broker(nats_server: NatsServer, provider_secret: bytes) -> NatsTenantBroker:
    return NatsTenantBroker(
        servers=[nats_server.url],
        provider_secret=provider_secret,
        accounts_file=nats_server.accounts_file,
        reload=nats_server.reload,
    )


@pytest.fixture
async def two_tenants(tenant_broker: NatsTenantBroker) -> AsyncIterator[dict[str, UserKeys]]:
    """acme and globex, registered with the broker; their user keys."""
    keys = {name: tenant_broker.new_user_keys() for name in ("acme", "globex")}
    await tenant_broker.apply([TenantAccount(name, k.public_key) for name, k in keys.items()])
    yield keys
