"""What a notice channel hands the overlay: its latest *valid* view of this host's cloud notices.

A channel polls a cloud's metadata service in the background and keeps what the last trustworthy answer said; the
overlay asks for that view on every telemetry sample, synchronously. Some statuses follow the clock rather than a
document (AWS spot notices have a time but no status, a GCP `maintenance-event` has neither), so a view is taken
*at* a time: the sample's.

Windows need both ends (`MaintenanceNotice.not_after`), and the clouds do not always give one. Where they do not,
`ESTIMATED_DURATION` supplies a deliberately generous per-kind guess: a tenant told the window is longer than it
turns out to be loses a little capacity, one told it is shorter may bring work back onto a host that is still down.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Protocol, TypeVar, runtime_checkable

from pydantic import TypeAdapter, ValidationError

from harmonaize.events import MaintenanceKind, MaintenanceStatus
from provider_agents.telemetry.model import FailureSignal, MaintenanceNotice

__all__ = [
    "ESTIMATED_DURATION",
    "BadDocument",
    "EarlyStartChannel",
    "NoticeChannel",
    "NoticeError",
    "NoticeView",
    "SignalChannel",
    "TimedNotice",
    "derived_id",
    "estimated_end",
    "parse_document",
]

T = TypeVar("T")

ESTIMATED_DURATION = MappingProxyType(
    {
        # Azure: a Freeze pauses the VM for seconds (memory-preserving maintenance: up to ~30 s); 5 min is margin.
        MaintenanceKind.FREEZE: timedelta(minutes=5),
        # A reboot of a GPU VM (host update, guest boot, driver load) takes minutes; no cloud bounds it.
        MaintenanceKind.REBOOT: timedelta(minutes=15),
        # Azure Redeploy moves the VM to another host: deallocate, allocate, boot; local disks are lost.
        MaintenanceKind.REDEPLOY: timedelta(minutes=30),
        # The instance goes away and does not come back in the window: it covers the shutdown only.
        MaintenanceKind.PREEMPT: timedelta(minutes=10),
        MaintenanceKind.TERMINATE: timedelta(minutes=10),
        MaintenanceKind.STOP: timedelta(minutes=10),
        MaintenanceKind.HIBERNATE: timedelta(minutes=10),
        MaintenanceKind.RETIRE: timedelta(minutes=10),
        # GCP live migration: a blackout of about a second inside a brownout that can last minutes.
        MaintenanceKind.LIVE_MIGRATE: timedelta(minutes=10),
        # AWS system-maintenance normally comes with NotAfter, GCP upcoming maintenance with its window end;
        # this is only the fallback when a document leaves the end out.
        MaintenanceKind.HOST_MAINTENANCE: timedelta(hours=2),
        # No disruption of its own: the span of elevated interruption risk we assume after the recommendation.
        MaintenanceKind.REBALANCE_RECOMMENDATION: timedelta(hours=1),
    }
)
assert set(ESTIMATED_DURATION) == set(MaintenanceKind)


class NoticeError(Exception):
    """One failed poll. `key` names the kind of failure (for logging it once per streak), the message the details;
    `retry_after_s` is what the service asked for in a `Retry-After`, if anything."""

    def __init__(self, key: str, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.retry_after_s = retry_after_s


class BadDocument(NoticeError):
    """The service answered, but not with a document we can trust: nothing from it may become a notice."""


@dataclass(frozen=True)
class TimedNotice:
    """A notice as polled. With `follows_clock`, its status is the clock's: scheduled before `not_before`, started
    from then on (for notices whose cloud gives a time but no status)."""

    notice: MaintenanceNotice
    follows_clock: bool = False

    def at(self, now: datetime) -> MaintenanceNotice:
        if not self.follows_clock:
            return self.notice
        status = MaintenanceStatus.SCHEDULED if now < self.notice.not_before else MaintenanceStatus.STARTED
        if status is self.notice.status:
            return self.notice
        return self.notice.model_copy(update={"status": status})


@dataclass(frozen=True)
class NoticeView:
    """What a channel knows now: notices for this host and, where a notice implies one, a failure signal."""

    maintenance: tuple[MaintenanceNotice, ...] = ()
    failures: tuple[FailureSignal, ...] = ()


class SignalChannel(Protocol):
    """What the overlay adds to a host's samples: a cloud's notice channel, or another source of signals about the
    host (NVSentinel's health events) whose view holds failures only."""

    name: str

    def view(self, now: datetime) -> NoticeView:
        """The latest valid view, statuses as of `now`. Synchronous and cheap: it reads, it never polls."""
        ...

    def start(self) -> None:
        """Start polling in a background task."""
        ...

    async def stop(self) -> None:
        """Stop polling and release the HTTP client."""
        ...


NoticeChannel = SignalChannel
"""A cloud's notice channel: a signal channel whose views carry maintenance notices."""


@runtime_checkable
class EarlyStartChannel(Protocol):
    """A notice channel whose cloud lets the VM start an announced maintenance before its `not_before` (Azure's
    `StartRequests`). The others' notices can only be waited for."""

    name: str

    def early_start_refusal(self, notice_id: str) -> str | None:
        """Why the channel will not start `notice_id` early, in the tenant's terms (None: it may)."""
        ...

    async def approve(self, notice_id: str) -> None:
        """Ask the cloud to start `notice_id` now; raises `NoticeError` when the cloud could not be told or refused."""
        ...


def estimated_end(kind: MaintenanceKind, not_before: datetime) -> datetime:
    """`not_after` for a notice whose cloud gave no end (see `ESTIMATED_DURATION`)."""
    return not_before + ESTIMATED_DURATION[kind]


def derived_id(prefix: str, *parts: str) -> str:
    """A notice id for a cloud notice that has none: the same parts always give the same id."""
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return f"{prefix}-{digest}"


def parse_document(adapter: TypeAdapter[T], text: str, *, what: str) -> T:
    """`text` validated as JSON of `adapter`'s type, or `BadDocument` (malformed, truncated, missing fields)."""
    try:
        return adapter.validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "document"
        raise BadDocument(f"{what}: malformed", f"{what}: {where}: {first['msg']}") from None
