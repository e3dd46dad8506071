"""A job's entry in a host's assignment, made once per distinct row of its columns, with its JSON.

A host's assignment lists every job on the host and is rewritten whenever one of them changes
(`api.services.host_assignments`), so almost every entry of a rewrite equals one made before. Entries are therefore
memoised by the raw values of the job's row (its JSON columns read as their stored text, which also spares decoding
them), and each carries its own serialised form: the assignment's payload is put together from those, instead of
validating, hashing and serialising every job on the host again for each change of one.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple, Protocol

from sqlalchemy import Text, cast

from api.models import Job
from api.services.placement_epochs import placement_hosts
from harmonaize.desired_state import AssignedJob, HostAssignment, MaintenanceApproval, RestartMode
from harmonaize.job_runtime import Directives, JobRanges
from harmonaize.jobs import Compression, ParallelPlan
from harmonaize.ranges import IntRange

__all__ = [
    "ASSIGNED_COLUMNS", "AssignableJob", "Entry", "assignment_payload", "entry", "job_directives", "job_ranges",
]

_J = Job.__table__.c


class AssignableJob(Protocol):
    """What an assignment and a job's runtime settings read of a job: a `Job`, or a row of `ASSIGNED_COLUMNS`
    decoded (`_JobColumns`)."""

    @property
    def tenant_id(self) -> str: ...
    @property
    def id(self) -> str: ...
    @property
    def gpus_per_worker(self) -> int: ...
    @property
    def parallel_plan(self) -> ParallelPlan: ...
    @property
    def entrypoint(self) -> list[str]: ...
    @property
    def placement(self) -> dict[str, object] | None: ...
    @property
    def placement_epoch(self) -> int: ...
    @property
    def restart_mode(self) -> RestartMode: ...
    @property
    def directives(self) -> dict[str, object] | None: ...
    @property
    def checkpoint_interval_steps_min(self) -> int: ...
    @property
    def checkpoint_interval_steps_max(self) -> int: ...
    @property
    def compression_allowed(self) -> list[str]: ...
    @property
    def powersgd_max_rank(self) -> int | None: ...
    @property
    def batch_size_min(self) -> int | None: ...
    @property
    def batch_size_max(self) -> int | None: ...
    @property
    def grad_accumulation_min(self) -> int: ...
    @property
    def grad_accumulation_max(self) -> int: ...
    @property
    def global_batch(self) -> int | None: ...


_JSON_COLUMNS = frozenset({"entrypoint", "placement", "directives", "compression_allowed"})
ASSIGNED_COLUMNS = tuple(
    cast(column, Text).label(column.name) if column.name in _JSON_COLUMNS else column
    for column in (
        _J.tenant_id, _J.id, _J.gpus_per_worker, _J.parallel_plan, _J.entrypoint, _J.placement, _J.placement_epoch,
        _J.restart_mode, _J.directives, _J.checkpoint_interval_steps_min, _J.checkpoint_interval_steps_max,
        _J.compression_allowed, _J.powersgd_max_rank, _J.batch_size_min, _J.batch_size_max, _J.grad_accumulation_min,
        _J.grad_accumulation_max, _J.global_batch,
    )
)
"""The columns `AssignableJob` names, in a statement's select list; its JSON columns as their stored text (NULL as
None), so a row's slice of them is hashable: the key of `entry`."""


class _JobColumns(NamedTuple):
    """`ASSIGNED_COLUMNS`' values of one row, in their order, the JSON ones decoded: an `AssignableJob` whose
    attributes are read as fast as a tuple's items."""

    tenant_id: str
    id: str
    gpus_per_worker: int
    parallel_plan: ParallelPlan
    entrypoint: list[str]
    placement: dict[str, object] | None
    placement_epoch: int
    restart_mode: RestartMode
    directives: dict[str, object] | None
    checkpoint_interval_steps_min: int
    checkpoint_interval_steps_max: int
    compression_allowed: list[str]
    powersgd_max_rank: int | None
    batch_size_min: int | None
    batch_size_max: int | None
    grad_accumulation_min: int
    grad_accumulation_max: int
    global_batch: int | None


assert _JobColumns._fields == tuple(column.name for column in ASSIGNED_COLUMNS), "one order, restated once"
_JSON_INDEXES = tuple(index for index, name in enumerate(_JobColumns._fields) if name in _JSON_COLUMNS)


def job_ranges(job: AssignableJob) -> JobRanges:
    """The tenant's declared micro-loop ranges of `job`, in the contract's shape (shared with the job's runtime)."""
    return _ranges(
        job.checkpoint_interval_steps_min, job.checkpoint_interval_steps_max, tuple(job.compression_allowed),
        job.powersgd_max_rank, job.batch_size_min, job.batch_size_max, job.grad_accumulation_min,
        job.grad_accumulation_max, job.global_batch,
    )


@functools.lru_cache(maxsize=4096)
def _ranges(
    checkpoint_min: int, checkpoint_max: int, compression: tuple[str, ...], powersgd_max_rank: int | None,
    batch_min: int | None, batch_max: int | None, accumulation_min: int, accumulation_max: int,
    global_batch: int | None,
) -> JobRanges:
    """Memoised by value (the models are frozen, so sharing one is safe)."""
    return JobRanges(
        checkpoint_interval_steps=IntRange(min=checkpoint_min, max=checkpoint_max),
        compression_allowed=tuple(Compression(option) for option in compression),
        powersgd_max_rank=powersgd_max_rank,
        batch_size=None if batch_min is None or batch_max is None else IntRange(min=batch_min, max=batch_max),
        gradient_accumulation=IntRange(min=accumulation_min, max=accumulation_max),
        global_batch=global_batch,
    )


def job_directives(job: AssignableJob) -> Directives:
    return Directives() if job.directives is None else Directives.model_validate(job.directives)


class Entry(NamedTuple):
    """A job as one host's assignment lists it, and that entry's JSON (`job.model_dump_json()`)."""

    job: AssignedJob
    json: str


@functools.lru_cache(maxsize=4096)
def entry(
    row: tuple[Any, ...], *, workers: int, standby_until: datetime | None = None,
    approvals: tuple[MaintenanceApproval, ...] = (),
) -> Entry:
    """The entry of the job whose `ASSIGNED_COLUMNS` values are `row`, with `workers` on the host: its epoch, node
    count, plan and settings.

    `standby_until`: a warm joiner of an offer open until then (`HostAssignment.standby`): the node the accept would
    start, guessed now: `workers` of them, the job's next epoch, one node more. Memoised by all of its arguments,
    the JSON columns' stored text included, so an entry is made once per distinct state of the job. The bound keeps
    what full GC passes walk as it was when the entries' models were memoised alone (4,096).
    """
    values = list(row)
    for index in _JSON_INDEXES:
        values[index] = None if values[index] is None else json.loads(values[index])
    job = _JobColumns._make(values)
    nodes = len(placement_hosts(job.placement))
    if standby_until is None:
        assigned = _assigned(
            job, workers=workers, epoch=job.placement_epoch, nodes=nodes, restart=job.restart_mode, approvals=approvals
        )
    else:
        assigned = _assigned(
            job, workers=workers, epoch=job.placement_epoch + 1, nodes=nodes + 1, standby_until=standby_until
        )
    return Entry(assigned, assigned.model_dump_json())


def _assigned(
    job: AssignableJob, *, workers: int, epoch: int, nodes: int, restart: RestartMode = RestartMode.GRACEFUL,
    standby_until: datetime | None = None, approvals: tuple[MaintenanceApproval, ...] = (),
) -> AssignedJob:
    return AssignedJob(
        tenant=job.tenant_id,
        job=job.id,
        workers=workers,
        gpus=workers * job.gpus_per_worker,
        parallel_plan=job.parallel_plan,
        entrypoint=tuple(job.entrypoint or ()),
        epoch=epoch,
        nodes=nodes,
        restart=restart,
        ranges=job_ranges(job),
        directives=job_directives(job),
        approvals=approvals,
        standby_until=standby_until,
    )


_JOBS_MARK = ',"jobs":[],'


def assignment_payload(assignment: HostAssignment, jobs: Sequence[Entry]) -> bytes:
    """`assignment.model_dump_json()`, encoded, with its jobs' JSON taken from `jobs` (its `jobs`' entries, in their
    order) rather than made again: the rest of the assignment is serialised without them and they are spliced in.

    The marker is unambiguous: the fields before `jobs` are an id, a group and a number, whose JSON cannot hold an
    unescaped quote.
    """
    head = assignment.model_copy(update={"jobs": ()}).model_dump_json()
    before, mark, after = head.partition(_JOBS_MARK)
    assert mark, "a serialised assignment lists its jobs after its id, group and generation"
    return f'{before},"jobs":[{",".join(job.json for job in jobs)}],{after}'.encode()
