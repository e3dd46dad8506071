"""A tenant's accepted maintenance approval reaches Azure: exactly one `StartRequests`, and only when all may.

End to end, everything real but the cloud: a nats-server from the wheel, the control plane (SQLite, served by uvicorn,
its outbox relayed to the desired-state bucket), the agent's runtime (`run_agent`, what `harmonaize agent` runs)
polling the Azure metadata emulator. A tenant reads the notice id from its Maintenance event, opens
`approve_maintenance` and accepts; the agent maps the tenant's pseudonym back to the cloud's `EventId`, POSTs
`StartRequests` once, and the outcome appears as a round of the negotiation. The same command delivered again, even
to a restarted agent, sends nothing more; a rejected or expired offer sends nothing; on a host shared with another
tenant nothing is sent until that tenant accepted too.

Then the approver's decision table alone, against a fake channel and reporter (fast): notices from sources without
early starts, notices that started or do not allow it, a refusing cloud, an agent that died while asking.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from nats.js.kv import KeyValue

from api.app import create_app
from api.migrate import upgrade_async
from api.options import NegotiationOptions
from api.serving import serve_api
from broker_config.accounts import UserKeys
from broker_config.provider_bus import NatsProviderBus
from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from harmonaize.desired_state import AssignedJob, HostAssignment, MaintenanceApproval, host_key
from harmonaize.events import Maintenance, MaintenanceKind, MaintenanceStatus
from harmonaize.negotiation import RoundAction
from harmonaize.settings import Settings
from harmonaize.subjects import tenant_events_filter
from provider_agents import runtime
from provider_agents.approval_memory import ApprovalMemory, Approving
from provider_agents.approvals import NO_EARLY_APPROVAL, HeldNotice, NoticeApprover
from provider_agents.desired import ensure_desired_state_bucket
from provider_agents.projection import notice_pseudonym
from provider_agents.runtime import AgentOptions
from provider_agents.telemetry.detect import SourceKind
from provider_agents.telemetry.model import MaintenanceNotice
from provider_agents.telemetry.notices import AzureScheduledEvents, FetchError
from tests.agents.cloud_notice_emulator import CloudNoticeEmulator, Fault
from tests.agents.conftest import TenantReader, tenant_reader
from tests.agents.test_provider_inputs_wiring import azure_document, azure_event, running_agent, settings_from
from tests.api.api_testkit import FakeClock
from tests.support import eventually

VM = "myVm_0"
AZURE = "/metadata/scheduledevents"
FREEZE_ID = "f020ba2e-3bc0-4c40-a10b-86575a9eabd5"
REBOOT_ID = "c9bd3d1e-4fe9-41a9-8ea6-07c4b4ba1d0d"
REDEPLOY_ID = "5b2b5c36-9e3e-4d58-9a3b-0d2b7e6f1a44"
ADMIN_TOKEN = "approval-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


# --- the world: broker, control plane, cloud, agent ---------------------------------------------------------------


@dataclass
class Cloud:
    """The control plane over HTTP, its clock, the Azure emulator and the desired-state bucket."""

    api: httpx.AsyncClient
    api_url: str
    clock: FakeClock
    azure: CloudNoticeEmulator
    kv: KeyValue
    tenants: dict[str, dict[str, str]] = field(default_factory=dict)

    def headers(self, tenant: str, **extra: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tenants[tenant]['token']}", **extra}

    async def tenant(self, tenant: str) -> UserKeys:
        created = await self.post("/v1/tenants", {"id": tenant, "display_name": tenant.title()}, ADMIN)
        self.tenants[tenant] = {"token": created["api_token"]}
        return UserKeys(public_key=created["nats_user_public_key"], seed=created["nats"]["seed"])

    async def post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        reply = await self.api.post(path, json=body, headers=headers)
        assert reply.status_code in (200, 201), reply.text
        return reply.json()

    async def approve(self, tenant: str, notice: str, *, key: str) -> dict[str, Any]:
        body = {"job": "train", "kind": "approve_maintenance", "terms": {"notice_id": notice}}
        offered = await self.post("/v1/negotiations", body, self.headers(tenant, **{"Idempotency-Key": key}))
        assert offered["state"] == "offered", offered
        return offered

    async def act(self, tenant: str, negotiation: str, action: str, body: dict[str, Any] | None = None) -> Any:
        return await self.api.post(
            f"/v1/negotiations/{negotiation}/{action}", json=body or {}, headers=self.headers(tenant)
        )

    async def negotiation(self, tenant: str, negotiation: str) -> dict[str, Any]:
        reply = await self.api.get(f"/v1/negotiations/{negotiation}", headers=self.headers(tenant))
        assert reply.status_code == 200, reply.text
        body: dict[str, Any] = reply.json()
        return body

    async def rounds(self, tenant: str, negotiation: str) -> list[str]:
        return [step["action"] for step in (await self.negotiation(tenant, negotiation))["rounds"]]

    def start_requests(self) -> list[str]:
        """Every EventId the cloud was asked to start, one entry per id in every POST."""
        posts = self.azure.received(AZURE, method="POST")
        return [ask["EventId"] for post in posts for ask in post.json()["StartRequests"]]


@contextmanager
def _no_signal_capture(_server: uvicorn.Server) -> Iterator[None]:
    yield


@pytest.fixture
async def cloud(
    tmp_path: Path,
    nats_server: NatsServer,
    tenant_broker: NatsTenantBroker,
    provider_secret: bytes,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Cloud]:
    # The agent under test owns SIGTERM in this process (it is stopped by one); uvicorn must not take it over.
    monkeypatch.setattr(uvicorn.Server, "capture_signals", _no_signal_capture)
    settings = Settings(
        _env_file=None, data_dir=tmp_path / "api", admin_token=ADMIN_TOKEN, provider_secret=provider_secret.decode()
    )
    await upgrade_async(settings)
    clock = FakeClock(datetime.now(UTC).replace(microsecond=0))
    options = NegotiationOptions(clock=clock, sweep_interval_s=3600.0, relay_poll_interval_s=0.05)
    bus = NatsProviderBus([nats_server.url], provider_secret=provider_secret)
    app = create_app(settings, broker=tenant_broker, bus=bus, negotiation=options)
    served = await serve_api(app, host="127.0.0.1", port=0)
    azure = CloudNoticeEmulator().start()
    provider = await tenant_broker.provider_connection()
    try:
        kv = await ensure_desired_state_bucket(provider.jetstream())
        url = f"http://127.0.0.1:{served.port}"
        async with httpx.AsyncClient(base_url=url, timeout=10) as api:
            world = Cloud(api=api, api_url=url, clock=clock, azure=azure, kv=kv)
            await world.post("/v1/hosts", {"id": "h1", "gpus": 8, "locality_group": "g1"}, ADMIN)
            yield world
    finally:
        azure.close()
        await provider.close()
        await served.stop()
        await bus.close()


def agent_settings(cloud: Cloud, monkeypatch: pytest.MonkeyPatch, nats_server: NatsServer, secret: bytes,
                   data_dir: Path) -> Settings:
    # The agent freezes its start-up heap (gc.freeze): in the test process that would pin every later test's garbage.
    monkeypatch.setattr(runtime, "freeze_startup_heap", lambda: 0)
    return settings_from(
        monkeypatch,
        HZ_PROVIDER_SECRET=secret.decode(),
        HZ_NATS_URL=nats_server.url,
        HZ_API_URL=cloud.api_url,
        HZ_ADMIN_TOKEN=ADMIN_TOKEN,
        HZ_DATA_DIR=str(data_dir),
        HZ_CLOUD_NOTICES="azure",
        HZ_CLOUD_METADATA_URL=cloud.azure.url,
        HZ_CLOUD_VM_NAME=VM,
    )


AGENT = AgentOptions(host="h1", locality_group="g1", gpus=8, source=SourceKind.SIMULATED, tick_s=0.1, launch=False)


def scheduled(*event_ids: str, kind: str = "Freeze") -> dict[str, Any]:
    at = (datetime.now(UTC) + timedelta(minutes=10)).replace(microsecond=0)
    return azure_document(1, *(azure_event(e, kind, at=at, resources=(VM,), duration_s=60) for e in event_ids))


async def maintenance_notices(reader: TenantReader, count: int) -> dict[str, Maintenance]:
    """The tenant's Maintenance events until `count` notices are known, by notice id."""
    notices: dict[str, Maintenance] = {}

    async def arrived() -> bool:
        for _, event in await reader.read(wait=0.2):
            notices[event.data.notice_id] = event.data
        return len(notices) >= count

    await eventually(arrived, timeout=20, what=f"{count} maintenance notices on {reader.tenant}'s feed")
    return notices


async def placed_job(cloud: Cloud, tenant: str) -> None:
    body = {"id": "train", "min_workers": 1, "max_workers": 2, "gpus_per_worker": 4, "initial_workers": 1}
    await cloud.post("/v1/jobs", body, cloud.headers(tenant))


async def reader_of(nats_server: NatsServer, broker: NatsTenantBroker, tenant: str, keys: UserKeys) -> TenantReader:
    only = (tenant_events_filter(tenant, kind="maintenance"),)
    return await tenant_reader(nats_server, broker, tenant, keys, name="maint", filter_subjects=only)


# --- end to end ---------------------------------------------------------------------------------------------------


async def test_an_accepted_approval_starts_the_azure_event_once_and_nothing_else_does(
    cloud: Cloud,
    nats_server: NatsServer,
    tenant_broker: NatsTenantBroker,
    provider_secret: bytes,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    keys = await cloud.tenant("acme")
    await placed_job(cloud, "acme")
    reader = await reader_of(nats_server, tenant_broker, "acme", keys)
    cloud.azure.serve(AZURE, scheduled(FREEZE_ID, REBOOT_ID, REDEPLOY_ID))
    settings = agent_settings(cloud, monkeypatch, nats_server, provider_secret, tmp_path / "agent")
    try:
        async with running_agent(settings, AGENT):
            notices = await maintenance_notices(reader, 3)
            assert all(notice.early_approval for notice in notices.values())
            name = {event: notice_pseudonym(provider_secret, "acme", event)
                    for event in (FREEZE_ID, REBOOT_ID, REDEPLOY_ID)}
            assert set(notices) == set(name.values()), "the tenant's ids are the projection's pseudonyms"

            # Not accepted: one offer rejected, one left to expire. Neither reaches the cloud.
            rejected = await cloud.approve("acme", name[REBOOT_ID], key="k-reboot")
            assert (await cloud.act("acme", rejected["id"], "reject")).status_code == 200
            expired = await cloud.approve("acme", name[REDEPLOY_ID], key="k-redeploy")
            cloud.clock.advance(minutes=2)
            late = await cloud.act("acme", expired["id"], "accept", {"option": 0})
            assert late.status_code == 409 and late.json()["reason"] == "negotiation is expired: cannot accept"

            offered = await cloud.approve("acme", name[FREEZE_ID], key="k-freeze")
            accepted = await cloud.act("acme", offered["id"], "accept", {"option": 0})
            assert accepted.status_code == 200, accepted.text
            await eventually(lambda: bool(cloud.start_requests()), timeout=20, what="the agent's StartRequests")

            async def settled() -> bool:
                return "approved" in await cloud.rounds("acme", offered["id"])

            await eventually(settled, timeout=10, what="the approved round")

            async def cleared() -> bool:
                return await desired_approvals(cloud) == {}

            await eventually(cleared, timeout=10, what="the settled approval off h1's desired state")
            (post,) = cloud.azure.received(AZURE, method="POST")
            assert post.json() == {"StartRequests": [{"EventId": FREEZE_ID}]}
            assert post.headers.get("metadata") == "true" and post.query == {"api-version": "2020-07-01"}

            # The same command again (a re-delivered desired state): the agent remembers, the cloud hears nothing.
            await redeliver(cloud, "acme", offered["id"], name[FREEZE_ID])
            await asyncio.sleep(1.0)  # four passes of the approver
            assert cloud.start_requests() == [FREEZE_ID]

        # A restarted agent (its memory on disk) gets the same command: it reports, and asks nothing.
        async with running_agent(settings, AGENT):
            await redeliver(cloud, "acme", offered["id"], name[FREEZE_ID])
            polls = len(cloud.azure.received(AZURE, method="GET"))
            await eventually(lambda: len(cloud.azure.received(AZURE, method="GET")) > polls + 1, timeout=10,
                             what="the restarted agent polling")
            await asyncio.sleep(1.0)
            assert cloud.start_requests() == [FREEZE_ID], "exactly one POST, for the accepted notice only"

        final = await cloud.negotiation("acme", offered["id"])
        steps = [(r["actor"], r["action"], r["note"]) for r in final["rounds"]]
        assert steps[3:] == [("provider", "approved", "approved at the cloud: the maintenance may start now")]
        assert final["state"] == "accepted"
        shown = json.dumps(final) + json.dumps(await cloud.negotiation("acme", rejected["id"]))
        assert FREEZE_ID not in shown and VM not in shown and "h1" not in shown, "no cloud internals for the tenant"
        assert await cloud.rounds("acme", rejected["id"]) == ["request", "offer", "reject"]
        assert await cloud.rounds("acme", expired["id"]) == ["request", "offer", "expire"]
    finally:
        await reader.close()


async def test_on_a_shared_host_the_event_starts_only_once_every_tenant_there_approved(
    cloud: Cloud,
    nats_server: NatsServer,
    tenant_broker: NatsTenantBroker,
    provider_secret: bytes,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    for tenant in ("acme", "globex"):
        await cloud.tenant(tenant)
        await placed_job(cloud, tenant)
    cloud.azure.serve(AZURE, scheduled(FREEZE_ID))
    settings = agent_settings(cloud, monkeypatch, nats_server, provider_secret, tmp_path / "agent")
    acme_name = notice_pseudonym(provider_secret, "acme", FREEZE_ID)
    globex_name = notice_pseudonym(provider_secret, "globex", FREEZE_ID)
    assert acme_name != globex_name, "one notice, a pseudonym per tenant"
    async with running_agent(settings, AGENT):
        first = await cloud.approve("acme", acme_name, key="acme")
        assert (await cloud.act("acme", first["id"], "accept", {"option": 0})).status_code == 200

        async def waiting() -> bool:
            return "approval_pending" in await cloud.rounds("acme", first["id"])

        await eventually(waiting, timeout=20, what="acme's approval waiting for globex")
        await asyncio.sleep(1.0)
        assert cloud.start_requests() == [], "globex has not approved: nothing reaches the cloud"
        # globex guessing acme's name for the notice approves nothing: names are per tenant.
        guess = await cloud.approve("globex", acme_name, key="guess")
        assert (await cloud.act("globex", guess["id"], "accept", {"option": 0})).status_code == 200
        await asyncio.sleep(1.0)
        assert cloud.start_requests() == []

        second = await cloud.approve("globex", globex_name, key="globex")
        assert (await cloud.act("globex", second["id"], "accept", {"option": 0})).status_code == 200

        async def both_approved() -> bool:
            return ("approved" in await cloud.rounds("acme", first["id"])
                    and "approved" in await cloud.rounds("globex", second["id"]))

        await eventually(both_approved, timeout=20, what="both tenants' approved rounds")
        assert cloud.start_requests() == [FREEZE_ID]
    waited = (await cloud.negotiation("acme", first["id"]))["rounds"]
    assert [r["action"] for r in waited[3:]] == ["approval_pending", "approved"]
    assert "waiting for the other tenants" in waited[3]["note"]
    assert await cloud.rounds("globex", guess["id"]) == ["request", "offer", "accept"], "no outcome: not its notice"


async def redeliver(cloud: Cloud, tenant: str, negotiation: str, notice: str) -> None:
    """Put h1's current desired state back with the approval listed again, as a replayed delivery would."""
    entry = await cloud.kv.get(host_key("h1"))
    assert entry.value is not None
    current = HostAssignment.model_validate_json(entry.value)
    again = MaintenanceApproval(negotiation=negotiation, notice=notice)
    jobs = tuple(
        job.model_copy(update={"approvals": (again,)}) if job.tenant == tenant else job for job in current.jobs
    )
    await cloud.kv.put(host_key("h1"), current.model_copy(update={"jobs": jobs}).model_dump_json().encode())


async def desired_approvals(cloud: Cloud) -> dict[str, tuple[MaintenanceApproval, ...]]:
    entry = await cloud.kv.get(host_key("h1"))
    assert entry.value is not None
    return {job.tenant: job.approvals for job in HostAssignment.model_validate_json(entry.value).jobs if job.approvals}


# --- the decision table ---------------------------------------------------------------------------------------------


NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
SECRET = b"test-provider-secret-0123456789abcdef"


class FakeStarter:
    """An early-start channel that records what it was asked (and refuses when told to)."""

    name = "fake"

    def __init__(self, *, refusal: str | None = None, fails: bool = False) -> None:
        self.refusal = refusal
        self.fails = fails
        self.asked: list[str] = []

    def early_start_refusal(self, notice_id: str) -> str | None:
        return self.refusal

    async def approve(self, notice_id: str) -> None:
        self.asked.append(notice_id)
        if self.fails:
            raise FetchError("scheduledevents: HTTP 400", "POST: HTTP 400")


class Reports:
    def __init__(self) -> None:
        self.sent: list[tuple[str, RoundAction, str]] = []

    async def report_approval(self, negotiation: str, outcome: RoundAction, note: str) -> str:
        self.sent.append((negotiation, outcome, note))
        return "recorded"


def notice(notice_id: str = "evt-1", *, status: MaintenanceStatus = MaintenanceStatus.SCHEDULED,
           early: bool = True) -> MaintenanceNotice:
    return MaintenanceNotice(notice_id=notice_id, kind=MaintenanceKind.REBOOT, status=status,
                             not_before=NOW + timedelta(minutes=10), not_after=NOW + timedelta(minutes=20),
                             early_approval=early)


def host(*jobs: tuple[str, tuple[MaintenanceApproval, ...]]) -> HostAssignment:
    return HostAssignment(
        host="h1", locality_group="g1", generation=1, updated_at=NOW,
        jobs=tuple(AssignedJob(tenant=tenant, job="train", workers=1, gpus=4, approvals=approvals)
                   for tenant, approvals in jobs),
    )


def asked(tenant: str, number: int, notice_id: str = "evt-1") -> MaintenanceApproval:
    return MaintenanceApproval(negotiation=f"0190a0a0-0000-7000-8000-{number:012d}",
                               notice=notice_pseudonym(SECRET, tenant, notice_id))


def approver(tmp_path: Path, assignment: HostAssignment, *held: HeldNotice) -> tuple[NoticeApprover, Reports]:
    reports = Reports()
    return NoticeApprover(
        host="h1", secret=SECRET, assignment=lambda: assignment, notices=lambda: held, reporter=reports,
        memory=ApprovalMemory(tmp_path / "approvals.json"),
    ), reports


@pytest.mark.parametrize(
    ("held", "note"),
    [
        (HeldNotice(notice()), NO_EARLY_APPROVAL),  # simulated, AWS, GCP: no channel can start it
        (HeldNotice(notice(status=MaintenanceStatus.STARTED), FakeStarter()), "the maintenance has already started"),
        (HeldNotice(notice(early=False), FakeStarter()), "this maintenance cannot be started early"),
        (HeldNotice(notice(), FakeStarter(refusal="this maintenance covers other machines too")),
         "this maintenance covers other machines too"),
        (HeldNotice(notice(), FakeStarter(fails=True)), "the cloud refused the early start"),
    ],
)
async def test_a_notice_that_cannot_start_early_is_a_failed_round_saying_why(
    tmp_path: Path, held: HeldNotice, note: str
) -> None:
    one, reports = approver(tmp_path, host(("acme", (asked("acme", 1),))), held)
    await one.step()
    await one.step()
    ((negotiation, outcome, said),) = reports.sent
    assert (negotiation, outcome) == (asked("acme", 1).negotiation, RoundAction.APPROVAL_FAILED)
    assert said.startswith(note) and "evt-1" not in said
    starter = held.channel
    if isinstance(starter, FakeStarter) and not starter.fails:
        assert starter.asked == []


async def test_approvals_for_other_notices_or_tenants_are_left_alone(tmp_path: Path) -> None:
    starter = FakeStarter()
    foreign = MaintenanceApproval(negotiation="0190a0a0-0000-7000-8000-000000000009",
                                  notice=notice_pseudonym(SECRET, "globex", "evt-1"))  # globex's name, in acme's job
    one, reports = approver(
        tmp_path, host(("acme", (asked("acme", 1, "evt-elsewhere"), foreign))), HeldNotice(notice(), starter)
    )
    await one.step()
    assert reports.sent == [] and starter.asked == []


async def test_an_agent_that_died_while_asking_never_asks_again(tmp_path: Path) -> None:
    ApprovalMemory(tmp_path / "approvals.json").remember("evt-1", Approving.SENDING, at=NOW)
    starter = FakeStarter()
    one, reports = approver(tmp_path, host(("acme", (asked("acme", 1),))), HeldNotice(notice(), starter))
    await one.step()
    assert starter.asked == []
    ((_, outcome, note),) = reports.sent
    assert outcome is RoundAction.APPROVAL_FAILED and note.startswith("outcome unknown")


async def test_azure_starts_early_only_an_event_of_this_vm_alone_and_a_refusal_is_an_error() -> None:
    at = datetime.now(UTC) + timedelta(minutes=10)
    alone = azure_event(FREEZE_ID, "Freeze", at=at, resources=(VM,), duration_s=60)
    shared = azure_event(REBOOT_ID, "Reboot", at=at, resources=(VM, "myVm_1"), duration_s=60)
    with CloudNoticeEmulator() as emulator:
        emulator.serve(AZURE, azure_document(3, alone, shared))
        channel = AzureScheduledEvents(vm_name=VM, base_url=emulator.url, poll_interval_s=0.05)
        try:
            await channel.poll_once()
            assert channel.early_start_refusal(FREEZE_ID) is None
            assert channel.early_start_refusal(REBOOT_ID) == (
                "this maintenance covers other machines too: only a single host's maintenance is started early"
            )
            assert channel.early_start_refusal("gone") == "the maintenance is no longer announced"
            emulator.fail_next(1, Fault.UNAVAILABLE, path=AZURE)
            with pytest.raises(FetchError):
                await channel.approve(FREEZE_ID)
        finally:
            await channel.stop()
