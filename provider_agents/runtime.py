"""Process wiring for the two long-running commands: connect, build the parts, run until SIGTERM/SIGINT.

Both processes connect in the provider's NATS account with the user key derived from the provider secret
(`ProviderKeys(secret).provider`), the same identity the control plane uses, and reconnect forever: an agent outlives
broker restarts, and its publisher holds events (bounded) until the broker is back. Connecting at start-up also
retries forever, so agents may start before the broker; binding the desired-state bucket is retried by the mirror
itself, so heartbeats start as soon as the connection is up, even while JetStream is not.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
import nats
from nats.aio.client import Client

from broker_config.keys import ProviderKeys
from harmonaize.settings import Settings
from provider_agents.agent import Agent, AgentConfig
from provider_agents.changes import DEFAULT_CARBON_EVERY
from provider_agents.desired import FleetView, ensure_desired_state_bucket
from provider_agents.fleet_monitor import FleetMonitor
from provider_agents.publisher import CoreSink, JetStreamPublisher
from provider_agents.telemetry.detect import SourceKind, detect_source
from provider_agents.telemetry.scenario import load_scenario

__all__ = ["AgentOptions", "MonitorOptions", "SettingsError", "connect_provider", "run_agent", "run_fleet_monitor"]

log = logging.getLogger(__name__)

class SettingsError(ValueError):
    """Configuration the process cannot run with; the message names the variable."""


@dataclass(frozen=True)
class AgentOptions:
    host: str
    locality_group: str | None = None
    gpus: int | None = None
    region: str | None = None
    scenario: Path | None = None
    seed: int | None = None
    source: SourceKind = SourceKind.AUTO
    tick_s: float = 1.0
    carbon_every: int = DEFAULT_CARBON_EVERY
    max_pending: int = 1024


@dataclass(frozen=True)
class MonitorOptions:
    check_interval_s: float | None = None


def provider_secret(settings: Settings) -> bytes:
    if settings.provider_secret is None or not settings.provider_secret.get_secret_value():
        raise SettingsError("HZ_PROVIDER_SECRET is not set (the provider's root secret, shared with the control plane)")
    return settings.provider_secret.get_secret_value().encode()


async def connect_provider(servers: str | Sequence[str], secret: bytes, *, name: str) -> Client:
    """A connection in the provider's account that reconnects forever."""

    async def on_error(exc: Exception) -> None:
        log.info("%s: broker connection: %r", name, exc)

    async def on_disconnect() -> None:
        log.warning("%s: connection to the broker lost or closed", name)

    async def on_reconnect() -> None:
        log.info("%s: reconnected to the broker", name)

    return await nats.connect(
        servers=[servers] if isinstance(servers, str) else list(servers),
        nkeys_seed_str=ProviderKeys(secret).provider.seed,
        name=name,
        allow_reconnect=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=2.0,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )


def _stop_on_signals(stop: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals on this platform
            pass


async def run_agent(settings: Settings, options: AgentOptions) -> None:
    """Run one host agent until a signal."""
    secret = provider_secret(settings)
    scenario = load_scenario(options.scenario) if options.scenario is not None else None
    source = detect_source(
        options.host,
        kind=options.source,
        scenario=scenario,
        locality_group=options.locality_group,
        gpus=options.gpus,
        region=options.region,
        seed=options.seed,
    )
    log.info("host %s: telemetry from %s, group %s", options.host, type(source).__name__, source.locality_group)
    nc = await connect_provider(settings.nats_url, secret, name=f"hz-agent-{options.host}")
    publisher = JetStreamPublisher(nc.jetstream(), max_pending=options.max_pending)
    fleet = FleetView(lambda: ensure_desired_state_bucket(nc.jetstream()))
    try:
        fleet.start()
        publisher.start()
        agent = Agent(
            AgentConfig(host=options.host, tick_s=options.tick_s, carbon_every=options.carbon_every),
            source=source,
            desired=fleet,
            sink=publisher,
            secret=secret,
            raw=CoreSink(nc),
        )
        _stop_on_signals(agent.stop)
        await agent.run()
    finally:
        await fleet.stop()
        await publisher.close()
        await nc.close()


async def run_fleet_monitor(settings: Settings, options: MonitorOptions) -> None:
    """Run the fleet monitor until a signal."""
    secret = provider_secret(settings)
    nc = await connect_provider(settings.nats_url, secret, name="hz-fleet-monitor")
    publisher = JetStreamPublisher(nc.jetstream())
    fleet = FleetView(lambda: ensure_desired_state_bucket(nc.jetstream()))
    try:
        fleet.start()
        publisher.start()
        monitor = FleetMonitor(desired=fleet, sink=publisher, secret=secret, check_interval_s=options.check_interval_s)
        _stop_on_signals(monitor.stop)
        await monitor.run(nc)
    finally:
        await fleet.stop()
        await publisher.close()
        await nc.close()
