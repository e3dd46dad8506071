"""Cloud notice channels against a local emulator of the clouds' metadata services (`cloud_notice_emulator.py`).

Each cloud's documented notice becomes the right `MaintenanceNotice` in the overlay's sample within a poll interval
(plus 50 ms), with the cloud's lead time kept; every kind of bad input is survived without a notice, keeping the
last valid view, and the channel recovers when a good document is served again; Azure's early approval, AWS's
IMDSv2 token and GCP's header and long-poll behave as documented. Fixtures follow the providers' documentation.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypedDict

import pytest

from harmonaize.events import MaintenanceKind, MaintenanceStatus
from provider_agents.clock import ManualClock
from provider_agents.telemetry import MaintenanceNotice, RawFailureKind, SimulatedHost, parse_scenario
from provider_agents.telemetry.notices import (
    ESTIMATED_DURATION,
    AwsInstanceNotices,
    AzureScheduledEvents,
    FetchError,
    GcpMaintenanceNotices,
    NoticeOverlay,
    PollingChannel,
)
from provider_agents.telemetry.notices.times import parse_aws_event_time, parse_iso8601_utc, parse_rfc1123
from tests.agents.cloud_notice_emulator import CloudNoticeEmulator, Fault, Reply
from tests.support import eventually

INTERVAL = 0.2
"""Poll interval of the lead-time tests: a notice must show within it plus 50 ms."""


class Timing(TypedDict):
    poll_interval_s: float
    timeout_s: float
    backoff_cap_s: float


FAST = Timing(poll_interval_s=0.02, timeout_s=0.1, backoff_cap_s=0.05)
"""Settings of the bad-input tests, so that a streak of failures and the backoff after it take well under a second."""
PROMPT = INTERVAL + 0.05

VM = "myVm_0"
AZURE = "/metadata/scheduledevents"
AWS_SPOT = "/latest/meta-data/spot/instance-action"
AWS_REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
AWS_SCHEDULED = "/latest/meta-data/events/maintenance/scheduled"
GCP_EVENT = "/computeMetadata/v1/instance/maintenance-event"
GCP_PREEMPTED = "/computeMetadata/v1/instance/preempted"
GCP_UPCOMING = "/computeMetadata/v1/instance/upcoming-maintenance"
AZURE_IDS = {
    1: "f020ba2e-3bc0-4c40-a10b-86575a9eabd5",  # the id in Azure's documented example
    2: "c9bd3d1e-4fe9-41a9-8ea6-07c4b4ba1d0d",
    3: "7dcd8ab1-3c3b-4d8b-9bde-1b0a0dbb7a10",
}


# --- documents as the providers document them ----------------------------------------------------------------------


def _text(document: object) -> str:
    return json.dumps(document)


def rfc1123(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%a, %d %b %Y %H:%M:%S GMT")


def aws_time(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%d %b %Y %H:%M:%S GMT")


def iso(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def whole_seconds(at: datetime) -> datetime:
    return at.replace(microsecond=0)


def soon(seconds: float) -> datetime:
    return whole_seconds(datetime.now(UTC) + timedelta(seconds=seconds))


def azure_event(
    event_id: str,
    event_type: str,
    *,
    not_before: datetime | None,
    status: str = "Scheduled",
    resources: tuple[str, ...] = (VM,),
    duration_s: int = -1,
) -> dict[str, Any]:
    return {
        "EventId": event_id,
        "EventType": event_type,
        "ResourceType": "VirtualMachine",
        "Resources": list(resources),
        "EventStatus": status,
        "NotBefore": "" if not_before is None else rfc1123(not_before),
        "Description": "Virtual machine is being paused because of a memory-preserving Live Migration operation.",
        "EventSource": "Platform",
        "DurationInSeconds": duration_s,
    }


def azure_doc(incarnation: int, *events: dict[str, Any]) -> dict[str, Any]:
    return {"DocumentIncarnation": incarnation, "Events": list(events)}


def aws_event(event_id: str, code: str, *, not_before: datetime, not_after: datetime | None) -> dict[str, Any]:
    event = {
        "NotBefore": aws_time(not_before),
        "Code": code,
        "Description": "The instance is scheduled for " + code,
        "EventId": event_id,
        "State": "active",
    }
    if not_after is not None:
        event["NotAfter"] = aws_time(not_after)
    return event


def gcp_upcoming(start: datetime, end: datetime, *, status: str = "PENDING") -> dict[str, Any]:
    return {
        "can_reschedule": True,
        "latest_window_start_time": iso(start + timedelta(days=7)),
        "maintenance_status": status,
        "type": "SCHEDULED",
        "window_end_time": iso(end),
        "window_start_time": iso(start),
    }


def serve_quiet(emulator: CloudNoticeEmulator) -> None:
    """Every cloud with nothing to announce."""
    emulator.serve(AZURE, azure_doc(1))
    for path in (AWS_SPOT, AWS_REBALANCE, AWS_SCHEDULED, GCP_UPCOMING):
        emulator.serve(path, None)
    emulator.serve(GCP_EVENT, "NONE")
    emulator.serve(GCP_PREEMPTED, "FALSE")


# --- harness -------------------------------------------------------------------------------------------------------


@pytest.fixture
def emulator() -> Iterator[CloudNoticeEmulator]:
    with CloudNoticeEmulator() as running:
        serve_quiet(running)
        yield running


def base_source() -> SimulatedHost:
    return SimulatedHost("h1", gpus=2, seed=1)


def notices(overlay: NoticeOverlay) -> dict[str, MaintenanceNotice]:
    return {notice.notice_id: notice for notice in overlay.sample().maintenance}


def kinds(overlay: NoticeOverlay) -> dict[MaintenanceKind, MaintenanceNotice]:
    return {notice.kind: notice for notice in overlay.sample().maintenance}


async def polled(channel: PollingChannel) -> None:
    await eventually(lambda: channel.health.successes >= 1, timeout=5, what=f"{channel.name}'s first good poll")


# --- time formats --------------------------------------------------------------------------------------------------


def test_each_cloud_time_format_parses_as_documented_and_nothing_looser() -> None:
    assert parse_rfc1123("Mon, 19 Sep 2016 18:29:47 GMT") == datetime(2016, 9, 19, 18, 29, 47, tzinfo=UTC)
    assert parse_aws_event_time("21 Jan 2019 09:00:43 GMT") == datetime(2019, 1, 21, 9, 0, 43, tzinfo=UTC)
    assert parse_iso8601_utc("2017-09-18T08:22:00Z") == datetime(2017, 9, 18, 8, 22, tzinfo=UTC)
    for bad in (
        "19 Sep 2016 18:29:47 GMT",
        "Mon, 19 Sep 2016 18:29:47",
        "Mon, 19 Sep 2016 18:29:47 PST",
        "Mon, 31 Feb 2016 18:29:47 GMT",
        "Mon, 19 Sep 2016 18:29",
        "",
    ):
        with pytest.raises(ValueError):
            parse_rfc1123(bad)
    for bad in ("Mon, 21 Jan 2019 09:00:43 GMT", "2019-01-21T09:00:43Z", "21 Jan 2019 09:00:43"):
        with pytest.raises(ValueError):
            parse_aws_event_time(bad)
    for bad in ("2017-09-18T08:22:00", "2017-09-18", "18 Sep 2017 08:22:00 GMT"):
        with pytest.raises(ValueError):
            parse_iso8601_utc(bad)


# --- Azure ---------------------------------------------------------------------------------------------------------


async def test_azure_events_for_this_vm_become_notices_with_their_lead_times(emulator: CloudNoticeEmulator) -> None:
    channel = AzureScheduledEvents(vm_name=VM, base_url=emulator.url, poll_interval_s=INTERVAL)
    async with NoticeOverlay(base_source(), channels=[channel]) as overlay:
        await polled(channel)
        preempt_at, freeze_at = soon(30), soon(15 * 60)
        emulator.serve(
            AZURE,
            azure_doc(
                2,
                azure_event(AZURE_IDS[1], "Preempt", not_before=preempt_at),
                azure_event(AZURE_IDS[2], "Freeze", not_before=freeze_at, resources=("other_vm", VM), duration_s=9),
                azure_event(AZURE_IDS[3], "Reboot", not_before=freeze_at, resources=("other_vm",)),
            ),
        )
        took = await eventually(lambda: AZURE_IDS[2] in notices(overlay), timeout=5, what="the Azure notices")
        assert took <= PROMPT, f"the notice took {took:.3f} s, more than the poll interval plus 50 ms"

        seen = notices(overlay)
        assert set(seen) == {AZURE_IDS[1], AZURE_IDS[2]}, "the Reboot is another VM's"
        preempt, freeze = seen[AZURE_IDS[1]], seen[AZURE_IDS[2]]
        assert (preempt.kind, preempt.status, preempt.not_before) == (
            MaintenanceKind.PREEMPT,
            MaintenanceStatus.SCHEDULED,
            preempt_at,
        )
        assert preempt.not_after == preempt_at + ESTIMATED_DURATION[MaintenanceKind.PREEMPT]  # duration -1: unknown
        assert (freeze.kind, freeze.not_before, freeze.not_after) == (
            MaintenanceKind.FREEZE,
            freeze_at,
            freeze_at + timedelta(seconds=9),
        )
        assert preempt.early_approval and freeze.early_approval

        # Started without NotBefore (as Azure may send it): the start seen before stays.
        emulator.serve(AZURE, azure_doc(3, azure_event(AZURE_IDS[1], "Preempt", not_before=None, status="Started")))
        await eventually(lambda: set(notices(overlay)) == {AZURE_IDS[1]}, timeout=5, what="the Freeze to go")
        started = notices(overlay)[AZURE_IDS[1]]
        assert (started.status, started.not_before) == (MaintenanceStatus.STARTED, preempt_at)

        # Gone from a later valid document (done, or cancelled): gone from the view.
        emulator.serve(AZURE, azure_doc(4))
        await eventually(lambda: not notices(overlay), timeout=5, what="the notice to disappear")

    gets = emulator.received(AZURE, method="GET")
    assert gets and all(r.headers.get("metadata") == "true" for r in gets)
    assert all(r.query == {"api-version": "2020-07-01"} for r in gets)


async def test_azure_approve_posts_one_start_request(emulator: CloudNoticeEmulator) -> None:
    channel = AzureScheduledEvents(vm_name=VM, base_url=emulator.url, poll_interval_s=INTERVAL)
    emulator.serve(AZURE, azure_doc(2, azure_event(AZURE_IDS[1], "Reboot", not_before=soon(900))))
    async with NoticeOverlay(base_source(), channels=[channel]) as overlay:
        await eventually(lambda: AZURE_IDS[1] in notices(overlay), timeout=5, what="the Reboot notice")
        await channel.approve(AZURE_IDS[1])

    posts = emulator.received(AZURE, method="POST")
    assert len(posts) == 1
    assert posts[0].json() == {"StartRequests": [{"EventId": AZURE_IDS[1]}]}
    assert posts[0].headers.get("metadata") == "true"
    assert posts[0].query == {"api-version": "2020-07-01"}


async def test_azure_approve_refused_raises(emulator: CloudNoticeEmulator) -> None:
    channel = AzureScheduledEvents(vm_name=VM, base_url=emulator.url, timeout_s=0.5)
    emulator.fail_next(1, Fault.UNAVAILABLE, path=AZURE)
    try:
        with pytest.raises(FetchError):
            await channel.approve(AZURE_IDS[1])
    finally:
        await channel.stop()


# --- AWS -----------------------------------------------------------------------------------------------------------


async def test_aws_notices_keep_their_lead_times(emulator: CloudNoticeEmulator) -> None:
    channel = AwsInstanceNotices(instance_id="i-0123456789abcdef0", base_url=emulator.url, poll_interval_s=INTERVAL)
    retirement = "instance-event-0a1b2c3d4e5f60718"
    async with NoticeOverlay(base_source(), channels=[channel]) as overlay:
        await polled(channel)
        spot_at, rebalance_at = soon(120), soon(0)
        reboot_at, retire_at = soon(3 * 86400), soon(14 * 86400)
        emulator.serve(AWS_SPOT, {"action": "terminate", "time": iso(spot_at)})
        emulator.serve(AWS_REBALANCE, {"noticeTime": iso(rebalance_at)})
        emulator.serve(
            AWS_SCHEDULED,
            [
                aws_event(
                    "instance-event-0d59937288b749b32",
                    "system-reboot",
                    not_before=reboot_at,
                    not_after=reboot_at + timedelta(hours=2),
                ),
                aws_event(
                    "instance-event-0a1b2c3d4e5f60718", "instance-retirement", not_before=retire_at, not_after=None
                ),
            ],
        )
        took = await eventually(lambda: len(kinds(overlay)) == 4, timeout=5, what="the four AWS notices")
        assert took <= PROMPT, f"the notices took {took:.3f} s, more than the poll interval plus 50 ms"

        seen = kinds(overlay)
        spot = seen[MaintenanceKind.PREEMPT]
        assert (spot.status, spot.not_before, spot.early_approval) == (MaintenanceStatus.SCHEDULED, spot_at, False)
        assert spot.not_after == spot_at + ESTIMATED_DURATION[MaintenanceKind.PREEMPT]
        rebalance = seen[MaintenanceKind.REBALANCE_RECOMMENDATION]
        assert (rebalance.status, rebalance.not_before) == (MaintenanceStatus.STARTED, rebalance_at)
        reboot = seen[MaintenanceKind.REBOOT]
        assert (reboot.notice_id, reboot.status) == ("instance-event-0d59937288b749b32", MaintenanceStatus.SCHEDULED)
        assert (reboot.not_before, reboot.not_after) == (reboot_at, reboot_at + timedelta(hours=2))
        retire = seen[MaintenanceKind.RETIRE]
        assert (retire.notice_id, retire.not_before) == (retirement, retire_at)
        failures = [f for f in overlay.sample().failures if f.kind is RawFailureKind.PREDICTED_FAILURE]
        assert [(f.eta, f.confidence) for f in failures] == [(retire_at, 1.0)], "retirement: failed hardware"

        # The same notice keeps its id from poll to poll; a 404 takes it away.
        first_id = spot.notice_id
        await eventually(lambda: channel.health.successes >= 3, timeout=5, what="more polls")
        assert kinds(overlay)[MaintenanceKind.PREEMPT].notice_id == first_id
        emulator.serve(AWS_SPOT, None)
        await eventually(lambda: MaintenanceKind.PREEMPT not in kinds(overlay), timeout=5, what="the spot notice to go")


async def test_aws_token_is_put_then_sent_and_refreshed_after_a_401(emulator: CloudNoticeEmulator) -> None:
    channel = AwsInstanceNotices(instance_id="i-0123456789abcdef0", base_url=emulator.url, poll_interval_s=0.05)
    async with NoticeOverlay(base_source(), channels=[channel]) as overlay:
        await polled(channel)
        first = emulator.received()[0]
        assert (first.method, first.path) == ("PUT", "/latest/api/token")
        assert first.headers.get("x-aws-ec2-metadata-token-ttl-seconds") == "21600"
        token = emulator.received(AWS_SPOT)[0].headers.get("x-aws-ec2-metadata-token")
        assert token and token.startswith("AQAE")

        emulator.expire_tokens()
        failures = channel.health.failures
        spot_at = soon(120)
        emulator.serve(AWS_SPOT, {"action": "stop", "time": iso(spot_at)})
        await eventually(lambda: MaintenanceKind.STOP in kinds(overlay), timeout=5, what="a notice after the 401")

    puts = emulator.received("/latest/api/token", method="PUT")
    assert len(puts) == channel.tokens_fetched == 2
    assert channel.health.failures == failures, "an expired token is renewed, not a failed poll"
    sent = [r.headers.get("x-aws-ec2-metadata-token") for r in emulator.received(AWS_SPOT)]
    assert token in sent and sent[-1] != token


def test_aws_capacity_block_end_is_announced_40_minutes_ahead_and_reclaimed_from_30() -> None:
    now = whole_seconds(datetime.now(UTC))
    end = now + timedelta(minutes=35)
    channel = AwsInstanceNotices(instance_id="i-0123456789abcdef0", capacity_block_end=end)
    notice = channel.view(now).maintenance[0]
    assert (notice.kind, notice.status) == (MaintenanceKind.TERMINATE, MaintenanceStatus.SCHEDULED)
    assert (notice.not_before, notice.not_after) == (end - timedelta(minutes=30), end)
    assert channel.view(now + timedelta(minutes=6)).maintenance[0].status is MaintenanceStatus.STARTED
    assert channel.view(end).maintenance[0].status is MaintenanceStatus.COMPLETED

    later = AwsInstanceNotices(
        instance_id="i-0123456789abcdef0",
        capacity_block_end=now + timedelta(minutes=45),
        capacity_block_action=MaintenanceKind.STOP,
    )
    assert later.view(now).maintenance == ()
    announced = later.view(now + timedelta(minutes=5)).maintenance
    assert [(n.kind, n.status) for n in announced] == [(MaintenanceKind.STOP, MaintenanceStatus.SCHEDULED)]
    assert announced[0].notice_id != notice.notice_id, "another block, another notice"
    with pytest.raises(ValueError):
        AwsInstanceNotices(instance_id="i-1", capacity_block_end=datetime(2030, 1, 1))


# --- GCP -----------------------------------------------------------------------------------------------------------


async def test_gcp_notices_keep_their_lead_times(emulator: CloudNoticeEmulator) -> None:
    channel = GcpMaintenanceNotices(vm_name=VM, base_url=emulator.url, poll_interval_s=INTERVAL)
    async with NoticeOverlay(base_source(), channels=[channel]) as overlay:
        await polled(channel)
        before = whole_seconds(datetime.now(UTC))
        start, end = soon(86400), soon(86400 + 4 * 3600)
        emulator.serve(GCP_EVENT, "MIGRATE_ON_HOST_MAINTENANCE")
        emulator.serve(GCP_PREEMPTED, "TRUE")
        emulator.serve(GCP_UPCOMING, gcp_upcoming(start, end))
        took = await eventually(lambda: len(kinds(overlay)) == 3, timeout=5, what="the three GCP notices")
        after = datetime.now(UTC)
        assert took <= PROMPT, f"the notices took {took:.3f} s, more than the poll interval plus 50 ms"

        seen = kinds(overlay)
        migrate = seen[MaintenanceKind.LIVE_MIGRATE]
        assert migrate.status is MaintenanceStatus.SCHEDULED
        assert before + timedelta(seconds=60) <= migrate.not_before <= after + timedelta(seconds=60), "60 s lead"
        preempt = seen[MaintenanceKind.PREEMPT]
        assert preempt.status is MaintenanceStatus.STARTED
        assert preempt.not_after - preempt.not_before == timedelta(seconds=30), "30 s until the VM is stopped"
        upcoming = seen[MaintenanceKind.HOST_MAINTENANCE]
        assert (upcoming.status, upcoming.not_before, upcoming.not_after) == (MaintenanceStatus.SCHEDULED, start, end)

        # Derived ids are stable: from poll to poll, and for the upcoming maintenance when it gets under way.
        ids = {kind: notice.notice_id for kind, notice in seen.items()}
        emulator.serve(GCP_UPCOMING, gcp_upcoming(start, end, status="ONGOING"))
        await eventually(
            lambda: kinds(overlay)[MaintenanceKind.HOST_MAINTENANCE].status is MaintenanceStatus.STARTED,
            timeout=5,
            what="the maintenance to be under way",
        )
        assert {kind: notice.notice_id for kind, notice in kinds(overlay).items()} == ids

        emulator.serve(GCP_EVENT, "TERMINATE_ON_HOST_MAINTENANCE")
        await eventually(lambda: MaintenanceKind.TERMINATE in kinds(overlay), timeout=5, what="the terminate notice")
        assert MaintenanceKind.LIVE_MIGRATE not in kinds(overlay)
        emulator.serve(GCP_EVENT, "NONE")
        emulator.serve(GCP_PREEMPTED, "FALSE")
        emulator.serve(GCP_UPCOMING, None)
        await eventually(lambda: not notices(overlay), timeout=5, what="every GCP notice to go")

    assert all(r.headers.get("metadata-flavor") == "Google" for r in emulator.received())


async def test_gcp_long_poll_returns_as_soon_as_the_value_changes(emulator: CloudNoticeEmulator) -> None:
    channel = GcpMaintenanceNotices(vm_name=VM, base_url=emulator.url, poll_interval_s=1.0, long_poll_timeout_s=10)
    async with NoticeOverlay(base_source(), channels=[channel]) as overlay:
        await eventually(
            lambda: any(r.query.get("wait_for_change") == "true" for r in emulator.received(GCP_EVENT)),
            timeout=5,
            what="the first long-poll",
        )
        waiting = [r for r in emulator.received(GCP_EVENT) if r.query.get("wait_for_change") == "true"][0]
        assert waiting.query == {"wait_for_change": "true", "last_etag": emulator.etag(GCP_EVENT), "timeout_sec": "10"}
        assert waiting.headers.get("metadata-flavor") == "Google"

        emulator.serve(GCP_EVENT, "TERMINATE_ON_HOST_MAINTENANCE")
        took = await eventually(lambda: MaintenanceKind.TERMINATE in kinds(overlay), timeout=5, what="the change")
        assert took < 0.2, f"the long-poll took {took:.3f} s to deliver a change (the poll interval is 1 s)"

        # The next long-poll waits on the new ETag; a failed one keeps the view and is retried after a backoff.
        await eventually(
            lambda: emulator.received(GCP_EVENT)[-1].query.get("last_etag") == emulator.etag(GCP_EVENT),
            timeout=5,
            what="a long-poll on the new value",
        )
        emulator.fail_next(1, Fault.UNAVAILABLE, path=GCP_EVENT)
        emulator.serve(GCP_EVENT, "NONE")
        await eventually(lambda: channel.health.failures == 1, timeout=5, what="the 503")
        assert MaintenanceKind.TERMINATE in kinds(overlay), "a 503 leaves the last valid view"
        await eventually(lambda: not notices(overlay), timeout=5, what="recovery after the 503")


# --- bad input -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Endpoint:
    """One endpoint under test: a channel reading it, and documents carrying notice A or notice B."""

    cloud: str
    path: str
    doc: Callable[[int], object]
    """The good document carrying notice `n` (1: A, 2: B)."""
    is_notice: Callable[[MaintenanceNotice, int], bool]

    def channel(self, url: str) -> PollingChannel:
        if self.cloud == "azure":
            return AzureScheduledEvents(vm_name=VM, base_url=url, **FAST)
        if self.cloud == "aws":
            return AwsInstanceNotices(instance_id="i-0123456789abcdef0", base_url=url, **FAST)
        return GcpMaintenanceNotices(vm_name=VM, base_url=url, long_poll=False, **FAST)


WHEN = {n: whole_seconds(datetime(2030, 3, 4, 5, 6, 7, tzinfo=UTC) + timedelta(hours=n)) for n in (1, 2)}

AZURE_EVENTS = Endpoint(
    "azure",
    AZURE,
    lambda n: azure_doc(10 + n, azure_event(AZURE_IDS[n], "Redeploy", not_before=WHEN[n])),
    lambda notice, n: notice.notice_id == AZURE_IDS[n],
)
AWS_SPOT_ACTION = Endpoint(
    "aws",
    AWS_SPOT,
    lambda n: {"action": "terminate", "time": iso(WHEN[n])},
    lambda notice, n: notice.not_before == WHEN[n],
)
AWS_SCHEDULED_EVENTS = Endpoint(
    "aws",
    AWS_SCHEDULED,
    lambda n: [aws_event(f"instance-event-{n:017d}", "system-maintenance", not_before=WHEN[n], not_after=None)],
    lambda notice, n: notice.notice_id == f"instance-event-{n:017d}",
)
GCP_MAINTENANCE_EVENT = Endpoint(
    "gcp",
    GCP_EVENT,
    lambda n: "MIGRATE_ON_HOST_MAINTENANCE" if n == 1 else "TERMINATE_ON_HOST_MAINTENANCE",
    lambda notice, n: notice.kind is (MaintenanceKind.LIVE_MIGRATE if n == 1 else MaintenanceKind.TERMINATE),
)
GCP_UPCOMING_MAINTENANCE = Endpoint(
    "gcp",
    GCP_UPCOMING,
    lambda n: gcp_upcoming(WHEN[n], WHEN[n] + timedelta(hours=1)),
    lambda notice, n: notice.not_before == WHEN[n],
)


def _without(document: dict[str, Any], *fields: str) -> dict[str, Any]:
    return {k: v for k, v in document.items() if k not in fields}


def _azure_b(**changes: Any) -> dict[str, Any]:
    event = {**azure_event(AZURE_IDS[2], "Redeploy", not_before=WHEN[2]), **changes}
    return azure_doc(12, event)


BAD_INPUTS: list[tuple[str, Endpoint, Fault | Reply]] = [
    *[
        (f"{endpoint.cloud}-{endpoint.path.rsplit('/', 1)[-1]}-{fault.value}", endpoint, fault)
        for endpoint in (AZURE_EVENTS, AWS_SPOT_ACTION, AWS_SCHEDULED_EVENTS, GCP_MAINTENANCE_EVENT)
        for fault in Fault
    ],
    ("azure-unknown-event-type", AZURE_EVENTS, Reply(_text(_azure_b(EventType="LiveMigrate")))),
    ("azure-incarnation-backwards", AZURE_EVENTS, Reply(_text(azure_doc(3, _azure_b()["Events"][0])))),
    ("azure-partial-event", AZURE_EVENTS, Reply(_text(azure_doc(12, _without(_azure_b()["Events"][0], "NotBefore"))))),
    ("azure-no-events-list", AZURE_EVENTS, Reply(_text({"DocumentIncarnation": 12}))),
    ("azure-time-not-rfc1123", AZURE_EVENTS, Reply(_text(_azure_b(NotBefore=iso(WHEN[2]))))),
    ("azure-scheduled-without-time", AZURE_EVENTS, Reply(_text(_azure_b(NotBefore="")))),
    ("aws-spot-unknown-action", AWS_SPOT_ACTION, Reply(_text({"action": "reboot", "time": iso(WHEN[2])}))),
    ("aws-spot-partial", AWS_SPOT_ACTION, Reply(_text({"action": "terminate"}))),
    ("aws-spot-time-not-iso", AWS_SPOT_ACTION, Reply(_text({"action": "terminate", "time": aws_time(WHEN[2])}))),
    (
        "aws-scheduled-unknown-code",
        AWS_SCHEDULED_EVENTS,
        Reply(_text([{**aws_event("instance-event-2", "host-swap", not_before=WHEN[2], not_after=None)}])),
    ),
    (
        "aws-scheduled-time-not-aws-format",
        AWS_SCHEDULED_EVENTS,
        Reply(
            _text(
                [
                    {
                        **aws_event("instance-event-2", "system-reboot", not_before=WHEN[2], not_after=None),
                        "NotBefore": iso(WHEN[2]),
                    }
                ]
            )
        ),
    ),
    ("aws-scheduled-not-a-list", AWS_SCHEDULED_EVENTS, Reply(_text({"Code": "system-reboot"}))),
    ("aws-spot-500", AWS_SPOT_ACTION, Reply("Internal Server Error", status=500)),
    ("gcp-unknown-maintenance-value", GCP_MAINTENANCE_EVENT, Reply("SHUTDOWN_ON_HOST_MAINTENANCE")),
    ("gcp-not-the-metadata-server", GCP_MAINTENANCE_EVENT, Reply("TERMINATE_ON_HOST_MAINTENANCE", bare=True)),
    ("gcp-upcoming-partial", GCP_UPCOMING_MAINTENANCE, Reply(_text(_without(gcp_upcoming(WHEN[2], WHEN[2]), "type")))),
    (
        "gcp-upcoming-window-backwards",
        GCP_UPCOMING_MAINTENANCE,
        Reply(_text(gcp_upcoming(WHEN[2], WHEN[2] - timedelta(hours=1)))),
    ),
    *[(f"gcp-upcoming-{fault.value}", GCP_UPCOMING_MAINTENANCE, fault) for fault in Fault],
]


@pytest.mark.parametrize(("endpoint", "bad"), [(e, b) for _, e, b in BAD_INPUTS], ids=[n for n, _, _ in BAD_INPUTS])
async def test_bad_input_keeps_the_last_valid_view_and_the_channel_recovers(
    emulator: CloudNoticeEmulator, endpoint: Endpoint, bad: Fault | Reply
) -> None:
    channel = endpoint.channel(emulator.url)
    emulator.serve(endpoint.path, endpoint.doc(1))

    def has(n: int) -> bool:
        return any(endpoint.is_notice(notice, n) for notice in overlay.sample().maintenance)

    async with NoticeOverlay(base_source(), channels=[channel]) as overlay:
        await eventually(lambda: has(1), timeout=5, what="notice A from a good document")
        failures = channel.health.failures

        # Two bad answers in a row, then a good document with notice B is standing.
        if isinstance(bad, Fault):
            emulator.fail_next(2, bad, path=endpoint.path)
        else:
            emulator.answer_next(endpoint.path, bad, bad)
        emulator.serve(endpoint.path, endpoint.doc(2))

        deadline = time.monotonic() + 5
        while True:
            sample = overlay.sample()  # read before asking what is pending: B may only show once nothing is
            if emulator.pending(endpoint.path) == 0:
                break
            assert any(endpoint.is_notice(n, 1) for n in sample.maintenance), "the last valid view is kept"
            assert not any(endpoint.is_notice(n, 2) for n in sample.maintenance), "no notice from a bad answer"
            assert time.monotonic() < deadline, "the bad answers were not all asked for"
            await asyncio.sleep(0.005)  # not a wait for an outcome: the channel's turn to poll
        # Each bad answer counted as a failed poll: none was taken for a document (the last one included).
        await eventually(lambda: channel.health.failures >= failures + 2, timeout=5, what="both bad answers counted")

        await eventually(lambda: has(2) and not has(1), timeout=5, what="recovery: B replaces A")
        await eventually(lambda: not channel.health.failing, timeout=5, what="a whole good poll")


# --- the overlay ---------------------------------------------------------------------------------------------------


async def test_overlay_adds_every_channel_to_the_base_source_without_polling_in_sample(
    emulator: CloudNoticeEmulator,
) -> None:
    scenario = parse_scenario(
        {
            "hosts": {"h1": {"gpus": 2}},
            "maintenance": [
                {"host": "h1", "notice": "tkt-7", "kind": "reboot", "announce": "0s", "start": "1h", "end": "2h"}
            ],
            "failures": [{"host": "h1", "at": "0s", "kind": "degraded", "gpu": 1, "reason": "thermal"}],
        }
    )
    base = SimulatedHost("h1", scenario=scenario, seed=1, clock=ManualClock(datetime.now(UTC)))
    azure = AzureScheduledEvents(vm_name=VM, base_url=emulator.url, poll_interval_s=INTERVAL)
    aws = AwsInstanceNotices(instance_id="i-0123456789abcdef0", base_url=emulator.url, poll_interval_s=INTERVAL)
    emulator.serve(AZURE, azure_doc(2, azure_event(AZURE_IDS[1], "Freeze", not_before=soon(900), duration_s=5)))
    retire_at = soon(86400)
    emulator.serve(
        AWS_SCHEDULED, [aws_event("instance-event-1", "instance-retirement", not_before=retire_at, not_after=None)]
    )
    overlay = NoticeOverlay(base, channels=[azure, aws])
    assert (overlay.host, overlay.locality_group) == (base.host, base.locality_group)
    assert set(notices(overlay)) == {"tkt-7"}, "nothing from the channels before they have polled"
    async with overlay:
        await eventually(lambda: len(notices(overlay)) == 3, timeout=5, what="base, Azure and AWS notices")

    # Stopped, the channels poll no more, yet samples still carry their last views: sample() only reads them.
    requests = len(emulator.received())
    samples = [overlay.sample() for _ in range(100)]
    assert len(emulator.received()) == requests
    sample = samples[-1]
    assert {n.notice_id for n in sample.maintenance} == {"tkt-7", AZURE_IDS[1], "instance-event-1"}
    assert sample.gpus == base.sample().gpus
    degraded = [f for f in sample.failures if f.kind is RawFailureKind.DEGRADED]
    predicted = [f for f in sample.failures if f.kind is RawFailureKind.PREDICTED_FAILURE]
    assert [f.gpu_index for f in degraded] == [1], "the base source's failure stays"
    assert [(f.eta, f.reason) for f in predicted] == [(retire_at, "instance_retirement")], "AWS's retirement joins it"
