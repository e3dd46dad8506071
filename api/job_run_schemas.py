"""Bodies and views of running jobs: micro-loop directive proposals, directive history, status (with the node failures)
and timeline."""

from __future__ import annotations

from datetime import datetime
from typing import Self

from pydantic import BaseModel, Field

from api.models import JobDirective
from api.models_job_runs import JobProgressSample, JobTimelineEntry
from api.models_node_failures import JobNodeFailure
from api.schemas import MAX_INT, MAX_POWERSGD_RANK, _Body
from harmonaize.events import FailureKind
from harmonaize.job_runtime import EpochChange, JobProgress
from harmonaize.jobs import Compression, JobPhase, ParallelPlan
from harmonaize.pseudonyms import host_pseudonym


class DirectiveProposalBody(_Body):
    """The provider micro loop's wanted settings for a job now (absent: the job's own choice)."""

    checkpoint_now: bool = False
    checkpoint_interval_steps: int | None = Field(default=None, ge=1, le=MAX_INT)
    compression: Compression | None = None
    powersgd_rank: int | None = Field(default=None, ge=1, le=MAX_POWERSGD_RANK)
    batch_size: int | None = Field(default=None, ge=1, le=MAX_INT)
    gradient_accumulation: int | None = Field(default=None, ge=1, le=MAX_INT)
    reason: str = Field(default="", max_length=500, pattern=r"^[^\x00-\x1f\x7f]*$")


class DirectivePublic(BaseModel):
    id: str
    version: int | None
    state: str
    settings: dict[str, object]
    reason: str
    refusals: list[str]
    step: int | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_model(cls, record: JobDirective) -> Self:
        return cls(
            id=record.id,
            version=record.version,
            state=record.state.value,
            settings=dict(record.settings),
            reason=record.reason,
            refusals=list(record.refusals),
            step=record.step,
            created_at=record.created_at,
            updated_at=record.updated_at,
        )


class NodeFailurePublic(BaseModel):
    """A node of the job that failed on a host that is itself fine (the host under the tenant's pseudonym)."""

    host: str
    epoch: int
    kind: str = Field(description="node_hung (killed; its workers left the job) or node_failed (out of restarts).")
    reason: str = Field(
        description="frozen, stalled, out_of_restarts or crashed (an in-place node that exited with an error)."
    )
    step: int | None
    left_job: bool = Field(description="The node's workers left the job (a new epoch runs without them).")
    detected_at: datetime

    @classmethod
    def from_model(cls, record: JobNodeFailure, *, secret: bytes) -> Self:
        return cls(
            host=host_pseudonym(secret, record.tenant_id, record.host_id),
            epoch=record.epoch,
            kind=(FailureKind.NODE_HUNG if record.reason.hung else FailureKind.NODE_FAILED).value,
            reason=record.reason.value,
            step=record.step,
            left_job=record.released,
            detected_at=record.detected_at,
        )


class JobStatusPublic(BaseModel):
    """The job's latest reported progress (absent until its first step) and the shapes it ran in."""

    job_id: str
    phase: JobPhase = Field(
        description="Where the job stands: pending, placed, running, restarting (at `placement_epoch`), finished or "
        "failed (a node of `placement_epoch` given up, or failures took its last worker)."
    )
    desired_workers: int
    parallel_plan: ParallelPlan
    placement_epoch: int
    progress: JobProgress | None
    reported_at: datetime | None
    node_failures: list[NodeFailurePublic] = Field(
        default_factory=list,
        description="The latest node failures, newest first; one in `placement_epoch` that did not leave the job "
        "means the job stands still there until its epoch moves on.",
    )


class TimelineEntryPublic(BaseModel):
    epoch: int
    world_size: int
    parallel_plan: ParallelPlan
    step: int
    resumed_from_step: int | None
    change: EpochChange | None = Field(
        default=None,
        description="How the job got into this shape: fresh, checkpoint (restarted, resumed from the latest "
        "checkpoint: a plan change or the fallback when no live worker held the state) or in_place (the running "
        "workers kept their processes and state; joiners copied it from a live peer).",
    )
    pause_s: float | None = Field(
        default=None,
        description="How long the job stood still for the change: in place, the running ranks' group change and "
        "state transfer; after a restart, from the save of the checkpoint it resumed to the restarted job ready.",
    )
    at: datetime

    @classmethod
    def from_model(cls, entry: JobTimelineEntry) -> Self:
        return cls(
            epoch=entry.epoch,
            world_size=entry.world_size,
            parallel_plan=entry.parallel_plan,
            step=entry.step,
            resumed_from_step=entry.resumed_from_step,
            change=entry.change,
            pause_s=entry.pause_s,
            at=entry.at,
        )


class ProgressSamplePublic(BaseModel):
    """The job's progress at one moment, as its rank 0 reported it (`GET /jobs/{id}/progress`)."""

    at: datetime
    epoch: int
    step: int
    world_size: int
    loss: float | None
    samples_per_s: float | None

    @classmethod
    def from_model(cls, sample: JobProgressSample) -> Self:
        return cls(at=sample.at, epoch=sample.epoch, step=sample.step, world_size=sample.world_size,
                   loss=sample.loss, samples_per_s=sample.samples_per_s)
