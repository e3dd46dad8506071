"""Maintenance: a provider lifecycle event that will interrupt or disturb some of the job's hosts.

Our `MaintenanceKind` is a superset of what the three large clouds announce, so a provider that relays cloud
notices (or a simulated one) never has to squeeze an event into the wrong kind:

| cloud | notice (as the cloud names it)                                   | our kind                    |
|-------|-------------------------------------------------------------------|-----------------------------|
| Azure | Scheduled Events `Freeze` (incl. memory-preserving maintenance)  | `freeze`                    |
| Azure | `Reboot`                                                          | `reboot`                    |
| Azure | `Redeploy` (move to another host, local disk lost)                | `redeploy`                  |
| Azure | `Preempt` (Spot eviction)                                         | `preempt`                   |
| Azure | `Terminate` (scale-set delete with termination notification)      | `terminate`                 |
| AWS   | `instance-reboot`, `system-reboot`                                | `reboot`                    |
| AWS   | `system-maintenance` (network/power work under the instance)      | `host_maintenance`          |
| AWS   | `instance-retirement`                                             | `retire`                    |
| AWS   | `instance-stop`                                                   | `stop`                      |
| AWS   | Spot interruption notice, action `terminate`                      | `preempt`                   |
| AWS   | Spot interruption notice, action `stop`                           | `stop`                      |
| AWS   | Spot interruption notice, action `hibernate`                      | `hibernate`                 |
| AWS   | EC2 instance rebalance recommendation                             | `rebalance_recommendation`  |
| GCP   | `maintenance-event`: `MIGRATE_ON_HOST_MAINTENANCE` (live migrate) | `live_migrate`              |
| GCP   | `maintenance-event`: `TERMINATE_ON_HOST_MAINTENANCE`              | `terminate`                 |
| GCP   | preemption / Spot VM reclaim (`preempted` = TRUE)                 | `preempt`                   |

What we add that none of them has in one place: a window with both ends (the projection fills `not_after` from
the cloud's announced duration, or a conservative estimate), the affected hosts as per-tenant pseudonyms, and
Azure's early-approval flag (`StartRequests`) generalised: when `early_approval` is true the tenant may tell the
provider "go ahead now" by `notice_id` instead of waiting for `not_before`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar, Self

from pydantic import Field, model_validator

from harmonaize.events.base import ContractModel, EventData
from harmonaize.events.fields import HostPseudonym, NoticeId, UtcDatetime
from harmonaize.events.kinds import EventKind

__all__ = ["Maintenance", "MaintenanceKind", "MaintenanceStatus", "MaintenanceWindow"]

MAX_AFFECTED_HOSTS = 256


class MaintenanceKind(StrEnum):
    """What the provider will do to the affected hosts (see the module table for cloud equivalents)."""

    FREEZE = "freeze"
    REBOOT = "reboot"
    REDEPLOY = "redeploy"
    PREEMPT = "preempt"
    TERMINATE = "terminate"
    STOP = "stop"
    HIBERNATE = "hibernate"
    LIVE_MIGRATE = "live_migrate"
    RETIRE = "retire"
    HOST_MAINTENANCE = "host_maintenance"
    REBALANCE_RECOMMENDATION = "rebalance_recommendation"


class MaintenanceStatus(StrEnum):
    """Lifecycle of one notice; later events with the same `notice_id` move it forward."""

    SCHEDULED = "scheduled"
    STARTED = "started"
    COMPLETED = "completed"
    CANCELLED = "cancelled"


class MaintenanceWindow(ContractModel):
    """When the disruption may begin (`not_before`) and by when it is expected to be over (`not_after`)."""

    not_before: UtcDatetime
    not_after: UtcDatetime

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.not_after < self.not_before:
            raise ValueError("not_after must be at or after not_before")
        return self


class Maintenance(EventData):
    """A maintenance notice for some of the job's hosts."""

    KIND: ClassVar[EventKind] = EventKind.MAINTENANCE
    VERSION: ClassVar[int] = 1

    notice_id: NoticeId
    kind: MaintenanceKind
    status: MaintenanceStatus
    window: MaintenanceWindow
    hosts: tuple[HostPseudonym, ...] = Field(min_length=1, max_length=MAX_AFFECTED_HOSTS)
    early_approval: bool = Field(
        default=False, strict=True, description="The tenant may approve the event to start before not_before."
    )

    @model_validator(mode="after")
    def _unique_hosts(self) -> Self:
        if len(set(self.hosts)) != len(self.hosts):
            raise ValueError("hosts: each host may appear once")
        return self
