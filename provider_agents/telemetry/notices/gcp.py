"""GCP metadata server notices: host maintenance events, preemption, and upcoming maintenance windows.

| endpoint (under `computeMetadata/v1/instance/`) | notice                                                       |
|------------------------------------------------|--------------------------------------------------------------|
| `maintenance-event` `MIGRATE_ON_HOST_MAINTENANCE` | `live_migrate`, from 60 s after it was first seen          |
| `maintenance-event` `TERMINATE_ON_HOST_MAINTENANCE` | `terminate`, likewise                                    |
| `preempted` `TRUE`                             | `preempt`, started: the guest is shutting down, gone in 30 s |
| `upcoming-maintenance` (JSON, 404 when none)   | `host_maintenance` over the announced window                 |

GCP gives about 60 s notice through `maintenance-event`, and the value stays set until the event is over, so the
window is anchored at the moment this process first saw the value (an agent restarted mid-event sees it late and
says so: its `not_before` is later than the cloud's). Every request carries `Metadata-Flavor: Google`, and an answer
without that header did not come from the metadata server and is refused.

`maintenance-event` can be long-polled (`wait_for_change=true&last_etag=...`): the server holds the request until
the value changes, so the change arrives within milliseconds instead of within a poll interval. With `long_poll`
(the default) it is watched that way in a loop of its own, and the other two endpoints are polled.

GCP's notices have no ids. A maintenance event's id is derived from this VM, the value, its ETag and when it was
first seen; an upcoming maintenance's from this VM, its type and its latest possible start (`latest_window_start_time`,
which stays put when the window is rescheduled). Either id is kept while the notice lasts: across reschedules and
PENDING -> ONGOING; a different `latest_window_start_time` is a different maintenance.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter

from harmonaize.events import MaintenanceKind, MaintenanceStatus
from harmonaize.times import format_rfc3339
from provider_agents.clock import Clock
from provider_agents.telemetry.model import MaintenanceNotice
from provider_agents.telemetry.notices.channel import (
    BadDocument,
    NoticeView,
    TimedNotice,
    derived_id,
    estimated_end,
    parse_document,
)
from provider_agents.telemetry.notices.http import (
    DEFAULT_BACKOFF_CAP_S,
    DEFAULT_TIMEOUT_S,
    Answer,
    PollingChannel,
    PollOnce,
)
from provider_agents.telemetry.notices.times import parse_rfc3339

__all__ = ["GCP_METADATA_URL", "MAINTENANCE_EVENT_LEAD", "PREEMPTION_NOTICE", "GcpMaintenanceNotices"]

GCP_METADATA_URL = "http://metadata.google.internal"
INSTANCE = "/computeMetadata/v1/instance"
MAINTENANCE_EVENT_PATH = f"{INSTANCE}/maintenance-event"
PREEMPTED_PATH = f"{INSTANCE}/preempted"
UPCOMING_PATH = f"{INSTANCE}/upcoming-maintenance"
FLAVOR = {"Metadata-Flavor": "Google"}
MAINTENANCE_EVENT_LEAD = timedelta(seconds=60)
"""How long before a live migration or termination GCP sets `maintenance-event` (documented: about 60 s)."""
PREEMPTION_NOTICE = timedelta(seconds=30)
"""How long a preempted VM has between the notice and being stopped (documented: about 30 s)."""
EVENT_KINDS = {
    "MIGRATE_ON_HOST_MAINTENANCE": MaintenanceKind.LIVE_MIGRATE,
    "TERMINATE_ON_HOST_MAINTENANCE": MaintenanceKind.TERMINATE,
}
NO_EVENT = "NONE"


class _Upcoming(BaseModel):
    model_config = ConfigDict(extra="ignore")

    maintenance_status: Literal["PENDING", "ONGOING"]
    type: Literal["SCHEDULED", "UNSCHEDULED"]
    window_start_time: str
    window_end_time: str | None = None
    latest_window_start_time: str | None = None
    can_reschedule: bool | Literal["true", "false"] | None = None  # documented as a boolean, served as a string too


_UPCOMING = TypeAdapter(_Upcoming)


@dataclass(frozen=True)
class _Seen:
    """A value, and the notice it became when it was first seen."""

    value: str
    notice: TimedNotice


class GcpMaintenanceNotices(PollingChannel):
    """Polls (and long-polls) the GCP metadata server for the VM `vm_name` (which names the derived notice ids)."""

    def __init__(
        self,
        *,
        vm_name: str,
        base_url: str = GCP_METADATA_URL,
        poll_interval_s: float = 1.0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        backoff_cap_s: float = DEFAULT_BACKOFF_CAP_S,
        long_poll: bool = True,
        long_poll_timeout_s: int = 30,
        clock: Clock | None = None,
    ) -> None:
        if long_poll_timeout_s < 1:
            raise ValueError("long_poll_timeout_s must be at least 1 (the server counts whole seconds)")
        super().__init__(
            name=f"gcp:{vm_name}",
            base_url=base_url,
            headers=FLAVOR,
            poll_interval_s=poll_interval_s,
            timeout_s=timeout_s,
            backoff_cap_s=backoff_cap_s,
            clock=clock,
        )
        self.vm_name = vm_name
        self.long_poll = long_poll
        self.long_poll_timeout_s = long_poll_timeout_s
        self.etag: str | None = None
        self._event: _Seen | None = None
        self._preempted: _Seen | None = None
        self._upcoming: MaintenanceNotice | None = None
        self._upcoming_latest: str | None = None

    def view(self, now: datetime) -> NoticeView:
        seen = (self._event, self._preempted)
        notices = [item.notice.at(now) for item in seen if item is not None]
        if self._upcoming is not None:
            notices.append(self._upcoming)
        return NoticeView(maintenance=tuple(notices))

    def loops(self) -> dict[str, PollOnce]:
        if not self.long_poll:
            return {"poll": self.poll_once}
        return {"poll": self.poll_once, "maintenance-event": self.watch_maintenance_event}

    async def poll_once(self) -> float | None:
        polls = [self._poll_preempted(), self._poll_upcoming()]
        if not self.long_poll:
            polls.append(self._poll_maintenance_event())
        for result in await asyncio.gather(*polls, return_exceptions=True):
            if isinstance(result, BaseException):
                raise result
        return None

    async def watch_maintenance_event(self) -> float | None:
        """One long-poll of `maintenance-event` (a plain read first, for the ETag); no pause after a change."""
        before = self.etag
        if before is None:
            await self._poll_maintenance_event()
        else:
            params = {"wait_for_change": "true", "last_etag": before, "timeout_sec": str(self.long_poll_timeout_s)}
            timeout = self.long_poll_timeout_s + self.http.timeout_s
            answer = await self._fetch(MAINTENANCE_EVENT_PATH, expect=(200,), params=params, timeout_s=timeout)
            self._accept_event(answer)
        if self.etag is None:
            return None  # no ETag to wait on: plain polling, at the poll interval
        return 0.0 if self.etag != before else None

    # --- the three endpoints -------------------------------------------------------------------------------------

    async def _fetch(
        self,
        path: str,
        *,
        expect: tuple[int, ...],
        params: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Answer:
        answer = await self.http.fetch("GET", path, expect=expect, params=params, timeout_s=timeout_s)
        if answer.headers.get("Metadata-Flavor") != "Google":
            raise BadDocument(f"{path}: not the metadata server", f"{path}: the answer lacks Metadata-Flavor: Google")
        return answer

    async def _poll_maintenance_event(self) -> None:
        self._accept_event(await self._fetch(MAINTENANCE_EVENT_PATH, expect=(200,)))

    def _accept_event(self, answer: Answer) -> None:
        value = answer.text.strip()
        if value != NO_EVENT and value not in EVENT_KINDS:
            raise BadDocument("maintenance-event: unknown value", f"maintenance-event: unknown value {value[:64]!r}")
        etag = answer.headers.get("ETag")
        if value == NO_EVENT:
            self._event = None
        elif self._event is None or self._event.value != value:
            now = self.clock.now()
            kind = EVENT_KINDS[value]
            not_before = now + MAINTENANCE_EVENT_LEAD
            notice = MaintenanceNotice(
                notice_id=derived_id("gcp-maintenance", self.vm_name, value, etag or "", format_rfc3339(now)),
                kind=kind,
                status=MaintenanceStatus.SCHEDULED,
                not_before=not_before,
                not_after=estimated_end(kind, not_before),
            )
            self._event = _Seen(value=value, notice=TimedNotice(notice, follows_clock=True))
        self.etag = etag

    async def _poll_preempted(self) -> None:
        answer = await self._fetch(PREEMPTED_PATH, expect=(200,))
        value = answer.text.strip()
        if value not in ("TRUE", "FALSE"):
            raise BadDocument("preempted: unknown value", f"preempted: expected TRUE or FALSE, got {value[:64]!r}")
        if value == "FALSE":
            self._preempted = None
        elif self._preempted is None:
            now = self.clock.now()
            notice = MaintenanceNotice(
                notice_id=derived_id("gcp-preempted", self.vm_name, format_rfc3339(now)),
                kind=MaintenanceKind.PREEMPT,
                status=MaintenanceStatus.STARTED,  # the guest is being shut down already
                not_before=now,
                not_after=now + PREEMPTION_NOTICE,
            )
            self._preempted = _Seen(value=value, notice=TimedNotice(notice))

    async def _poll_upcoming(self) -> None:
        answer = await self._fetch(UPCOMING_PATH, expect=(200, 404))
        if answer.status == 404:
            self._upcoming = None
            self._upcoming_latest = None
            return
        upcoming = parse_document(_UPCOMING, answer.text, what="upcoming-maintenance")
        try:
            start = parse_rfc3339(upcoming.window_start_time)
            end = parse_rfc3339(upcoming.window_end_time) if upcoming.window_end_time else None
        except ValueError as exc:
            raise BadDocument("upcoming-maintenance: bad time", f"upcoming-maintenance: {exc}") from None
        kind = MaintenanceKind.HOST_MAINTENANCE
        if end is None:
            end = estimated_end(kind, start)
        if end < start:
            raise BadDocument("upcoming-maintenance: window", "upcoming-maintenance: the window ends before it starts")
        latest = upcoming.latest_window_start_time
        if self._upcoming is not None and (latest is None or latest == self._upcoming_latest):
            notice_id = self._upcoming.notice_id  # the same maintenance, rescheduled or under way
            latest = latest or self._upcoming_latest
        else:
            notice_id = derived_id("gcp-upcoming", self.vm_name, upcoming.type, latest or upcoming.window_start_time)
        pending = upcoming.maintenance_status == "PENDING"
        self._upcoming_latest = latest
        self._upcoming = MaintenanceNotice(
            notice_id=notice_id,
            kind=kind,
            status=MaintenanceStatus.SCHEDULED if pending else MaintenanceStatus.STARTED,
            not_before=start,
            not_after=end,
        )
