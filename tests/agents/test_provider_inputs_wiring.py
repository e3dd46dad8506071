"""The provider inputs an agent switches on by configuration: cloud notices, NVSentinel, a carbon API.

Settings name the variable a chosen input misses (the CLI prints it as one line and exits 2); the settings build the
channels and feed they describe; the parts they are composed of behave (NVSentinel in the notice overlay, a live
carbon feed over a source, the shared polling core); and one end-to-end run of the real agent runtime (`run_agent`,
what `harmonaize agent` runs) against a nats-server from the wheel and the Azure metadata emulator: a Preempt for
this VM reaches the tenant whose job runs on the host as a `maintenance` event on the tenant's own subject, and
SIGTERM stops the agent with its polling tasks and every other task of its own gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import pytest
from nats.js.kv import KeyValue
from pydantic import SecretStr, ValidationError

from broker_config.accounts import UserKeys
from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from harmonaize.cli_errors import describe_settings_error
from harmonaize.events import MaintenanceKind, MaintenanceStatus
from harmonaize.pseudonyms import host_pseudonym
from harmonaize.settings import Settings
from harmonaize.subjects import tenant_events_filter
from provider_agents import runtime
from provider_agents.clock import ManualClock
from provider_agents.runtime import AgentOptions, provider_inputs, run_agent
from provider_agents.telemetry import CarbonReading, RawFailureKind, SimulatedHost
from provider_agents.telemetry.carbon_apis import ElectricityMapsFeed, LiveCarbonSource, WattTimeFeed
from provider_agents.telemetry.detect import SourceKind
from provider_agents.telemetry.gpu_health import NvSentinelPoller
from provider_agents.telemetry.notices import AwsInstanceNotices, GcpMaintenanceNotices, NoticeOverlay
from provider_agents.telemetry.polling import Backoff, PollHealth, PollState, http_client, retry_after_s
from tests.agents.cloud_notice_emulator import CloudNoticeEmulator
from tests.agents.conftest import TenantReader, event_text, put_assignment, tenant_reader
from tests.agents.fakes import START, assignment
from tests.agents.input_emulator import FakeNvSentinel, FakeWattTime, health_event, running_emulator, watttime_forecast
from tests.support import eventually

VM = "myVm_0"
AZURE = "/metadata/scheduledevents"
PREEMPT_ID = "f020ba2e-3bc0-4c40-a10b-86575a9eabd5"  # the id in Azure's documented example
REBOOT_ID = "c9bd3d1e-4fe9-41a9-8ea6-07c4b4ba1d0d"
T0 = START  # a fixed time for documents whose age does not matter


def settings_from(monkeypatch: pytest.MonkeyPatch, **variables: str) -> Settings:
    """Settings as a process reads them: from HZ_ variables (the autouse fixture cleared the developer's own)."""
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    return Settings(_env_file=None)  # no .env of the working directory either


# --- settings ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"HZ_CLOUD_NOTICES": "azure"}, "HZ_CLOUD_VM_NAME"),
        ({"HZ_CLOUD_NOTICES": "gcp", "HZ_CLOUD_VM_NAME": " "}, "HZ_CLOUD_VM_NAME"),
        ({"HZ_CLOUD_NOTICES": "oracle", "HZ_CLOUD_VM_NAME": VM}, "HZ_CLOUD_NOTICES"),
        ({"HZ_CLOUD_NOTICES": "aws", "HZ_CLOUD_VM_NAME": "i-0123 456"}, "HZ_CLOUD_VM_NAME"),
        ({"HZ_CLOUD_NOTICES": "azure", "HZ_CLOUD_VM_NAME": VM, "HZ_CLOUD_METADATA_URL": "169.254.169.254"},
         "HZ_CLOUD_METADATA_URL"),
        ({"HZ_NVSENTINEL_URL": "relay:8080/events"}, "HZ_NVSENTINEL_URL"),
        ({"HZ_CARBON_API": "watttime"}, "HZ_WATTTIME_USERNAME"),
        ({"HZ_CARBON_API": "watttime", "HZ_WATTTIME_USERNAME": "u", "HZ_WATTTIME_REGION": "CAISO_NORTH"},
         "HZ_WATTTIME_PASSWORD"),
        ({"HZ_CARBON_API": "watttime", "HZ_WATTTIME_USERNAME": "u", "HZ_WATTTIME_PASSWORD": "p"},
         "HZ_WATTTIME_REGION"),
        ({"HZ_CARBON_API": "electricitymaps"}, "HZ_ELECTRICITYMAPS_TOKEN"),
        ({"HZ_CARBON_API": "electricitymaps", "HZ_ELECTRICITYMAPS_TOKEN": ""}, "HZ_ELECTRICITYMAPS_TOKEN"),
        ({"HZ_CARBON_API": "electricitymaps", "HZ_ELECTRICITYMAPS_TOKEN": "k", "HZ_ELECTRICITYMAPS_ZONE": "germany"},
         "HZ_ELECTRICITYMAPS_ZONE"),
        ({"HZ_CARBON_API": "carbonara"}, "HZ_CARBON_API"),
    ],
)
def test_a_chosen_input_without_what_it_needs_is_an_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], named: str
) -> None:
    with pytest.raises(ValidationError) as raised:
        settings_from(monkeypatch, **variables)
    assert describe_settings_error(raised.value).startswith(f"bad configuration: {named}: ")


def test_the_inputs_are_off_by_default_and_keys_matter_only_for_the_chosen_one(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_from(monkeypatch)
    assert (settings.cloud_notices, settings.carbon_api, settings.nvsentinel_url) == ("none", "none", None)
    assert provider_inputs(settings, "h1", region="DE").describe() == "none"

    chosen = settings_from(
        monkeypatch,
        HZ_CARBON_API="watttime",
        HZ_WATTTIME_USERNAME="wt-user",
        HZ_WATTTIME_PASSWORD="wt-secret",
        HZ_WATTTIME_REGION="CAISO_NORTH",
        HZ_ELECTRICITYMAPS_ZONE="DE",  # another service's: neither required nor in the way
    )
    assert isinstance(chosen.watttime_password, SecretStr) and "wt-secret" not in repr(chosen)
    assert chosen.electricitymaps_token is None


async def test_the_settings_build_the_channels_and_the_feed_they_name(monkeypatch: pytest.MonkeyPatch) -> None:
    gcp = settings_from(
        monkeypatch,
        HZ_CLOUD_NOTICES="gcp",
        HZ_CLOUD_VM_NAME="vm-1",
        HZ_NVSENTINEL_URL="http://127.0.0.1:9/events",
        HZ_CARBON_API="electricitymaps",
        HZ_ELECTRICITYMAPS_TOKEN="em-key",
    )
    inputs = provider_inputs(gcp, "h1", region="DE")
    try:
        notices, health = inputs.channels
        assert isinstance(notices, GcpMaintenanceNotices) and notices.vm_name == "vm-1"
        assert isinstance(health, NvSentinelPoller) and health.name == "nvsentinel:h1", "the node is the host id"
        assert isinstance(inputs.carbon, ElectricityMapsFeed) and inputs.carbon.zone == "DE", "the host's zone"
    finally:
        await inputs.stop()  # never started: closes their clients

    aws = settings_from(
        monkeypatch,
        HZ_CLOUD_NOTICES="aws",
        HZ_CLOUD_VM_NAME="i-0123456789abcdef0",
        HZ_NVSENTINEL_URL="",
        HZ_CARBON_API="watttime",
        HZ_WATTTIME_USERNAME="u",
        HZ_WATTTIME_PASSWORD="p",
        HZ_WATTTIME_REGION="CAISO_NORTH",
    )
    inputs = provider_inputs(aws, "h1", region="US-CAL-CISO")
    try:
        (notices,) = inputs.channels
        assert isinstance(notices, AwsInstanceNotices) and notices.instance_id == "i-0123456789abcdef0"
        assert isinstance(inputs.carbon, WattTimeFeed)
        assert (inputs.carbon.region, inputs.carbon.zone) == ("CAISO_NORTH", "US-CAL-CISO"), "read as the host's zone"
    finally:
        await inputs.stop()


def test_the_agent_command_names_the_missing_variable_and_exits_2(tmp_path: Path, provider_secret: bytes) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HZ_")}
    env.update(HZ_PROVIDER_SECRET=provider_secret.decode(), HZ_CLOUD_NOTICES="azure")
    result = subprocess.run(
        [sys.executable, "-m", "provider_agents.cli", "agent", "--host-id", "h1", "--no-launch"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "harmonaize: bad configuration: HZ_CLOUD_VM_NAME: required when HZ_CLOUD_NOTICES=azure"
    ]


# --- the parts the wiring composes ----------------------------------------------------------------------------------


async def test_nvsentinel_signals_join_the_overlays_failures() -> None:
    """NVSentinel as one more signal channel: its signals land in `failures` beside the base source's."""
    with running_emulator() as emulator:
        relay = FakeNvSentinel(emulator, events=[health_event(node="h1", at=T0, gpu=3, codes=("79",))])
        poller = NvSentinelPoller(relay.url, node_name="h1", interval_s=0.05, timeout_s=1.0)
        async with NoticeOverlay(SimulatedHost("h1", gpus=4, seed=1), channels=[poller]) as overlay:
            await eventually(lambda: bool(overlay.sample().failures), what="NVSentinel's signal in a sample")
        assert not poller.health.failing
    (signal_,) = overlay.sample().failures
    assert (signal_.kind, signal_.gpu_index, signal_.reason) == (RawFailureKind.GPU_ERROR, 3, "xid_79")


class _Feed:
    def __init__(self) -> None:
        self.reading: CarbonReading | None = None
        self.asked: list[datetime] = []

    def current(self, at: datetime | None = None) -> CarbonReading | None:
        assert at is not None
        self.asked.append(at)
        return self.reading


def test_a_live_carbon_feed_is_the_sources_carbon_while_it_has_a_fresh_reading() -> None:
    clock = ManualClock(T0)
    base = SimulatedHost("h1", gpus=2, seed=1, region="DE", clock=clock)
    feed = _Feed()
    source = LiveCarbonSource(base, feed=feed)
    replayed = base.sample().carbon
    assert replayed is not None and source.sample().carbon == replayed, "no reading yet: the source's own curve"
    feed.reading = CarbonReading(region="DE", g_per_kwh=123.0, observed_at=T0)
    assert source.sample().carbon == feed.reading
    assert feed.asked[-1] == T0, "asked as of the sample's time"
    feed.reading = None  # stale
    assert source.sample().carbon == replayed


def test_the_polling_core_logs_a_streak_once_per_kind_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("tests.polling")
    state = PollState("relay", first_backoff_s=1.0, max_backoff_s=5.0, logger=logger)
    with caplog.at_level(logging.DEBUG, logger="tests.polling"):
        delays = [state.failed("HTTP 503", "HTTP 503") for _ in range(3)]
        delays.append(state.failed("timeout", "no answer", retry_after_s=None))
        delays.append(state.failed("HTTP 429", "HTTP 429", retry_after_s=60.0))
        state.succeeded()
        state.succeeded()
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0], "doubling, capped; a Retry-After within the cap"
    levels = [(r.levelno, r.getMessage().split(";")[0]) for r in caplog.records if r.levelno >= logging.INFO]
    assert levels == [
        (logging.WARNING, "relay: HTTP 503"),
        (logging.WARNING, "relay: no answer"),
        (logging.WARNING, "relay: HTTP 429"),
        (logging.INFO, "relay: answering again after 5 failed polls"),
    ]
    assert (state.health, state.next_delay_s(10.0)) == (PollHealth(2, 5, False, "HTTP 429"), 10.0)

    backoff = Backoff(first_s=1.0, cap_s=600.0)
    assert backoff.failed(retry_after_s=retry_after_s({"Retry-After": "120"})) == 120.0
    later = format_datetime(T0 + timedelta(seconds=90), usegmt=True)
    assert retry_after_s({"Retry-After": later}, now=T0) == 90.0
    assert retry_after_s({"Retry-After": "soon"}) is None and retry_after_s({}) is None


async def test_clients_ignore_proxy_variables_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    local, public = http_client("http://169.254.169.254/", timeout_s=1.0), http_client(timeout_s=1.0, trust_env=True)
    try:
        assert (local.trust_env, public.trust_env) == (False, True)
        assert str(local.base_url) == "http://169.254.169.254" and local.timeout.read == 1.0
    finally:
        await local.aclose()
        await public.aclose()


# --- end to end ----------------------------------------------------------------------------------------------------


def rfc1123(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%a, %d %b %Y %H:%M:%S GMT")


def azure_document(incarnation: int, *events: dict[str, Any]) -> dict[str, Any]:
    return {"DocumentIncarnation": incarnation, "Events": list(events)}


def azure_event(
    event_id: str, kind: str, *, at: datetime, resources: tuple[str, ...], duration_s: int
) -> dict[str, Any]:
    """An event as Azure's Scheduled Events documentation shows it."""
    return {
        "EventId": event_id,
        "EventType": kind,
        "ResourceType": "VirtualMachine",
        "Resources": list(resources),
        "EventStatus": "Scheduled",
        "NotBefore": rfc1123(at),
        "Description": "",
        "EventSource": "Platform",
        "DurationInSeconds": duration_s,
    }


@asynccontextmanager
async def running_agent(settings: Settings, options: AgentOptions) -> AsyncIterator[asyncio.Task[None]]:
    """`run_agent` in a task. Leaving the block stops it as a process is stopped, with SIGTERM, once the agent's
    handler stands in for the default one (a task whose test failed before that is cancelled instead)."""
    untouched = signal.getsignal(signal.SIGTERM)
    agent = asyncio.create_task(run_agent(settings, options), name="agent-under-test")
    try:
        yield agent
        handled = lambda: signal.getsignal(signal.SIGTERM) is not untouched  # noqa: E731
        await eventually(handled, timeout=5, what="the agent's SIGTERM handler")
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(agent, timeout=20)
    finally:
        if not agent.done():
            agent.cancel()
            await asyncio.gather(agent, return_exceptions=True)
    assert signal.getsignal(signal.SIGTERM) is untouched, "the default handler is back"


async def test_an_azure_preempt_reaches_the_tenant_whose_job_runs_on_the_host(
    nats_server: NatsServer,
    tenant_broker: NatsTenantBroker,
    two_tenants: dict[str, UserKeys],
    kv: KeyValue,
    provider_secret: bytes,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await put_assignment(kv, assignment("h1", "g1", ("acme", "train")))
    only_maintenance = (tenant_events_filter("acme", kind="maintenance"),)
    reader = await tenant_reader(
        nats_server, tenant_broker, "acme", two_tenants["acme"], name="maint", filter_subjects=only_maintenance
    )
    # The agent freezes its start-up heap (gc.freeze): in the test process that would pin every later test's garbage.
    monkeypatch.setattr(runtime, "freeze_startup_heap", lambda: 0)
    emulator = CloudNoticeEmulator().start()
    emulator.serve(AZURE, azure_document(1))
    settings = settings_from(
        monkeypatch,
        HZ_PROVIDER_SECRET=provider_secret.decode(),
        HZ_NATS_URL=nats_server.url,
        HZ_CLOUD_NOTICES="azure",
        HZ_CLOUD_METADATA_URL=emulator.url,
        HZ_CLOUD_VM_NAME=VM,
    )
    options = AgentOptions(
        host="h1", locality_group="g1", gpus=2, source=SourceKind.SIMULATED, tick_s=0.1, launch=False
    )

    async def maintenance_arrived() -> bool:
        await reader.read(wait=0.2)
        return bool(reader.events)

    before = asyncio.all_tasks()
    try:
        async with running_agent(settings, options):
            await eventually(lambda: bool(emulator.received(AZURE)), timeout=20, what="the agent polling Azure")
            preempt_at = (datetime.now(UTC) + timedelta(minutes=5)).replace(microsecond=0)
            preempt = azure_event(PREEMPT_ID, "Preempt", at=preempt_at, resources=(VM,), duration_s=120)
            elsewhere = azure_event(REBOOT_ID, "Reboot", at=preempt_at, resources=("other_vm",), duration_s=600)
            emulator.serve(AZURE, azure_document(2, preempt, elsewhere))
            await eventually(maintenance_arrived, timeout=20, what="acme's maintenance event")
        polls = len(emulator.received(AZURE))

        await reader.read(wait=0.2)
        ((subject, event),) = reader.events  # one notice for this VM, one event; the other VM's Reboot is not here
        assert subject == "hz.t.acme.events.maintenance.train"
        assert event.subject == "train"
        notice = event.data
        assert (notice.kind, notice.status, notice.early_approval) == (
            MaintenanceKind.PREEMPT,
            MaintenanceStatus.SCHEDULED,
            True,
        )
        assert (notice.window.not_before, notice.window.not_after) == (preempt_at, preempt_at + timedelta(seconds=120))
        assert notice.hosts == (host_pseudonym(provider_secret, "acme", "h1"),)
        assert PREEMPT_ID not in event_text(subject, event), "the cloud's event id stays the provider's"
        assert all(request.headers.get("metadata") == "true" for request in emulator.received(AZURE))

        await reader.close()  # its own tasks (a request inbox it opened on the way) are not the agent's
        await eventually(lambda: not asyncio.all_tasks() - before, timeout=5, what="every task of the agent to end")
        assert len(emulator.received(AZURE)) == polls, "no poll after the agent stopped"
    finally:
        emulator.close()
        await reader.close()  # again, when the test failed before it was closed


async def acme_job_reader(
    kv: KeyValue, nats_server: NatsServer, tenant_broker: NatsTenantBroker, keys: UserKeys,
    monkeypatch: pytest.MonkeyPatch, *, kind: str, name: str,
) -> TenantReader:
    """What the end-to-end tests share: acme's job `train` placed on h1, a reader of its `kind` events, and the
    agent's start-up heap freeze off (in the test process it would pin every later test's garbage)."""
    await put_assignment(kv, assignment("h1", "g1", ("acme", "train")))
    monkeypatch.setattr(runtime, "freeze_startup_heap", lambda: 0)
    return await tenant_reader(nats_server, tenant_broker, "acme", keys, name=name,
                               filter_subjects=(tenant_events_filter("acme", kind=kind),))


def agent_on_h1(gpus: int) -> AgentOptions:
    """h1's agent on a simulated source, ticking fast, launching nothing."""
    return AgentOptions(host="h1", locality_group="g1", gpus=gpus, source=SourceKind.SIMULATED, tick_s=0.1,
                        launch=False)


AWS_SPOT = "/latest/meta-data/spot/instance-action"
GCP_EVENT = "/computeMetadata/v1/instance/maintenance-event"
GCP_PREEMPTED = "/computeMetadata/v1/instance/preempted"
POLL_S = {"aws": 5.0, "gcp": 1.0}
"""The channels' default poll intervals, as the agent builds them (GCP's maintenance event is long-polled)."""


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
async def test_aws_and_gcp_notices_reach_the_tenant_with_their_lead_times(
    cloud: str,
    nats_server: NatsServer,
    tenant_broker: NatsTenantBroker,
    two_tenants: dict[str, UserKeys],
    kv: KeyValue,
    provider_secret: bytes,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AWS's Spot interruption notice (2 min ahead) and GCP's TERMINATE_ON_HOST_MAINTENANCE (60 s ahead) become the
    job's maintenance event, under the tenant's pseudonym for the host, soon after the metadata service says so (the
    channel tests pin the poll interval plus 50 ms; here the agent's tick and the broker add their part)."""
    reader = await acme_job_reader(kv, nats_server, tenant_broker, two_tenants["acme"], monkeypatch,
                                   kind="maintenance", name=f"maint-{cloud}")
    emulator = CloudNoticeEmulator().start()
    emulator.serve(GCP_EVENT, "NONE")
    emulator.serve(GCP_PREEMPTED, "FALSE")
    settings = settings_from(
        monkeypatch, HZ_PROVIDER_SECRET=provider_secret.decode(), HZ_NATS_URL=nats_server.url,
        HZ_CLOUD_NOTICES=cloud, HZ_CLOUD_METADATA_URL=emulator.url, HZ_CLOUD_VM_NAME=VM,
    )
    options = agent_on_h1(gpus=2)
    watched = AWS_SPOT if cloud == "aws" else GCP_EVENT

    async def maintenance_arrived() -> bool:
        await reader.read(wait=0.05)
        return bool(reader.events)

    try:
        async with running_agent(settings, options):
            await eventually(lambda: bool(emulator.received(watched)), timeout=20, what=f"the agent polling {cloud}")
            served = datetime.now(UTC)
            if cloud == "aws":
                action_at = (served + timedelta(minutes=2)).replace(microsecond=0)
                emulator.serve(AWS_SPOT, {"action": "terminate", "time": action_at.strftime("%Y-%m-%dT%H:%M:%SZ")})
            else:
                emulator.serve(GCP_EVENT, "TERMINATE_ON_HOST_MAINTENANCE")
            took = await eventually(maintenance_arrived, timeout=20, what=f"acme's maintenance event from {cloud}")
            assert took <= POLL_S[cloud] + options.tick_s + 1.0, f"{took:.2f} s from the notice to the tenant"
        ((subject, event),) = reader.events
        notice = event.data
        assert subject == "hz.t.acme.events.maintenance.train"
        assert notice.hosts == (host_pseudonym(provider_secret, "acme", "h1"),)
        assert notice.status is MaintenanceStatus.SCHEDULED and not notice.early_approval
        if cloud == "aws":
            assert notice.kind is MaintenanceKind.PREEMPT and notice.window.not_before == action_at
        else:
            assert notice.kind is MaintenanceKind.TERMINATE
            lead = notice.window.not_before - served
            assert timedelta(seconds=55) <= lead <= timedelta(seconds=65), f"GCP gives 60 s, the event says {lead}"
        assert VM not in event_text(subject, event), "the cloud's names stay the provider's"
    finally:
        emulator.close()
        await reader.close()


async def test_an_nvsentinel_fatal_xid_reaches_the_tenant_as_a_gpu_error(
    nats_server: NatsServer,
    tenant_broker: NatsTenantBroker,
    two_tenants: dict[str, UserKeys],
    kv: KeyValue,
    provider_secret: bytes,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NVSentinel's documented fatal XID 79 (GPU fallen off the bus) on GPU 3 of this node: the job on the host gets
    a critical gpu_error failure naming the GPU, under its pseudonym for the host, and the node name stays ours."""
    reader = await acme_job_reader(kv, nats_server, tenant_broker, two_tenants["acme"], monkeypatch,
                                   kind="failure", name="gpu-health")
    options = agent_on_h1(gpus=4)

    async def failure_arrived() -> bool:
        await reader.read(wait=0.05)
        return bool(reader.events)

    try:
        with running_emulator() as emulator:
            relay = FakeNvSentinel(emulator)
            settings = settings_from(
                monkeypatch, HZ_PROVIDER_SECRET=provider_secret.decode(), HZ_NATS_URL=nats_server.url,
                HZ_NVSENTINEL_URL=relay.url, HZ_NVSENTINEL_NODE="gpu-node-7",
            )
            async with running_agent(settings, options):
                await eventually(lambda: bool(emulator.requests(relay.path)), timeout=20, what="the agent polling")
                relay.events.append(health_event(node="gpu-node-7", at=datetime.now(UTC), gpu=3, codes=("79",)))
                await eventually(failure_arrived, timeout=20, what="acme's failure event")
        ((subject, event),) = reader.events
        failure = event.data
        assert subject == "hz.t.acme.events.failure.train"
        assert (failure.kind.value, failure.severity.value, failure.gpu_index, failure.reason) == (
        "gpu_error", "critical", 3, "xid_79")
        assert failure.host == host_pseudonym(provider_secret, "acme", "h1")
        assert "gpu-node-7" not in event_text(subject, event), "the node's name stays the provider's"
    finally:
        await reader.close()


async def test_a_watttime_forecast_is_the_tenants_carbon_signal_in_g_per_kwh(
    nats_server: NatsServer,
    tenant_broker: NatsTenantBroker,
    two_tenants: dict[str, UserKeys],
    kv: KeyValue,
    provider_secret: bytes,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WattTime's documented forecast in lbs/MWh becomes the job's carbon event in g/kWh (1,000 lbs/MWh = 453.6
    g/kWh), replacing the replayed trace the simulated host would report."""
    reader = await acme_job_reader(kv, nats_server, tenant_broker, two_tenants["acme"], monkeypatch,
                                   kind="carbon", name="carbon-api")
    options = agent_on_h1(gpus=4)

    async def live_reading() -> bool:
        await reader.read(wait=0.05)
        return any(abs(event.data.g_per_kwh - 453.59) < 1.0 for _, event in reader.events)

    try:
        with running_emulator() as emulator:
            start = datetime.now(UTC).replace(second=0, microsecond=0)
            wattime = FakeWattTime(emulator, forecast=watttime_forecast(start, [1000.0, 800.0, 500.0]))
            settings = settings_from(
                monkeypatch, HZ_PROVIDER_SECRET=provider_secret.decode(), HZ_NATS_URL=nats_server.url,
                HZ_CARBON_API="watttime", HZ_CARBON_API_URL=emulator.url, HZ_WATTTIME_USERNAME=wattime.username,
                HZ_WATTTIME_PASSWORD=wattime.password, HZ_WATTTIME_REGION="CAISO_NORTH",
            )
            async with running_agent(settings, options):
                await eventually(live_reading, timeout=20, what="acme's carbon event from WattTime")
        live = next(event for _, event in reader.events if abs(event.data.g_per_kwh - 453.59) < 1.0)
        assert live.subject == "train"
        assert [round(point.g_per_kwh, 1) for point in live.data.forecast][:2] == [362.9, 226.8]
    finally:
        await reader.close()
