"""A node failure, as a host's node launcher reports it to the control plane (the admin route's body).

Two kinds of node failure have no other way to the control plane, because the host itself is fine and keeps
heartbeating: a node the launcher found hung (`frozen`: its processes stopped running; `stalled`: its own code never
came back to the next step) and killed, and a node the launcher gave up restarting (`out_of_restarts`). The report
names the provider's host: it never reaches a tenant as is; the control plane turns it into the tenant's `Failure`
event under the tenant's pseudonym for the host, with `reason` as the event's reason code.

A report is about one node in one placement epoch, so (tenant, job, host, epoch) identifies it: reporting it again is
harmless, and a report for an epoch the job has left describes nothing that still runs.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from harmonaize.ids import HostId, JobId, TenantId
from harmonaize.job_runtime import MAX_COUNT
from harmonaize.times import UtcDatetime

__all__ = ["NodeFailureReason", "NodeFailureReport"]


class NodeFailureReason(StrEnum):
    FROZEN = "frozen"
    """Hung: a worker's beat stopped (its process does not run at all)."""
    STALLED = "stalled"
    """Hung: a worker's own code did not get back to the next step (its peers wait for it)."""
    OUT_OF_RESTARTS = "out_of_restarts"
    """The node kept exiting with an error; the launcher stopped restarting it until the epoch moves on."""
    CRASHED = "crashed"
    """An in-place node exited with an error. It is not restarted: its peers go on without it (`workloads.elastic`)."""

    @property
    def hung(self) -> bool:
        return self in (NodeFailureReason.FROZEN, NodeFailureReason.STALLED)

    @property
    def leaves_job(self) -> bool:
        """The node's workers are taken out of the job (a new epoch without them) rather than kept in place."""
        return self is not NodeFailureReason.OUT_OF_RESTARTS


class NodeFailureReport(BaseModel):
    """One node of one job on one host failed in placement epoch `epoch`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant: TenantId
    job: JobId
    host: HostId
    epoch: int = Field(ge=0, le=MAX_COUNT)
    reason: NodeFailureReason
    step: int | None = Field(default=None, ge=0, le=MAX_COUNT, description="The step the node stood at, if known.")
    detected_at: UtcDatetime
    detail: str = Field(default="", max_length=500, description="For the provider's logs; never shown to the tenant.")
