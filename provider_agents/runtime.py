"""Process wiring for the two long-running commands: connect, build the parts, run until SIGTERM/SIGINT.

Both processes connect in the provider's NATS account with the user key derived from the provider secret
(`ProviderKeys(secret).provider`), the same identity the control plane uses, and reconnect forever: an agent outlives
broker restarts, and its publisher holds events (bounded) until the broker is back. Connecting at start-up also
retries forever, so agents may start before the broker; binding the desired-state bucket is retried by the mirror
itself, so heartbeats start as soon as the connection is up, even while JetStream is not.

An agent's telemetry is the detected source (NVML or simulated) with the inputs the settings switch on laid over it
(`provider_inputs`): the cloud's notices (HZ_CLOUD_NOTICES), NVSentinel's health events (HZ_NVSENTINEL_URL), a live
carbon API (HZ_CARBON_API). Their polling tasks start with the agent and end with it. With the control plane's
admin token, the agent also carries out the tenants' maintenance approvals (`provider_agents.approvals`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.kv import KeyValue
from pydantic import ValidationError

from broker_config.keys import ProviderKeys
from harmonaize import event_loop
from harmonaize.desired_state import HostAssignment
from harmonaize.heap import freeze_startup_heap
from harmonaize.node_failures import NodeFailureReport
from harmonaize.settings import Settings
from harmonaize.waits import wait_set
from provider_agents.agent import Agent, AgentConfig
from provider_agents.approval_memory import ApprovalMemory
from provider_agents.approvals import APPROVAL_INTERVAL_S, NoticeApprover, held_notices
from provider_agents.changes import DEFAULT_CARBON_EVERY
from provider_agents.control_plane import ControlPlane, ControlPlaneRefusal
from provider_agents.desired import FleetView, ensure_desired_state_bucket
from provider_agents.fleet_monitor import FleetMonitor
from provider_agents.markers import cloud_id
from provider_agents.micro_loop import MicroLoop
from provider_agents.node_launcher import FailureSink, LauncherConfig, NodeLauncher
from provider_agents.node_watch import WATCH_INTERVAL_S
from provider_agents.publisher import CoreSink, JetStreamPublisher
from provider_agents.rendezvous_host import RendezvousHost, ensure_rendezvous_bucket, lookup_endpoint
from provider_agents.telemetry.carbon_apis import (
    ELECTRICITY_MAPS_URL,
    WATTTIME_URL,
    CarbonFeed,
    ElectricityMapsFeed,
    WattTimeFeed,
)
from provider_agents.telemetry.detect import ProviderInputs, SourceKind, detect_source, host_region
from provider_agents.telemetry.gpu_health import NvSentinelPoller
from provider_agents.telemetry.notices import (
    AwsInstanceNotices,
    AzureScheduledEvents,
    GcpMaintenanceNotices,
    PollingChannel,
    SignalChannel,
)
from provider_agents.telemetry.notices.aws import AWS_IMDS_URL
from provider_agents.telemetry.notices.azure import AZURE_IMDS_URL
from provider_agents.telemetry.notices.gcp import GCP_METADATA_URL
from provider_agents.telemetry.scenario import SCENARIO_INJECT_SUBJECT, Scenario, ScenarioInjection, load_scenario
from provider_agents.telemetry.simulated import SimulatedHost
from provider_agents.telemetry.source import TelemetrySource
from provider_agents.testbed.layout import TestbedLayout
from provider_agents.testbed.source import TestbedSource

__all__ = [
    "AgentOptions",
    "MonitorOptions",
    "SettingsError",
    "connect_provider",
    "provider_inputs",
    "run_agent",
    "run_fleet_monitor",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

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
    launch: bool = True
    work_dir: Path | None = None
    checkpoint_root: Path | None = None
    grace_s: float = 30.0
    stop_nodes_on_exit: bool = True
    testbed_layout: Path | None = None
    """The host is a namespace of this testbed: its network is measured (`provider_agents.testbed.source`)."""


@dataclass(frozen=True)
class MonitorOptions:
    check_interval_s: float | None = None
    rendezvous_bind: str = "127.0.0.1"
    rendezvous_advertise: str | None = None
    micro_loop_interval_s: float = 0.5


def control_plane(settings: Settings) -> ControlPlane:
    """The provider components' client of the control plane (HZ_API_URL, HZ_ADMIN_TOKEN)."""
    if settings.admin_token is None or not settings.admin_token.get_secret_value():
        raise SettingsError("HZ_ADMIN_TOKEN is not set (provider components report to the control plane with it)")
    return ControlPlane(settings.resolved_api_url, settings.admin_token.get_secret_value())


async def _every(
    interval_s: float, work: Callable[[], Awaitable[object]], stop: asyncio.Event, *, abandon_on_stop: bool = False
) -> None:
    """Run `work` every `interval_s` until `stop`.

    `abandon_on_stop`: a pass still running when `stop` is set is cancelled instead of awaited. For passes whose
    only effect is to report level state (progress), which the next agent reports again: otherwise a control plane
    that is away holds the agent's shutdown for its whole retry schedule (5 attempts x 5 s).
    """
    while not stop.is_set():
        try:
            if abandon_on_stop:
                await _unless_stopped(work(), stop)
            else:
                await work()
        except Exception as exc:  # one failed pass (broker or API briefly away) must not end the loop
            log.warning("%s failed: %r", getattr(work, "__name__", "pass"), exc)
        await wait_set(stop, interval_s)


async def _unless_stopped(work: Awaitable[object], stop: asyncio.Event) -> None:
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(stopping, return_exceptions=True)
    try:
        await task
    except asyncio.CancelledError:
        if not stop.is_set():
            raise


def provider_secret(settings: Settings) -> bytes:
    if settings.provider_secret is None or not settings.provider_secret.get_secret_value():
        raise SettingsError("HZ_PROVIDER_SECRET is not set (the provider's root secret, shared with the control plane)")
    return settings.provider_secret.get_secret_value().encode()


async def connect_provider(servers: str | Sequence[str], secret: bytes, *, name: str) -> Client:
    """A connection in the provider's account that reconnects forever; losing it is a warning, closing it is not."""
    connected: list[Client] = []

    async def on_error(exc: Exception) -> None:
        log.info("%s: broker connection: %r", name, exc)

    async def on_disconnect() -> None:
        if connected and connected[0].is_closed:
            log.debug("%s: connection to the broker closed", name)
        else:
            log.warning("%s: connection to the broker lost", name)

    async def on_reconnect() -> None:
        log.info("%s: reconnected to the broker", name)

    client = await nats.connect(
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
    connected.append(client)
    return client


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _stop_on_signals(stop: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()
    for sig in _SIGNALS:
        try:
            loop.add_signal_handler(sig, stop)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals on this platform
            pass


def _default_signals() -> None:
    """Hand the signals back before the loop closes: uvloop leaves a handler behind otherwise, which then swallows
    SIGTERM for the rest of the process."""
    loop = asyncio.get_running_loop()
    for sig in _SIGNALS:
        try:
            loop.remove_signal_handler(sig)
        except (NotImplementedError, RuntimeError):
            pass


async def run_agent(settings: Settings, options: AgentOptions) -> None:
    """Run one host agent (telemetry, heartbeats and, with `launch`, the node launcher) until a signal."""
    secret = provider_secret(settings)
    scenario = load_scenario(options.scenario) if options.scenario is not None else None
    base = _telemetry_source(options, scenario)
    region = host_region(options.host, scenario=scenario, region=options.region)
    inputs = provider_inputs(settings, options.host, region=region)  # polls only once started, below
    source = inputs.wrap(base)
    log.info(
        "host %s: telemetry from %s (inputs: %s), group %s; event loop %s",
        options.host, type(base).__name__, inputs.describe(), source.locality_group, event_loop.running_loop_name(),
    )
    control = control_plane(settings) if options.launch else None
    reporter = control or _approval_reporter(settings)
    nc = await connect_provider(settings.nats_url, secret, name=f"hz-agent-{options.host}")
    publisher = JetStreamPublisher(nc.jetstream(), max_pending=options.max_pending)
    fleet = FleetView(lambda: ensure_desired_state_bucket(nc.jetstream(), replicas=settings.broker_replicas))
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    launcher: NodeLauncher | None = None
    try:
        fleet.start()
        publisher.start()
        inputs.start()
        if control is not None:
            local_addr = base.layout.host(options.host).data_address if isinstance(base, TestbedSource) else None
            launcher = _launcher(settings, options, nc, secret, control, local_addr=local_addr)
            tasks += _launcher_loops(launcher, fleet, options.host, stop)
        agent = Agent(
            AgentConfig(host=options.host, tick_s=options.tick_s, carbon_every=options.carbon_every),
            source=source,
            desired=fleet,
            sink=publisher,
            secret=secret,
            raw=CoreSink(nc),
            waiting=launcher.waiting_jobs if launcher is not None else None,
        )
        if reporter is not None:
            tasks.append(_approval_loop(settings, options, agent, inputs, fleet, secret, reporter, stop))
        await _accept_injections(nc, base, options.host)

        def on_signal() -> None:
            stop.set()
            agent.stop()

        _stop_on_signals(on_signal)
        freeze_startup_heap()  # full GC passes over the start-up heap would stall publishing (see harmonaize.heap)
        await agent.run()
    finally:
        try:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            await inputs.stop()  # the agent samples no more: its polling ends before a node's grace period
            if launcher is not None:
                await launcher.shutdown(stop_nodes=options.stop_nodes_on_exit)
            await fleet.stop()
            await publisher.close()
            await nc.close()
            if reporter is not None:
                await reporter.close()  # the launcher's client too, when it is the same one
        finally:
            _default_signals()  # only now: a signal during the shutdown above must not kill it halfway


def _work_dir(settings: Settings, options: AgentOptions) -> Path:
    return options.work_dir or settings.data_dir / "hosts" / options.host


def _approval_reporter(settings: Settings) -> ControlPlane | None:
    """The control plane client approvals report to when no launcher made one: none without an admin token (then
    tenants' approvals of this host's notices wait for the sweeper, which records them as not approved)."""
    if settings.admin_token is None or not settings.admin_token.get_secret_value():
        log.info("no HZ_ADMIN_TOKEN: this agent carries out no maintenance approvals")
        return None
    return control_plane(settings)


def _approval_loop(
    settings: Settings, options: AgentOptions, agent: Agent, inputs: ProviderInputs, fleet: FleetView,
    secret: bytes, reporter: ControlPlane, stop: asyncio.Event,
) -> asyncio.Task[None]:
    approver = NoticeApprover(
        host=options.host,
        secret=secret,
        assignment=lambda: fleet.assignment(options.host),
        notices=lambda: held_notices(agent.telemetry, inputs.channels),
        reporter=reporter,
        memory=ApprovalMemory(_work_dir(settings, options) / "approvals.json"),
    )
    work = _every(APPROVAL_INTERVAL_S, approver.step, stop)
    return asyncio.get_running_loop().create_task(work, name=f"hz-approvals-{options.host}")


def _telemetry_source(options: AgentOptions, scenario: Scenario | None) -> TelemetrySource:
    """The host's telemetry: detected (NVML or simulated); on a testbed host, the simulation's GPUs and carbon with
    the network measured from the testbed's links."""
    kind = SourceKind.SIMULATED if options.testbed_layout is not None else options.source
    source = detect_source(
        options.host,
        kind=kind,
        scenario=scenario,
        locality_group=options.locality_group,
        gpus=options.gpus,
        region=options.region,
        seed=options.seed,
    )
    if options.testbed_layout is None:
        return source
    try:
        layout = TestbedLayout.load(options.testbed_layout)
        layout.host(options.host)
    except (OSError, ValueError, KeyError) as exc:
        raise SettingsError(f"testbed layout {options.testbed_layout}: {exc}") from None
    assert isinstance(source, SimulatedHost)
    return TestbedSource(source, layout)


def provider_inputs(settings: Settings, host: str, *, region: str) -> ProviderInputs:
    """The polled inputs the settings switch on for `host` (whose grid zone is `region`); nothing is started yet."""
    channels: list[SignalChannel] = []
    if settings.cloud_notices != "none":
        channels.append(_notice_channel(settings))
    if settings.nvsentinel_url is not None:
        channels.append(NvSentinelPoller(settings.nvsentinel_url, node_name=settings.nvsentinel_node or host))
    return ProviderInputs(channels=tuple(channels), carbon=_carbon_feed(settings, region))


def _notice_channel(settings: Settings) -> PollingChannel:
    vm = _needed(settings.cloud_vm_name, "HZ_CLOUD_VM_NAME", f"HZ_CLOUD_NOTICES={settings.cloud_notices}")
    url = settings.cloud_metadata_url
    match settings.cloud_notices:
        case "azure":
            return AzureScheduledEvents(vm_name=vm, base_url=url or AZURE_IMDS_URL)
        case "aws":
            return AwsInstanceNotices(instance_id=vm, base_url=url or AWS_IMDS_URL)
        case "gcp":
            return GcpMaintenanceNotices(vm_name=vm, base_url=url or GCP_METADATA_URL)
    raise SettingsError(f"HZ_CLOUD_NOTICES: no notice channel for {settings.cloud_notices!r}")


def _carbon_feed(settings: Settings, region: str) -> CarbonFeed | None:
    """The carbon API's feed: WattTime's region read as the host's zone; Electricity Maps' zone, else the host's."""
    url, chosen = settings.carbon_api_url, f"HZ_CARBON_API={settings.carbon_api}"
    try:
        match settings.carbon_api:
            case "watttime":
                return WattTimeFeed(
                    _needed(settings.watttime_username, "HZ_WATTTIME_USERNAME", chosen),
                    _needed(settings.watttime_password, "HZ_WATTTIME_PASSWORD", chosen).get_secret_value(),
                    region=_needed(settings.watttime_region, "HZ_WATTTIME_REGION", chosen),
                    zone=region,
                    base_url=url or WATTTIME_URL,
                )
            case "electricitymaps":
                token = _needed(settings.electricitymaps_token, "HZ_ELECTRICITYMAPS_TOKEN", chosen)
                zone = settings.electricitymaps_zone or region
                return ElectricityMapsFeed(token.get_secret_value(), zone=zone, base_url=url or ELECTRICITY_MAPS_URL)
    except ValueError as exc:
        raise SettingsError(f"{chosen}: {exc}") from None
    return None


def _needed(value: _T | None, variable: str, chosen: str) -> _T:
    """A setting the chosen input needs. `Settings` already refuse to start without it; this holds for copies that
    skipped validation too."""
    if value is None:
        raise SettingsError(f"{variable} is not set (required with {chosen})")
    return value


async def _accept_injections(nc: Client, source: object, host: str) -> None:
    """Let `harmonaize scenario run` add episodes to a simulated host while it runs (a real host ignores them)."""
    inject = getattr(source, "inject", None)

    async def on_inject(msg: Msg) -> None:
        try:
            request = ScenarioInjection.model_validate_json(msg.data)
        except ValidationError as exc:
            log.warning("host %s: ignoring a malformed scenario injection: %s", host, exc.errors()[:1])
            return
        if inject is None:
            reply = {"host": host, "applied": False, "reason": "not a simulated host"}
        else:
            inject(request.scenario, at=request.at)
            reply = {"host": host, "applied": True}
            log.info("host %s: scenario injected, starting %s", host, request.at.isoformat())
        if msg.reply:
            await nc.publish(msg.reply, json.dumps(reply).encode())

    await nc.subscribe(SCENARIO_INJECT_SUBJECT, cb=on_inject)


def _launcher(
    settings: Settings, options: AgentOptions, nc: Client, secret: bytes, control: ControlPlane,
    *, local_addr: str | None = None,
) -> NodeLauncher:
    rendezvous: list[KeyValue] = []

    async def endpoint(tenant: str, job: str) -> str | None:
        if not rendezvous:
            rendezvous.append(await ensure_rendezvous_bucket(nc.jetstream(), replicas=settings.broker_replicas))
        return await lookup_endpoint(rendezvous[0], tenant, job)

    config = LauncherConfig(
        host=options.host,
        work_dir=_work_dir(settings, options),
        checkpoint_root=options.checkpoint_root or settings.data_dir / "checkpoints",
        cloud=cloud_id(secret, settings.data_dir),
        grace_s=options.grace_s,
        local_addr=local_addr,
    )
    return NodeLauncher(
        config,
        secret=secret,
        endpoints=endpoint,
        on_progress=control.report_progress,
        on_failure=_failure_sink(control),
    )


def _failure_sink(control: ControlPlane) -> FailureSink:
    async def report(failure: NodeFailureReport) -> None:
        try:
            outcome = await control.report_node_failure(failure)
        except ControlPlaneRefusal as exc:  # a refused report stays refused: log it instead of retrying
            log.error("control plane refused the node failure of %s/%s on %s: %s",
                      failure.tenant, failure.job, failure.host, exc.reason)
            return
        log.warning("node failure of %s/%s on %s (%s, epoch %d) reported: %s",
                    failure.tenant, failure.job, failure.host, failure.reason.value, failure.epoch, outcome)

    return report


def _launcher_loops(
    launcher: NodeLauncher, fleet: FleetView, host: str, stop: asyncio.Event
) -> list[asyncio.Task[None]]:
    def assignment() -> HostAssignment | None:
        if not fleet.loaded:
            return None
        return fleet.assignment(host) or HostAssignment(
            host=host, locality_group="unassigned", generation=0, updated_at=datetime.now(UTC)
        )

    async def converge() -> None:
        await launcher.converge(assignment())

    async def relay() -> None:
        await launcher.relay_progress(assignment())

    async def watch() -> None:
        await launcher.watch()

    loop = asyncio.get_running_loop()
    return [
        loop.create_task(_every(0.1, converge, stop), name=f"hz-launcher-{host}"),
        loop.create_task(_every(0.2, relay, stop, abandon_on_stop=True), name=f"hz-progress-{host}"),
        loop.create_task(_every(WATCH_INTERVAL_S, watch, stop, abandon_on_stop=True), name=f"hz-watch-{host}"),
    ]


async def run_fleet_monitor(settings: Settings, options: MonitorOptions) -> None:
    """Run the provider's central loops until a signal: fleet monitor, rendezvous stores, micro loop."""
    secret = provider_secret(settings)
    control = control_plane(settings)
    nc = await connect_provider(settings.nats_url, secret, name="hz-fleet-monitor")
    publisher = JetStreamPublisher(nc.jetstream())
    fleet = FleetView(lambda: ensure_desired_state_bucket(nc.jetstream(), replicas=settings.broker_replicas))
    try:
        fleet.start()
        publisher.start()
        monitor = FleetMonitor(
            desired=fleet, sink=publisher, secret=secret, check_interval_s=options.check_interval_s, reporter=control
        )
        rendezvous = RendezvousHost(
            desired=fleet,
            bucket=lambda: ensure_rendezvous_bucket(nc.jetstream(), replicas=settings.broker_replicas),
            bind_host=options.rendezvous_bind,
            advertise_host=options.rendezvous_advertise,
        )
        micro = MicroLoop(desired=fleet, control_plane=control, interval_s=options.micro_loop_interval_s)

        def on_signal() -> None:
            monitor.stop()
            rendezvous.stop()
            micro.stop()

        _stop_on_signals(on_signal)
        await asyncio.gather(monitor.run(nc), rendezvous.run(), micro.run(nc))
    finally:
        try:
            await fleet.stop()
            await publisher.close()
            await nc.close()
            await control.close()
        finally:
            _default_signals()
