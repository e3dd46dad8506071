"""Azure Scheduled Events (the Instance Metadata Service's `scheduledevents` document) as maintenance notices.

One GET returns every pending event of the VM's availability set or scale set; only those whose `Resources` name
this VM concern this host. The document has a `DocumentIncarnation` that only grows: one lower than the last
accepted is a stale replica's answer and is refused, as is any document with an event we cannot read completely
(an unknown `EventType` included: guessing its kind would tell tenants something the cloud did not say). A refused
document changes nothing; the last accepted one stands.

The cloud's `EventId` is the notice id, `NotBefore` the start (`Started` events may come without one: the start we
saw earlier is kept, or the moment it was first seen), `DurationInSeconds` the length when not -1. Azure lets the VM
approve an event so it starts before `NotBefore` (`approve`), so every notice carries `early_approval`. An approval
lets the event proceed for *every* VM its `Resources` name, not only the one that sends it: an agent, which answers
for its own host only, therefore starts early only events that name this VM alone (`early_start_refusal`).
Typical lead times: Preempt ~30 s, Freeze/Reboot/Redeploy ~15 min, Terminate as configured on the scale set.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, TypeAdapter

from harmonaize.events import MaintenanceKind, MaintenanceStatus
from provider_agents.clock import Clock
from provider_agents.telemetry.model import MaintenanceNotice
from provider_agents.telemetry.notices.channel import (
    BadDocument,
    NoticeView,
    TimedNotice,
    estimated_end,
    parse_document,
)
from provider_agents.telemetry.notices.http import DEFAULT_BACKOFF_CAP_S, DEFAULT_TIMEOUT_S, PollingChannel
from provider_agents.telemetry.notices.times import parse_rfc1123

__all__ = ["AZURE_API_VERSION", "AZURE_IMDS_URL", "AzureEventType", "AzureScheduledEvents"]

AZURE_IMDS_URL = "http://169.254.169.254"
AZURE_API_VERSION = "2020-07-01"
EVENTS_PATH = "/metadata/scheduledevents"


class AzureEventType(StrEnum):
    FREEZE = "Freeze"
    REBOOT = "Reboot"
    REDEPLOY = "Redeploy"
    PREEMPT = "Preempt"
    TERMINATE = "Terminate"


KINDS = {
    AzureEventType.FREEZE: MaintenanceKind.FREEZE,
    AzureEventType.REBOOT: MaintenanceKind.REBOOT,
    AzureEventType.REDEPLOY: MaintenanceKind.REDEPLOY,
    AzureEventType.PREEMPT: MaintenanceKind.PREEMPT,
    AzureEventType.TERMINATE: MaintenanceKind.TERMINATE,
}
assert set(KINDS) == set(AzureEventType)


class _Event(BaseModel):
    """One event as documented; fields we do not use are not checked, fields we use are."""

    model_config = ConfigDict(extra="ignore")

    EventId: str = Field(min_length=1, max_length=200)
    EventType: AzureEventType
    Resources: list[str]
    EventStatus: Literal["Scheduled", "Started"]
    NotBefore: str
    DurationInSeconds: StrictInt = -1


class _Document(BaseModel):
    model_config = ConfigDict(extra="ignore")

    DocumentIncarnation: StrictInt = Field(ge=0)
    Events: list[_Event]


_DOCUMENT = TypeAdapter(_Document)


class AzureScheduledEvents(PollingChannel):
    """Polls Azure Scheduled Events for the VM named `vm_name` (as it appears in an event's `Resources`)."""

    def __init__(
        self,
        *,
        vm_name: str,
        base_url: str = AZURE_IMDS_URL,
        poll_interval_s: float = 1.0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        backoff_cap_s: float = DEFAULT_BACKOFF_CAP_S,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(
            name=f"azure:{vm_name}",
            base_url=base_url,
            headers={"Metadata": "true"},
            poll_interval_s=poll_interval_s,
            timeout_s=timeout_s,
            backoff_cap_s=backoff_cap_s,
            clock=clock,
        )
        self.vm_name = vm_name
        self.incarnation: int | None = None
        self._notices: tuple[TimedNotice, ...] = ()
        self._resources: dict[str, frozenset[str]] = {}

    def view(self, now: datetime) -> NoticeView:
        return NoticeView(maintenance=tuple(notice.at(now) for notice in self._notices))

    async def poll_once(self) -> float | None:
        answer = await self.http.fetch("GET", EVENTS_PATH, params={"api-version": AZURE_API_VERSION}, expect=(200,))
        self._accept(answer.text, now=self.clock.now())
        return None

    def early_start_refusal(self, notice_id: str) -> str | None:
        """None when `notice_id` is a pending event of this VM alone; else why it is not started early."""
        resources = self._resources.get(notice_id)
        if resources is None:
            return "the maintenance is no longer announced"
        if resources != {self.vm_name.casefold()}:
            return "this maintenance covers other machines too: only a single host's maintenance is started early"
        return None

    async def approve(self, event_id: str) -> None:
        """Ask Azure to start `event_id` now instead of at its `NotBefore` (`StartRequests`); `FetchError` if refused.

        Not retried here: approving is a decision, and whoever made it should hear that it did not go through.
        """
        if not event_id:
            raise ValueError("event_id must not be empty")
        await self.http.fetch(
            "POST",
            EVENTS_PATH,
            params={"api-version": AZURE_API_VERSION},
            json={"StartRequests": [{"EventId": event_id}]},
            expect=(200,),
        )

    def _accept(self, text: str, *, now: datetime) -> None:
        """Replace the view with `text`'s notices, or raise `BadDocument` and leave the view as it was."""
        document = parse_document(_DOCUMENT, text, what="scheduledevents")
        if self.incarnation is not None and document.DocumentIncarnation < self.incarnation:
            raise BadDocument(
                "scheduledevents: incarnation went backwards",
                f"scheduledevents: DocumentIncarnation {document.DocumentIncarnation} is older than the accepted "
                f"{self.incarnation}",
            )
        known = {timed.notice.notice_id: timed.notice.not_before for timed in self._notices}
        me = self.vm_name.casefold()
        # Every event is read, this VM's or not: a document with one unreadable event is not trusted at all.
        readable = [(event, self._notice(event, started_at=known.get(event.EventId, now))) for event in document.Events]
        notices = tuple(
            TimedNotice(notice)
            for event, notice in readable
            if me in {resource.casefold() for resource in event.Resources}
        )
        self.incarnation = document.DocumentIncarnation
        self._notices = notices
        self._resources = {
            event.EventId: frozenset(resource.casefold() for resource in event.Resources)
            for event, _ in readable
            if me in {resource.casefold() for resource in event.Resources}
        }

    def _notice(self, event: _Event, *, started_at: datetime) -> MaintenanceNotice:
        if event.NotBefore:
            try:
                not_before = parse_rfc1123(event.NotBefore)
            except ValueError as exc:
                raise BadDocument("scheduledevents: bad NotBefore", f"scheduledevents: {exc}") from None
        elif event.EventStatus == "Started":
            not_before = started_at
        else:
            raise BadDocument(
                "scheduledevents: Scheduled without NotBefore",
                f"scheduledevents: event {event.EventId} is Scheduled but has no NotBefore",
            )
        kind = KINDS[event.EventType]
        if event.DurationInSeconds >= 0:
            not_after = not_before + timedelta(seconds=event.DurationInSeconds)
        else:
            not_after = estimated_end(kind, not_before)
        return MaintenanceNotice(
            notice_id=event.EventId,
            kind=kind,
            status=MaintenanceStatus.SCHEDULED if event.EventStatus == "Scheduled" else MaintenanceStatus.STARTED,
            not_before=not_before,
            not_after=not_after,
            early_approval=True,
        )
