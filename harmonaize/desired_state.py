"""Desired state the control plane writes and provider agents watch (level-triggered, like Kubernetes controllers).

It lives in a JetStream KV bucket in the provider's account (tenants cannot reach it). One key per host says which
tenants' jobs run there and with how many workers; agents watch their own key and converge to it, and a restarted
agent simply reads the current value. Writers bump `generation` so a watcher can tell a new decision from a replay.

Provider-internal: host ids and locality groups here are the provider's own names; agents project them into per-tenant
pseudonyms before anything reaches a tenant.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from harmonaize.ids import ID_PATTERN, HostId, JobId, TenantId, validate_id
from harmonaize.job_runtime import Directives, JobRanges
from harmonaize.jobs import ParallelPlan
from harmonaize.subjects import provider_subject

DESIRED_STATE_BUCKET = "hz_desired"
HEARTBEAT_INTERVAL_S = 1.0
MISSED_HEARTBEATS_FOR_FAILURE = 3


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


class HostAssignment(_State):
    """Everything the control plane wants running on one host."""

    host: HostId
    locality_group: Annotated[str, StringConstraints(pattern=ID_PATTERN)]
    generation: int = Field(ge=0)
    jobs: tuple[AssignedJob, ...] = ()
    updated_at: datetime


class Heartbeat(_State):
    host: HostId
    seq: int = Field(ge=0)
    at: datetime
