"""A job's placement epoch: which jobs' node sets changed in a transaction, and each one's move to its next epoch.

Node launchers start one torchrun rendezvous per epoch, sized exactly to the job's node count, so whenever a job's
node set, worker counts or plan change, its epoch moves on and every host of the job, old and new, must be rewritten
(`api.services.host_assignments`). The placement compared is the job's *effective* one: workers per host from the
allocations that hold capacity now (a reservation counts from its start).

Runs inside the caller's transaction, under the ledger lock (which every placement change holds: the whole ledger,
or shared with the job's own row locked first, `ledger_lock`), so a job's stored placement read here is current;
under the shared lock only the caller's own job may get a new epoch (`ledger_lock.hold_job`). The phase, which
progress reports move without that lock, is moved in SQL.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple, cast

from sqlalchemy import (
    ColumnElement,
    CompoundSelect,
    Select,
    Table,
    Update,
    and_,
    bindparam,
    func,
    or_,
    select,
    union,
    update,
)
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm.attributes import set_committed_value

from api.db import execute_core
from api.models import Allocation, Host, Job
from api.services.job_lifecycle import JobEvent, epoch_event, phase_after
from api.services.ledger_lock import hold_job
from harmonaize.desired_state import RestartMode
from harmonaize.jobs import ParallelPlan

__all__ = ["EFFECTIVE", "placement_hosts", "renew_epochs"]

_A, _J = Allocation.__table__.c, Job.__table__.c
EFFECTIVE: tuple[ColumnElement[bool], ColumnElement[bool]] = (
    _A.released_at.is_(None), or_(_A.starts_at.is_(None), _A.starts_at <= bindparam("now"))
)
"""Allocations that hold capacity at `now` (a parameter): not released, and started (a reservation counts from its
start). The statements here and in `host_assignments` are built once, on the tables, with parameters
(`api.db.execute_core`): an accept runs all of them, and building them, or running them as ORM statements, cost
more CPU than SQLite takes to run them."""


def placement_hosts(placement: dict[str, object] | None) -> dict[str, int]:
    """Workers per host in a stored placement (as `_placement` writes it); empty for a job placed nowhere.

    The JSON column is typed loosely, so the shape written below is restated here, once.
    """
    return cast("dict[str, int]", (placement or {}).get("hosts") or {})


_CANDIDATES = union(
    select(_A.tenant_id, _A.job_id).where(_A.host_id.in_(bindparam("hosts", expanding=True)), _A.released_at.is_(None)),
    select(_A.tenant_id, _A.job_id).where(
        _A.host_id.in_(bindparam("hosts", expanding=True)), _A.released_at >= bindparam("now")
    ),
)
"""`renew_epochs`' candidates: the jobs with a live allocation on `hosts` or one released at `now` or later. Two
selects rather than one with OR: each is a seek on (host_id, released_at), where the OR made SQLite walk every
allocation the hosts ever had."""
_H = Host.__table__.c
_JOB_OR_STARTED = union(
    select(bindparam("tenant", type_=_J.tenant_id.type), bindparam("job", type_=_J.id.type)),
    select(_A.tenant_id, _A.job_id)
    .join(Host.__table__, _H.id == _A.host_id)
    .where(
        _A.host_id.in_(bindparam("hosts", expanding=True)), _A.released_at.is_(None),
        _A.starts_at <= bindparam("now"), or_(_H.assigned_at.is_(None), _A.starts_at > _H.assigned_at),
    ),
)
"""`renew_epochs`' candidates when the caller names the one job it changed: that job, and any job whose reservation
on `hosts` started since the host's assignment was last written (which the rewrite about to happen would otherwise
mark as announced: `host_assignments.announce_due_reservations`)."""


def _placements_of(candidates: CompoundSelect[tuple[str, str]]) -> Select[Any]:
    """Every candidate job with its GPUs per host now, one row per (job, host), or one with no host for a job placed
    nowhere now. Joined from the candidates, so each job's allocations are reached by a seek on (tenant, job, release
    time): a row-value `IN (subquery)` made SQLite scan the whole table."""
    keys = candidates.subquery("candidates")
    tenant_id, job_id = keys.c
    return (
        select(_J.tenant_id, _J.id, _J.gpus_per_worker, _J.parallel_plan, _J.placement, _A.host_id, func.sum(_A.gpus))
        .select_from(
            keys
            .join(Job.__table__, (_J.tenant_id == tenant_id) & (_J.id == job_id))
            .outerjoin(Allocation.__table__, (_A.tenant_id == _J.tenant_id) & (_A.job_id == _J.id) & and_(*EFFECTIVE))
        )
        .group_by(_J.tenant_id, _J.id, _A.host_id)
        .order_by(_J.tenant_id, _J.id, _A.host_id)
    )


_CANDIDATE_PLACEMENTS, _JOB_PLACEMENTS = _placements_of(_CANDIDATES), _placements_of(_JOB_OR_STARTED)


class _Candidate(NamedTuple):
    """A candidate job: its stored placement and what it needs to compute the effective one."""

    tenant_id: str
    job_id: str
    gpus_per_worker: int
    plan: ParallelPlan
    stored: dict[str, object] | None
    gpus_by_host: dict[str, int]


async def _candidates(session: AsyncSession, params: dict[str, object], *, one_job: bool) -> list[_Candidate]:
    """The candidate jobs with their GPUs per host now (one statement: `_CANDIDATE_PLACEMENTS`, or `_JOB_PLACEMENTS`
    for `one_job`)."""
    jobs: dict[tuple[str, str], _Candidate] = {}
    for tenant_id, job_id, gpus_per_worker, plan, stored, host_id, gpus in await execute_core(
        session, _JOB_PLACEMENTS if one_job else _CANDIDATE_PLACEMENTS, params
    ):
        job = jobs.setdefault((tenant_id, job_id), _Candidate(tenant_id, job_id, gpus_per_worker, plan, stored, {}))
        if host_id is not None:
            job.gpus_by_host[host_id] = int(gpus)
    return list(jobs.values())


def _placement(gpus_per_worker: int, plan: ParallelPlan, gpus_by_host: dict[str, int]) -> dict[str, object]:
    """A job's effective node set: workers per host (whole workers only), and the plan they run."""
    hosts = {host: gpus // gpus_per_worker for host, gpus in gpus_by_host.items() if gpus >= gpus_per_worker}
    return {"plan": plan.value, "hosts": dict(sorted(hosts.items()))}


async def renew_epochs(
    session: AsyncSession, host_ids: set[str], *, now: datetime, restart: RestartMode,
    job: tuple[str, str] | None = None,
) -> set[str]:
    """Bump the epoch of every job whose node set or plan changed on `host_ids`; returns every host those jobs use(d).

    Candidates are the jobs with a live allocation on these hosts or one released in this transaction (released at
    `now`, the timestamp every release path of the caller's transaction uses). A job whose hosts change must be
    rewritten on *all* its hosts, old and new: each node's rendezvous is sized by the job's node count.

    `job` (tenant, id): the only job whose allocations or plan the transaction changed, for a caller that knows it
    (an accept); then only it is compared, with any job whose reservation on `host_ids` started since the host was
    last written (`_JOB_OR_STARTED`), not every job on them, a cost that grows with the hosts' jobs.
    """
    if not host_ids:
        return set()
    params: dict[str, object] = {"hosts": list(host_ids), "now": now}
    if job is not None:
        params.update(tenant=job[0], job=job[1])
    # the jobs' columns only: hydrating every job on the hosts as an object was about a quarter of an accept's CPU,
    # and a changed one is written by one UPDATE rather than read again, locked, and flushed
    touched: set[str] = set()
    for tenant_id, job_id, gpus_per_worker, plan, stored, gpus_by_host in await _candidates(
        session, params, one_job=job is not None
    ):
        placement = _placement(gpus_per_worker, plan, gpus_by_host)
        if placement == stored:
            continue
        hold_job(session, (tenant_id, job_id))
        event = epoch_event(workers_placed=bool(placement_hosts(placement)), restart=restart)
        changed = (await execute_core(session, _NEW_EPOCH[event], {
            "tenant": tenant_id, "job": job_id, "new_placement": placement, "restart": restart,
        })).first()
        if changed is None:
            continue
        _refresh(session, (tenant_id, job_id), placement=placement, restart_mode=restart, placement_epoch=changed[0],
                 phase=changed[1])
        touched |= set(placement_hosts(stored)) | set(placement_hosts(placement))
    return touched


def _new_epoch(event: JobEvent) -> Update:
    """The job row moved to its next epoch by `event`, in one statement: the placement (read under the ledger lock,
    which every placement change holds, so `stored` above is current) is replaced, the epoch counted up, and the
    phase moved in SQL (`phase_after`), so a progress report that changed it meanwhile is built on, not lost."""
    return (
        update(cast("Table", Job.__table__))
        .where(_J.tenant_id == bindparam("tenant"), _J.id == bindparam("job"))
        .values(
            placement=bindparam("new_placement", type_=_J.placement.type), placement_epoch=_J.placement_epoch + 1,
            restart_mode=bindparam("restart", type_=_J.restart_mode.type), phase=phase_after(event),
        )
        .returning(_J.placement_epoch, _J.phase)
    )


_NEW_EPOCH = {event: _new_epoch(event) for event in (JobEvent.NEW_EPOCH, JobEvent.RELEASED_ALL, JobEvent.LOST_ALL)}


def _refresh(session: AsyncSession, key: tuple[str, str], **values: object) -> None:
    """Give the session's object for the job, if it holds one, the values just written (as committed ones), so a
    caller that reads the job afterwards in this transaction sees its new epoch."""
    sync = session.sync_session
    job = sync.identity_map.get(sync.identity_key(Job, key))
    if job is not None:
        for name, value in values.items():
            set_committed_value(job, name, value)
