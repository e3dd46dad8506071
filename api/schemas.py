"""Request and response bodies: `XCreate` is what a caller may send, `XPublic` what it gets back.

Every bound a database column has is also a bound here (lengths, integer ranges, no control characters), so bad
input is a 422 naming the field instead of a driver error surfacing as a 500. Bodies forbid unknown fields, so a typo
(`min_worker`) is reported rather than silently replaced by a default.

Two views of an allocation exist on purpose: the provider's (`AllocationPublic`, with host ids and locality groups)
and the tenant's (`TenantAllocationPublic`), where both are per-tenant pseudonyms.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from api.models import Job
from broker_config.streams import ACK_WAIT_BOUNDS_S, ACK_WAIT_S, ConsumerPosition
from harmonaize.events import EventKind
from harmonaize.global_batch import inexact_worlds
from harmonaize.ids import ID_PATTERN, HostId, JobId, TenantId
from harmonaize.jobs import Compression, ParallelPlan
from harmonaize.negotiation import MAX_OPTIONS
from harmonaize.ranges import MAX_RANGE_VALUE, IntRange, check_ordered
from harmonaize.rest import MAX_POWERSGD_RANK as MAX_POWERSGD_RANK  # bounds job_run_schemas too
from harmonaize.rest import GradientCompression, JobPublic

MAX_INT = 1_000_000_000
"""Upper bound for counts and step numbers: far beyond any real job, far below a 32-bit column's limit."""
MAX_GPUS = 4096
MAX_WORKERS = 4096

DisplayText = Annotated[
    str, StringConstraints(strip_whitespace=True, min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$")
]
"""Human-readable names: printable, bounded (PostgreSQL rejects NUL bytes; columns are 200 characters)."""
LocalityGroup = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
EntrypointArg = Annotated[str, StringConstraints(min_length=1, max_length=500, pattern=r"^[^\x00-\x1f\x7f]*$")]
MAX_ENTRYPOINT_ARGS = 64
AllocationId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Public(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class ErrorDetail(BaseModel):
    field: str
    message: str


class ErrorPublic(BaseModel):
    """Every error response: a reason for humans, and per-field details for validation errors."""

    reason: str
    errors: list[ErrorDetail] = Field(default_factory=list)


class TenantCreate(_Body):
    id: TenantId
    display_name: DisplayText


class TenantPublic(_Public):
    id: str
    display_name: str
    nats_user_public_key: str
    created_at: datetime
    revoked_at: datetime | None


class NatsCredentialsPublic(BaseModel):
    """The broker's `TenantNatsCredentials`; fields the broker adds later pass through unchanged."""

    model_config = ConfigDict(extra="allow")

    servers: list[str]
    account: str
    user_public_key: str
    seed: str
    stream: str
    subject_prefix: str


class TenantCreated(TenantPublic):
    """Returned once, at creation: the API token and the NATS seed are never stored and cannot be shown again."""

    api_token: str
    nats: NatsCredentialsPublic


class JobCreate(_Body):
    """A job and the tenant's ranges for the provider's micro-level decisions."""

    id: JobId
    name: DisplayText | None = Field(default=None, description="Defaults to the id.")
    min_workers: int = Field(ge=1, le=MAX_WORKERS)
    max_workers: int = Field(ge=1, le=MAX_WORKERS)
    gpus_per_worker: int = Field(default=1, ge=1, le=MAX_GPUS)
    parallel_plan: ParallelPlan = ParallelPlan.DDP
    checkpoint_interval_steps: IntRange = Field(default_factory=lambda: IntRange(min=100, max=1000))
    gradient_compression: GradientCompression = Field(default_factory=GradientCompression)
    batch_size: IntRange | None = Field(default=None, description="Absent: the provider may not change it.")
    gradient_accumulation: IntRange = Field(default_factory=lambda: IntRange(min=1, max=1))
    global_batch: int | None = Field(
        default=None, ge=1, le=MAX_RANGE_VALUE,
        description="Samples per optimizer step to keep at every world size: the job splits it into batch_size x "
        "gradient_accumulation x workers within the two ranges (needs a batch_size range; an exact split must "
        "exist at min_workers and max_workers). Absent: a resize changes the global batch.",
    )
    initial_workers: int | None = Field(
        default=None, ge=1, le=MAX_WORKERS, description="Place this many workers now (all or 409); absent: not placed."
    )
    entrypoint: list[EntrypointArg] = Field(
        default_factory=list,
        max_length=MAX_ENTRYPOINT_ARGS,
        description="What torchrun runs on every node of the job, e.g. ['-m', 'workloads.examples.mlp']; "
        "empty: the provider launches nothing (capacity only).",
    )

    @model_validator(mode="after")
    def _workers_ordered(self) -> Self:
        check_ordered(self.min_workers, self.max_workers, low_field="min_workers", high_field="max_workers")
        if self.initial_workers is not None and not self.min_workers <= self.initial_workers <= self.max_workers:
            raise PydanticCustomError(
                "initial_workers_range",
                "initial_workers ({initial}) must lie in min_workers..max_workers ({low}..{high})",
                {"field": "initial_workers", "initial": self.initial_workers, "low": self.min_workers,
                 "high": self.max_workers},
            )
        self._global_batch_splits()
        return self

    def _global_batch_splits(self) -> None:
        """A global batch is a promise at every size the provider may pick: refuse one that cannot be kept exactly
        at either end of the worker range (sizes in between get the nearest split, which the job logs)."""
        if self.global_batch is None:
            return
        if self.batch_size is None:
            raise PydanticCustomError(
                "global_batch_needs_batch_size",
                "global_batch needs a batch_size range (min == max pins the per-rank batch)",
                {"field": "global_batch"},
            )
        ends = sorted({self.min_workers, self.max_workers})
        missing = [world for world in ends if inexact_worlds(
            self.global_batch, worlds=range(world, world + 1), batch_size=self.batch_size,
            gradient_accumulation=self.gradient_accumulation)]
        if missing:
            raise PydanticCustomError(
                "global_batch_split",
                "global_batch {global_batch} has no split batch_size x gradient_accumulation x workers within the "
                "ranges at {worlds} worker(s)",
                {"field": "global_batch", "global_batch": self.global_batch,
                 "worlds": " and ".join(str(world) for world in missing)},
            )


def job_public(job: Job) -> JobPublic:
    """Regroup the flat columns into the nested ranges the tenant sent."""
    return JobPublic(
        id=job.id,
        name=job.name,
        min_workers=job.min_workers,
        max_workers=job.max_workers,
        gpus_per_worker=job.gpus_per_worker,
        parallel_plan=job.parallel_plan,
        desired_workers=job.desired_workers,
        checkpoint_interval_steps=IntRange(
            min=job.checkpoint_interval_steps_min, max=job.checkpoint_interval_steps_max
        ),
        gradient_compression=GradientCompression(
            allowed=[Compression(option) for option in job.compression_allowed],
            powersgd_max_rank=job.powersgd_max_rank,
        ),
        batch_size=(
            None
            if job.batch_size_min is None or job.batch_size_max is None
            else IntRange(min=job.batch_size_min, max=job.batch_size_max)
        ),
        gradient_accumulation=IntRange(min=job.grad_accumulation_min, max=job.grad_accumulation_max),
        global_batch=job.global_batch,
        entrypoint=list(job.entrypoint or ()),
        placement_epoch=job.placement_epoch,
        created_at=job.created_at,
    )


class AllocationCreate(_Body):
    """Place `gpus` GPUs of a job: on one host, anywhere in a locality group, or (neither given) anywhere."""

    tenant_id: TenantId
    job_id: JobId
    gpus: int = Field(ge=1, le=MAX_GPUS)
    host_id: HostId | None = None
    locality_group: LocalityGroup | None = None

    @field_validator("locality_group")
    @classmethod
    def _not_with_host(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("host_id") is not None:
            raise ValueError("give host_id or locality_group, not both")
        return value


class AllocationPublic(_Public):
    """The provider's view of an allocation."""

    id: str
    tenant_id: str
    job_id: str
    host_id: str
    locality_group: str
    gpus: int
    created_at: datetime
    released_at: datetime | None


class TenantAllocationPublic(BaseModel):
    """The tenant's view: host and locality group are per-tenant pseudonyms (`h-...`, `g-...`)."""

    id: str
    job_id: str
    host: str
    locality_group: str
    gpus: int
    created_at: datetime
    released_at: datetime | None


class GroupCapacityPublic(BaseModel):
    """Free GPUs in one locality group, bucketed (`0`, `1`, `2-3`, `4-7`, ...): enough to plan, too coarse to map
    the provider's fleet or watch other tenants come and go one GPU at a time."""

    locality_group: str
    free_gpus: str
    free_gpus_at_least: int


class EventConsumerUpdate(_Body):
    """Which of the tenant's events a consumer delivers; empty lists mean all (the whole slice)."""

    kinds: list[EventKind] = Field(default_factory=list, max_length=16)
    jobs: list[JobId] = Field(default_factory=list, max_length=16)
    ack_wait_s: float = Field(
        default=ACK_WAIT_S,
        ge=ACK_WAIT_BOUNDS_S[0],
        le=ACK_WAIT_BOUNDS_S[1],
        description="Seconds before an unacknowledged event is redelivered (e.g. after the reader crashed).",
    )
    position: ConsumerPosition = Field(
        default="broker",
        description=(
            "Who keeps the consumer's ack point across a broker restart. 'broker': the broker keeps it on disk. "
            "'reader': the broker keeps it in memory only (far cheaper for the broker); after a restart the "
            "consumer is gone and the reader asks for it again with `start_after`, the stream sequence it recorded "
            "below which everything was acknowledged. An existing consumer asked for with the other position is "
            "re-created from its ack floor."
        ),
    )
    start_after: int | None = Field(
        default=None,
        ge=0,
        lt=2**63 - 1,
        description="Deliver from the stream sequence after this one; used only when the consumer is created.",
    )
    stream_created: str | None = Field(
        default=None,
        max_length=64,
        description=(
            "The `stream_created` of the reply `start_after` was read under: if the stream has been re-created "
            "since, `start_after` counts in another stream and is ignored (the consumer delivers from the start)."
        ),
    )

    @field_validator("kinds", "jobs")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("entries must be unique")
        return value


class EventConsumerPublic(BaseModel):
    """Read it with `nc.jetstream(prefix=js_api_prefix).pull_subscribe_bind(name, stream=stream)`."""

    name: str
    stream: str
    js_api_prefix: str
    filter_subjects: list[str]
    ack_wait_s: float
    position: ConsumerPosition
    stream_created: str | None = Field(
        default=None, description="When the events stream was created: names this incarnation of it."
    )


class CapacityPublic(BaseModel):
    groups: list[GroupCapacityPublic]


class HealthPublic(BaseModel):
    status: str


class AcceptBody(_Body):
    """`POST /v1/negotiations/{id}/accept`: which option of the current offer (an index into `offer.options`)."""

    option: int = Field(ge=0, lt=MAX_OPTIONS)


class CloseBody(_Body):
    """`POST /v1/negotiations/{id}/reject` or `/cancel`: an optional reason, kept in the round's note."""

    reason: DisplayText | None = None


ApprovalNote = Annotated[
    str, StringConstraints(strip_whitespace=True, max_length=300, pattern=r"^[^\x00-\x1f\x7f]*$")
]


class ApprovalReportBody(_Body):
    """`POST /v1/provider/approvals`: what an agent made of the accepted maintenance approval of `negotiation`.

    The note is shown to the tenant as the round's note: tenant terms only (no VM names, no cloud event ids).
    """

    negotiation: Annotated[
        str, StringConstraints(pattern=r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
    ]
    outcome: Literal["approval_pending", "approved", "approval_failed"]
    note: ApprovalNote = ""


class ApprovalReportPublic(BaseModel):
    """`recorded` (a round was added) or `duplicate` (nothing changed), and the approval's status after it."""

    outcome: Literal["recorded", "duplicate"]
    status: Literal["queued", "pending", "approved", "failed"]
