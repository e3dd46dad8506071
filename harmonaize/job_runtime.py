"""The contract between a host's node launcher (provider) and the runtime inside a tenant's training job (`workloads`).

The two sides share no process and no network protocol, only files on the host, because the training job is the
tenant's code and must not hold broker credentials, and because files outlive either side's restart:

    $HZ_RUN_SPEC                   -> `WorkerSpec` (JSON, written once per node start by the launcher)
    <control_dir>/directives.json  -> `Directives` (the provider's current micro-level settings; rewritten atomically)
    <control_dir>/progress.json    -> `JobProgress` (written atomically by the job's global rank 0)
    <control_dir>/liveness-<local rank>.json -> `NodeLiveness` (every worker's beat, step and phase)
    <control_dir>/membership.json  -> `Membership` (in-place jobs: the epoch the node's workers must be in now)

Directives are *level* state, like the desired state of hosts: the file says what the provider currently wants
(compression fp16, checkpoint every 10 steps, ...), each rewrite with a higher `version`. A one-off request
("checkpoint now") is a counter that only grows, so a runtime that missed an intermediate version still acts once.

Both sides check a directive against the tenant's declared `JobRanges` with the same function (`violations`): the
control plane refuses an out-of-range directive before it is issued, and the runtime refuses it again (the tenant's
process is the last line of defence, and it reports the refusal in its progress, which reaches the tenant).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from harmonaize.ids import JobId, TenantId
from harmonaize.jobs import Compression, DirectiveState, ParallelPlan
from harmonaize.ranges import MAX_RANGE_VALUE, IntRange

__all__ = [
    "CONTROL_DIRECTIVES_FILE",
    "CONTROL_MEMBERSHIP_FILE",
    "CONTROL_LIVENESS_GLOB",
    "CONTROL_PROGRESS_FILE",
    "LIVENESS_BEAT_INTERVAL_S",
    "NodeLiveness",
    "NodePhase",
    "liveness_path",
    "ENV_NODE_MARKER",
    "ENV_RUN_SPEC",
    "DirectiveOutcome",
    "DirectiveState",
    "EpochChange",
    "Directives",
    "JobProgress",
    "JobRanges",
    "Membership",
    "WorkerSpec",
    "read_model",
    "violations",
    "write_model_atomically",
]

ENV_RUN_SPEC = "HZ_RUN_SPEC"
"""Path of the `WorkerSpec` JSON; absent when a script runs under plain torchrun (then the runtime uses defaults)."""
ENV_NODE_MARKER = "HZ_NODE_ID"
"""Set on every process of a launched node (`<cloud>.<host>.<tenant>.<job>.e<epoch>`): how a launcher finds orphaned
workers, and only its own cloud's."""
CONTROL_DIRECTIVES_FILE = "directives.json"
CONTROL_PROGRESS_FILE = "progress.json"
CONTROL_MEMBERSHIP_FILE = "membership.json"
CONTROL_LIVENESS_GLOB = "liveness-*.json"
LIVENESS_BEAT_INTERVAL_S = 0.1
"""How often a worker's beat thread rewrites its liveness file; the launcher's hang bounds are many beats long, and
its peer-wait bound (0.5 s) must see a stepping job's step move well within it."""

MAX_OUTCOMES = 20
MAX_COUNT = 2**53
"""Upper bound of every counter (steps, versions, epochs): exact in JSON numbers and in every database we use."""
MAX_WORLD = 65_536


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class JobRanges(_Model):
    """What the tenant allowed the provider to change, as declared in the job spec."""

    checkpoint_interval_steps: IntRange = IntRange(min=100, max=1000)
    compression_allowed: tuple[Compression, ...] = (Compression.NONE,)
    powersgd_max_rank: int | None = Field(default=None, ge=1)
    batch_size: IntRange | None = None
    """Per rank and per micro-batch; None: the provider may not change it."""
    gradient_accumulation: IntRange = IntRange(min=1, max=1)
    global_batch: int | None = Field(default=None, ge=1, le=MAX_RANGE_VALUE)
    """Samples per optimizer step the tenant wants kept whatever the world size (`harmonaize.global_batch`); the
    runtime then derives batch size and accumulation itself, and directives may not set them."""

    @model_validator(mode="after")
    def _global_batch_needs_a_batch_range(self) -> Self:
        if self.global_batch is not None and self.batch_size is None:
            raise ValueError("global_batch needs a batch_size range (min == max pins the per-rank batch)")
        return self


class Directives(_Model):
    """The provider's current micro-level settings for one job; None fields mean "the job's own choice"."""

    version: int = Field(default=0, ge=0, le=MAX_COUNT)
    checkpoint_requests: int = Field(
        default=0, ge=0, le=MAX_COUNT, description="Grows by one for every 'checkpoint now'."
    )
    checkpoint_interval_steps: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    compression: Compression | None = None
    powersgd_rank: int | None = Field(default=None, ge=1, le=MAX_WORLD)
    batch_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_COUNT,
        description="Per rank and per micro-batch (a step sees batch x accumulation x world).",
    )
    gradient_accumulation: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    reason: str = Field(default="", max_length=500)


def violations(ranges: JobRanges, directives: Directives) -> list[str]:
    """Every way `directives` leaves the tenant's `ranges`, one sentence each naming the field; [] when inside."""
    problems: list[str] = []
    interval = directives.checkpoint_interval_steps
    if interval is not None and interval not in ranges.checkpoint_interval_steps:
        problems.append(_outside("checkpoint_interval_steps", interval, ranges.checkpoint_interval_steps))
    if directives.compression is not None and directives.compression not in ranges.compression_allowed:
        allowed = ", ".join(option.value for option in ranges.compression_allowed)
        problems.append(f"compression {directives.compression.value!r} is not allowed (allowed: {allowed})")
    if directives.compression is Compression.POWERSGD:
        rank = directives.powersgd_rank
        if rank is None:
            problems.append("powersgd_rank is required with compression 'powersgd'")
        elif ranges.powersgd_max_rank is None or rank > ranges.powersgd_max_rank:
            problems.append(f"powersgd_rank {rank} is above the allowed maximum {ranges.powersgd_max_rank}")
    elif directives.powersgd_rank is not None:
        problems.append("powersgd_rank is only meaningful with compression 'powersgd'")
    if ranges.global_batch is not None and (directives.batch_size, directives.gradient_accumulation) != (None, None):
        problems.append(
            f"batch_size and gradient_accumulation follow the global batch the tenant fixed ({ranges.global_batch} "
            "samples per step): the job derives them from its world size"
        )
        return problems
    if directives.batch_size is not None:
        if ranges.batch_size is None:
            problems.append("batch_size may not be changed: the tenant declared no batch_size range")
        elif directives.batch_size not in ranges.batch_size:
            problems.append(_outside("batch_size", directives.batch_size, ranges.batch_size))
    accumulation = directives.gradient_accumulation
    if accumulation is not None and accumulation not in ranges.gradient_accumulation:
        problems.append(_outside("gradient_accumulation", accumulation, ranges.gradient_accumulation))
    return problems


def _outside(field: str, value: int, allowed: IntRange) -> str:
    return f"{field} {value} is outside the allowed range {allowed.min}..{allowed.max}"


class WorkerSpec(_Model):
    """What one node's workers need to know about their job; written by the launcher, read by the runtime."""

    tenant: TenantId
    job: JobId
    epoch: int = Field(
        ge=0, le=MAX_COUNT, description="Bumped by the provider whenever the job's node set or plan changes."
    )
    parallel_plan: ParallelPlan = ParallelPlan.DDP
    locality_group: str = Field(default="", max_length=64, description="This node's group (a tenant pseudonym).")
    checkpoint_dir: Path
    control_dir: Path
    ranges: JobRanges = JobRanges()
    store_endpoint: str | None = Field(
        default=None,
        max_length=300,
        description="`host:port` of the job's provider-hosted store. Set for an in-place node: its workers form "
        "the job's process group there themselves (`Membership`) instead of through torchrun's rendezvous.",
    )
    standby_until: datetime | None = Field(
        default=None,
        description="A warm joiner started while an offer is open: it builds the model and waits for its first "
        "`Membership` until the offer's expiry (the launcher stops it sooner if the offer is not taken).",
    )


class Membership(_Model):
    """Which epoch an in-place node's workers must be in now; rewritten atomically by the launcher.

    The launcher writes it when the control plane moves the job to a new epoch that keeps this node (the same
    entrypoint, plan and workers per node): the workers then leave their process group and form the new one in
    place, keeping their processes and their in-memory state. `urgent` (a peer failed or hung) aborts the collective
    in flight at once; otherwise (an agreement) the ranks switch at a step boundary they agree on, once every joiner
    is ready. `member` false: this node leaves the job at that boundary (a scale-down), the others carry on.
    """

    epoch: int = Field(ge=0, le=MAX_COUNT)
    nodes: int = Field(ge=1, le=MAX_WORLD)
    workers: int = Field(ge=1, le=MAX_WORLD, description="Workers per node; the world is nodes x workers.")
    member: bool = True
    urgent: bool = False
    reason: str = Field(default="", max_length=500)

    @property
    def world_size(self) -> int:
        return self.nodes * self.workers


class DirectiveOutcome(_Model):
    """What the runtime did with one version of the directives, and at which step."""

    version: int = Field(ge=0, le=MAX_COUNT)
    status: Literal[DirectiveState.APPLIED, DirectiveState.REFUSED]
    step: int = Field(ge=0, le=MAX_COUNT)
    reasons: tuple[Annotated[str, Field(max_length=500)], ...] = Field(default=(), max_length=16)


class JobProgress(_Model):
    """A running job's state as its global rank 0 sees it; rewritten at step boundaries (throttled)."""

    tenant: TenantId
    job: JobId
    epoch: int = Field(ge=0, le=MAX_COUNT)
    step: int = Field(ge=0, le=MAX_COUNT)
    world_size: int = Field(ge=1, le=MAX_WORLD)
    parallel_plan: ParallelPlan
    plan_note: str = Field(default="", max_length=500, description="How the plan was laid out, or why it fell back.")
    loss: float | None = Field(default=None, ge=-1e30, le=1e30, allow_inf_nan=False)
    samples_per_s: float | None = Field(default=None, ge=0, le=1e15, allow_inf_nan=False)
    resumed_from_step: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    epoch_step: int | None = Field(
        default=None, ge=0, le=MAX_COUNT, description="The step this epoch began at (its first step is the next)."
    )
    change: EpochChange | None = Field(default=None, description="How the job got into this epoch.")
    pause_s: float | None = Field(
        default=None, ge=0, le=1e9, allow_inf_nan=False,
        description="How long the job stood still for the change: in place, the running ranks' group change and "
        "state transfer; after a restart, from the save of the checkpoint it resumed to the restarted job ready.",
    )
    last_checkpoint_step: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    checkpoint_interval_steps: int = Field(ge=1, le=MAX_COUNT)
    compression: Compression = Compression.NONE
    powersgd_rank: int | None = Field(default=None, ge=1, le=MAX_WORLD)
    batch_size: int = Field(ge=1, le=MAX_COUNT)
    gradient_accumulation: int = Field(default=1, ge=1, le=MAX_COUNT)
    directives_version: int = Field(default=0, ge=0, le=MAX_COUNT, description="The last directives version handled.")
    outcomes: tuple[DirectiveOutcome, ...] = Field(default=(), max_length=MAX_OUTCOMES)
    finished: bool = Field(
        default=False,
        description="The training run is over (its last step, or the script closed it without a stop request): "
        "the final report. A run that stops for a new epoch is not finished.",
    )
    updated_at: datetime


class EpochChange(StrEnum):
    """How a job got into its current epoch, as its runtime reports it."""

    FRESH = "fresh"
    """Started with no checkpoint to load."""
    CHECKPOINT = "checkpoint"
    """Restarted and resumed from the latest checkpoint (a plan change, or the fallback: no live peer held state)."""
    IN_PLACE = "in_place"
    """The running workers changed group without a restart; joiners took the state from a live peer."""


class NodePhase(StrEnum):
    """Where a worker is, as far as the hang detector needs to know: may its step stand still without it being hung?"""

    STARTING = "starting"
    """Rendezvous, process group, resume from a checkpoint: waits on peers and storage."""
    STEP = "step"
    """Inside `train_step`: forward, backward, optimizer, and the collectives the plan puts there (waits on peers)."""
    AGREEMENT = "agreement"
    """The step boundary's all-reduce: waits on every peer."""
    CHECKPOINT = "checkpoint"
    """Saving a checkpoint (collective, and as slow as the storage)."""
    SCRIPT = "script"
    """Between steps, in the tenant's own loop: the runtime waits on nobody there, so the step must come back."""
    STOPPING = "stopping"
    """Final progress and the goodbye barrier."""


class NodeLiveness(_Model):
    """One worker's liveness, rewritten by a daemon thread every `LIVENESS_BEAT_INTERVAL_S`.

    `beats` grows with every write: a reader that sees it stand still knows the process is not running at all
    (SIGSTOP, a call that holds the GIL), which a worker blocked on a peer never is (its thread keeps beating).
    `step` and `transitions` (phase changes so far) tell the reader whether the worker is getting anywhere. No
    timestamps: the reader times what it sees on its own clock, so no clock needs to agree with another.
    """

    tenant: TenantId
    job: JobId
    epoch: int = Field(ge=0, le=MAX_COUNT)
    local_rank: int = Field(ge=0, le=MAX_WORLD)
    pid: int = Field(ge=1)
    beats: int = Field(ge=0, le=MAX_COUNT)
    step: int = Field(ge=0, le=MAX_COUNT)
    phase: NodePhase
    transitions: int = Field(ge=0, le=MAX_COUNT)
    step_time_s: float | None = Field(
        default=None, ge=0, le=1e9, allow_inf_nan=False, description="Median time between recent steps."
    )


def liveness_path(control_dir: Path, local_rank: int) -> Path:
    return control_dir / f"liveness-{local_rank}.json"


ModelT = TypeVar("ModelT", bound=BaseModel)


def write_model_atomically(path: Path, model: BaseModel) -> None:
    """Write `model` as JSON so that a reader sees the old file or the new one, never half of either."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(model.model_dump_json())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_model(path: Path, model: type[ModelT]) -> ModelT | None:
    """The model in `path`, or None when the file does not exist yet."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    return model.model_validate(json.loads(text))

