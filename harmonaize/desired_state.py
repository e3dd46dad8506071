"""Desired state the control plane writes and provider agents watch (level-triggered, like Kubernetes controllers).

It lives in a JetStream KV bucket in the provider's account (tenants cannot reach it). One key per host says which
tenants' jobs run there and with how many workers; agents watch their own key and converge to it, and a restarted
agent simply reads the current value. Writers bump `generation` so a watcher can tell a new decision from a replay.

Provider-internal: host ids and locality groups here are the provider's own names; agents project them into per-tenant
pseudonyms before anything reaches a tenant.

Commands ride along the same way: a job's accepted maintenance approvals (`AssignedJob.approvals`) stay in its hosts'
assignments until the agents' outcome is reported, so an agent that restarts or missed an update still finds them.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from harmonaize.ids import ID_PATTERN, HostId, JobId, TenantId, validate_id
from harmonaize.job_runtime import Directives, JobRanges
from harmonaize.jobs import ParallelPlan
from harmonaize.negotiation import NoticeName
from harmonaize.subjects import provider_subject

DESIRED_STATE_BUCKET = "hz_desired"
HEARTBEAT_INTERVAL_S = 0.25
MISSED_HEARTBEATS_FOR_FAILURE = 12
"""A host silent this many heartbeats (3 s) is down: long enough for an agent to be restarted, its nodes running."""
MISSED_HEARTBEATS_WHILE_PEERS_WAIT = 2
"""A host silent this many heartbeats (0.5 s) is down at once when a job on it has ranks elsewhere that stand still,
waiting on a peer (`Heartbeat.waiting`): the host froze or died with them, an agent restart blocks no collective."""


def host_key(host: str) -> str:
    """KV key of a host's assignment."""
    return f"host.{validate_id('host', host)}"


def heartbeat_subject(host: str) -> str:
    """Where a host agent publishes its heartbeat (provider-internal)."""
    return provider_subject("agents", host, "heartbeat")


def telemetry_subject(host: str) -> str:
    """Where a host agent publishes raw telemetry for the provider's own loops (provider-internal)."""
    return provider_subject("telemetry", host)


class RestartMode(StrEnum):
    """How node launchers move a job to a new epoch."""

    GRACEFUL = "graceful"
    """SIGTERM, then a grace period: the job agrees on a step, checkpoints and exits (scale, repartition)."""
    IMMEDIATE = "immediate"
    """Kill at once: a peer is gone, so the survivors could not finish a collective checkpoint anyway (failure)."""


class _State(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MaintenanceApproval(_State):
    """A tenant's accepted `approve_maintenance` negotiation, as the agents of its job's hosts are asked to carry it
    out: start the notice the tenant calls `notice` early, once every tenant on the host has approved it."""

    negotiation: Annotated[str, StringConstraints(pattern=r"^[0-9a-f-]{32,36}$")]
    notice: NoticeName = Field(description="The notice as this job's tenant sees it (its per-tenant pseudonym).")


class AssignedJob(_State):
    """A tenant job placed on a host: the workers (torchrun nodes' local workers) it runs there."""

    tenant: TenantId
    job: JobId
    workers: int = Field(ge=0, le=4096)
    gpus: int = Field(ge=0, le=4096)
    parallel_plan: ParallelPlan = ParallelPlan.DDP
    entrypoint: tuple[str, ...] = Field(default=(), description="What torchrun runs; empty: nothing to launch.")
    epoch: int = Field(default=0, ge=0, description="Bumped whenever the job's node set, sizes or plan change.")
    nodes: int = Field(default=0, ge=0, le=4096, description="How many hosts run the job in this epoch.")
    restart: RestartMode = RestartMode.GRACEFUL
    ranges: JobRanges = JobRanges()
    directives: Directives = Directives()
    approvals: tuple[MaintenanceApproval, ...] = Field(
        default=(),
        max_length=64,
        description="Accepted maintenance approvals of the job awaiting the agents' outcome (none on a standby).",
    )
    standby_until: datetime | None = Field(
        default=None,
        description="Set for a warm joiner (`HostAssignment.standby`): an open offer would place the job here. Its "
        "node starts and builds the model but joins only once the offer is accepted (the job then appears in "
        "`jobs`); it is stopped when the offer closes otherwise, at the latest at this time (the offer's expiry).",
    )

    @property
    def standby(self) -> bool:
        return self.standby_until is not None


class HostAssignment(_State):
    """Everything the control plane wants running on one host."""

    host: HostId
    locality_group: Annotated[str, StringConstraints(pattern=ID_PATTERN)]
    generation: int = Field(ge=0)
    jobs: tuple[AssignedJob, ...] = ()
    standby: tuple[AssignedJob, ...] = Field(
        default=(),
        description="Warm joiners (each with `standby_until`): jobs an open offer would grow onto this host. Kept "
        "apart from `jobs`, since nothing but the node launcher may treat them as placed here (no events, no "
        "micro loop, no host-down report).",
    )
    updated_at: datetime


class Heartbeat(_State):
    host: HostId
    seq: int = Field(ge=0)
    at: datetime
    waiting: tuple[str, ...] = Field(
        default=(),
        max_length=4096,
        description="`<tenant>/<job>` of the jobs whose workers here beat but have stood still past the launcher's "
        "peer-wait bound: blocked in a collective, on a peer.",
    )
