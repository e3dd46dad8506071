"""AWS instance metadata (IMDSv2) notices: Spot interruptions, rebalance recommendations, scheduled events, and the
end of a Capacity Block.

IMDSv2 wants a session token: PUT `latest/api/token` (TTL header) once, then send it with every GET; a 401 means it
expired (or the service restarted), so a new one is fetched and the GET retried once. The three documents are read
in one poll, concurrently, and each keeps its own last valid answer: a broken `events/maintenance/scheduled` must not
hide a Spot interruption. 404 means "none" for all three.

| endpoint                               | notice                                                              |
|----------------------------------------|---------------------------------------------------------------------|
| `spot/instance-action`                 | `preempt` / `stop` / `hibernate` at `time` (two minutes ahead)      |
| `events/recommendations/rebalance`     | `rebalance_recommendation` from `noticeTime`                        |
| `events/maintenance/scheduled`         | one per event, its `EventId`, `NotBefore` / `NotAfter`, its `State` |
| `capacity_block_end` (constructor)     | `terminate` or `stop`, announced 40 min before the end, from 30 min |

Spot and rebalance notices have no id of their own; theirs is derived from the instance and the notice's time, so it
is the same on every poll and differs between instances. Their status follows the clock. An `instance-retirement`
event (AWS retires an instance whose hardware has failed beyond repair) also becomes a predicted failure of the host.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from harmonaize.events import MaintenanceKind, MaintenanceStatus
from harmonaize.times import format_rfc3339
from provider_agents.clock import Clock
from provider_agents.telemetry.model import FailureSignal, MaintenanceNotice, RawFailureKind
from provider_agents.telemetry.notices.channel import (
    BadDocument,
    NoticeView,
    TimedNotice,
    estimated_end,
    parse_document,
)
from provider_agents.telemetry.notices.http import (
    DEFAULT_BACKOFF_CAP_S,
    DEFAULT_TIMEOUT_S,
    Answer,
    PollingChannel,
)
from provider_agents.telemetry.notices.times import parse_aws_event_time, parse_iso8601_utc

__all__ = [
    "AWS_IMDS_URL",
    "CAPACITY_BLOCK_RECLAIM",
    "CAPACITY_BLOCK_WARNING",
    "AwsEventCode",
    "AwsInstanceNotices",
]

AWS_IMDS_URL = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
SPOT_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
SCHEDULED_PATH = "/latest/meta-data/events/maintenance/scheduled"
TOKEN_TTL_S = 21600
TOKEN_RENEW_MARGIN_S = 60.0
CAPACITY_BLOCK_WARNING = timedelta(minutes=40)
"""AWS warns a Capacity Block's instances this long before the block ends..."""
CAPACITY_BLOCK_RECLAIM = timedelta(minutes=30)
"""...and starts reclaiming them this long before it ends."""
RETIREMENT_CONFIDENCE = 1.0
"""A retirement is AWS's own verdict on the hardware, and the instance will be stopped: nothing is left to chance."""


class AwsEventCode(StrEnum):
    INSTANCE_REBOOT = "instance-reboot"
    SYSTEM_REBOOT = "system-reboot"
    SYSTEM_MAINTENANCE = "system-maintenance"
    INSTANCE_RETIREMENT = "instance-retirement"
    INSTANCE_STOP = "instance-stop"


EVENT_KINDS = {
    AwsEventCode.INSTANCE_REBOOT: MaintenanceKind.REBOOT,
    AwsEventCode.SYSTEM_REBOOT: MaintenanceKind.REBOOT,
    AwsEventCode.SYSTEM_MAINTENANCE: MaintenanceKind.HOST_MAINTENANCE,
    AwsEventCode.INSTANCE_RETIREMENT: MaintenanceKind.RETIRE,
    AwsEventCode.INSTANCE_STOP: MaintenanceKind.STOP,
}
assert set(EVENT_KINDS) == set(AwsEventCode)
SPOT_KINDS = {
    "terminate": MaintenanceKind.PREEMPT,
    "stop": MaintenanceKind.STOP,
    "hibernate": MaintenanceKind.HIBERNATE,
}
EVENT_STATES = {"completed": MaintenanceStatus.COMPLETED, "canceled": MaintenanceStatus.CANCELLED}


class _Document(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _SpotAction(_Document):
    action: Literal["terminate", "stop", "hibernate"]
    time: str


class _Rebalance(_Document):
    noticeTime: str


class _ScheduledEvent(_Document):
    Code: AwsEventCode
    EventId: str = Field(min_length=1, max_length=200)
    NotBefore: str
    NotAfter: str | None = None
    State: Literal["active", "completed", "canceled"]


_SPOT = TypeAdapter(_SpotAction)
_REBALANCE = TypeAdapter(_Rebalance)
_SCHEDULED = TypeAdapter(list[_ScheduledEvent])


class AwsInstanceNotices(PollingChannel):
    """Polls IMDSv2 for the notices of the instance `instance_id` (which only names the derived notice ids)."""

    def __init__(
        self,
        *,
        instance_id: str,
        base_url: str = AWS_IMDS_URL,
        poll_interval_s: float = 5.0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        backoff_cap_s: float = DEFAULT_BACKOFF_CAP_S,
        capacity_block_end: datetime | None = None,
        capacity_block_action: MaintenanceKind = MaintenanceKind.TERMINATE,
        clock: Clock | None = None,
    ) -> None:
        if capacity_block_end is not None and capacity_block_end.tzinfo is None:
            raise ValueError("capacity_block_end must be timezone-aware")
        if capacity_block_action not in (MaintenanceKind.TERMINATE, MaintenanceKind.STOP):
            raise ValueError("a Capacity Block ends in terminate or stop")
        super().__init__(
            name=f"aws:{instance_id}",
            base_url=base_url,
            headers={},
            poll_interval_s=poll_interval_s,
            timeout_s=timeout_s,
            backoff_cap_s=backoff_cap_s,
            clock=clock,
        )
        self.instance_id = instance_id
        self.capacity_block_end = capacity_block_end
        self.capacity_block_action = capacity_block_action
        self.tokens_fetched = 0
        self._token: str | None = None
        self._token_expires = 0.0
        self._token_lock = asyncio.Lock()
        self._spot: tuple[TimedNotice, ...] = ()
        self._rebalance: tuple[TimedNotice, ...] = ()
        self._scheduled: tuple[TimedNotice, ...] = ()
        self._retirements: tuple[FailureSignal, ...] = ()
        self._first_seen: dict[str, datetime] = {}

    def view(self, now: datetime) -> NoticeView:
        timed = (*self._spot, *self._rebalance, *self._scheduled)
        notices = tuple(notice.at(now) for notice in timed)
        block = self._capacity_block(now)
        return NoticeView(maintenance=notices if block is None else (*notices, block), failures=self._retirements)

    async def poll_once(self) -> float | None:
        await self._session_token()  # once, before the three GETs race for it
        polls: list[Awaitable[None]] = [self._poll_spot(), self._poll_rebalance(), self._poll_scheduled()]
        results = await asyncio.gather(*polls, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return None

    # --- IMDSv2 session ----------------------------------------------------------------------------------------------

    async def _session_token(self, *, stale: str | None = None) -> str:
        """The current token; a new one when there is none, it is about to expire, or `stale` was refused."""
        async with self._token_lock:
            now = self.clock.monotonic()
            if self._token is None or self._token == stale or now >= self._token_expires:
                answer = await self.http.fetch(
                    "PUT", TOKEN_PATH, headers={TOKEN_TTL_HEADER: str(TOKEN_TTL_S)}, expect=(200,)
                )
                token = answer.text.strip()
                if not token:
                    raise BadDocument("api/token: empty", "api/token: the token is empty")
                self._token = token
                self._token_expires = now + TOKEN_TTL_S - TOKEN_RENEW_MARGIN_S
                self.tokens_fetched += 1
            return self._token

    async def _get(self, path: str) -> Answer:
        token = await self._session_token()
        answer = await self.http.fetch("GET", path, headers={TOKEN_HEADER: token}, expect=(200, 401, 404))
        if answer.status == 401:
            token = await self._session_token(stale=token)
            answer = await self.http.fetch("GET", path, headers={TOKEN_HEADER: token}, expect=(200, 404))
        return answer

    # --- the three documents -------------------------------------------------------------------------------------

    async def _poll_spot(self) -> None:
        answer = await self._get(SPOT_PATH)
        if answer.status == 404:
            self._spot = ()
            return
        action = parse_document(_SPOT, answer.text, what="spot/instance-action")
        at = _time(parse_iso8601_utc, action.time, what="spot/instance-action")
        kind = SPOT_KINDS[action.action]
        notice = MaintenanceNotice(
            notice_id=f"aws-spot-{self.instance_id}-{action.action}-{format_rfc3339(at)}",
            kind=kind,
            status=MaintenanceStatus.SCHEDULED,
            not_before=at,
            not_after=estimated_end(kind, at),
        )
        self._spot = (TimedNotice(notice, follows_clock=True),)

    async def _poll_rebalance(self) -> None:
        answer = await self._get(REBALANCE_PATH)
        if answer.status == 404:
            self._rebalance = ()
            return
        recommendation = parse_document(_REBALANCE, answer.text, what="rebalance")
        at = _time(parse_iso8601_utc, recommendation.noticeTime, what="rebalance")
        kind = MaintenanceKind.REBALANCE_RECOMMENDATION
        notice = MaintenanceNotice(
            notice_id=f"aws-rebalance-{self.instance_id}-{format_rfc3339(at)}",
            kind=kind,
            status=MaintenanceStatus.SCHEDULED,
            not_before=at,
            not_after=estimated_end(kind, at),
        )
        self._rebalance = (TimedNotice(notice, follows_clock=True),)

    async def _poll_scheduled(self) -> None:
        answer = await self._get(SCHEDULED_PATH)
        events = [] if answer.status == 404 else parse_document(_SCHEDULED, answer.text, what="scheduled events")
        now = self.clock.now()
        notices, retirements = [], []
        for event in events:
            kind = EVENT_KINDS[event.Code]
            not_before = _time(parse_aws_event_time, event.NotBefore, what="scheduled events")
            if event.NotAfter:
                not_after = _time(parse_aws_event_time, event.NotAfter, what="scheduled events")
            else:
                not_after = estimated_end(kind, not_before)
            if not_after < not_before:
                message = f"scheduled events: {event.EventId} ends before it starts"
                raise BadDocument("scheduled events: window", message)
            state = EVENT_STATES.get(event.State)
            notices.append(
                TimedNotice(
                    MaintenanceNotice(
                        notice_id=event.EventId,
                        kind=kind,
                        status=state or MaintenanceStatus.SCHEDULED,
                        not_before=not_before,
                        not_after=not_after,
                    ),
                    follows_clock=state is None,
                )
            )
            if event.Code is AwsEventCode.INSTANCE_RETIREMENT and state is None:
                seen = self._first_seen.get(event.EventId, now)
                retirements.append(
                    FailureSignal(
                        kind=RawFailureKind.PREDICTED_FAILURE,
                        component=f"aws-retirement-{event.EventId}",
                        detected_at=min(seen, not_before),
                        reason="instance_retirement",
                        eta=not_before,
                        confidence=RETIREMENT_CONFIDENCE,
                    )
                )
        self._first_seen = {event.EventId: self._first_seen.get(event.EventId, now) for event in events}
        self._scheduled = tuple(notices)
        self._retirements = tuple(retirements)

    def _capacity_block(self, now: datetime) -> MaintenanceNotice | None:
        end = self.capacity_block_end
        if end is None or now < end - CAPACITY_BLOCK_WARNING:
            return None
        not_before = end - CAPACITY_BLOCK_RECLAIM
        if now < not_before:
            status = MaintenanceStatus.SCHEDULED
        elif now < end:
            status = MaintenanceStatus.STARTED
        else:
            status = MaintenanceStatus.COMPLETED
        return MaintenanceNotice(
            notice_id=f"aws-capacity-block-{self.instance_id}-{format_rfc3339(end)}",
            kind=self.capacity_block_action,
            status=status,
            not_before=not_before,
            not_after=end,
        )


def _time(parse: Callable[[str], datetime], text: str, *, what: str) -> datetime:
    """`parse(text)`, a `BadDocument` when the time is not in the documented format."""
    try:
        return parse(text)
    except ValueError as exc:
        raise BadDocument(f"{what}: bad time", f"{what}: {exc}") from None
