"""Running jobs: the tenant's view of progress, shape timeline and micro-loop directives; the provider's reports.

Tenant routes (`/jobs/{id}/status|timeline|directives`) are scoped by `CurrentTenant` like every tenant route.
Provider routes (`/provider/...`, admin token) are how the provider's own components feed the control plane: the
micro loop proposes directives, node launchers relay progress and report failed nodes, the fleet monitor reports host
outages.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import AdminDep, CurrentTenant, NowDep, PseudonymSecretDep, SessionDep, WakeRelayDep
from api.host_schemas import HostPublic
from api.job_run_schemas import (
    DirectiveProposalBody,
    DirectivePublic,
    JobStatusPublic,
    NodeFailurePublic,
    ProgressSamplePublic,
    TimelineEntryPublic,
)
from api.services import host_outages, job_directives, job_progress, node_failures
from api.services import jobs as jobs_service
from api.services.errors import InvalidRequestError
from harmonaize.ids import HostId, JobId, TenantId
from harmonaize.job_runtime import JobProgress
from harmonaize.node_failures import NodeFailureReport

router = APIRouter(tags=["running jobs"])


@router.get("/jobs/{job_id}/status")
async def get_job_status(
    job_id: JobId, tenant: CurrentTenant, session: SessionDep, secret: PseudonymSecretDep
) -> JobStatusPublic:
    job = await jobs_service.get_job(session, tenant_id=tenant.id, job_id=job_id)
    status = await job_progress.job_status(session, tenant_id=tenant.id, job_id=job_id)
    failures = await node_failures.recent_node_failures(session, tenant_id=tenant.id, job_id=job_id)
    return JobStatusPublic(
        job_id=job.id,
        phase=job.phase,
        desired_workers=job.desired_workers,
        parallel_plan=job.parallel_plan,
        placement_epoch=job.placement_epoch,
        progress=None if status is None else JobProgress.model_validate(status.progress),
        reported_at=None if status is None else status.reported_at,
        node_failures=[NodeFailurePublic.from_model(failure, secret=secret) for failure in failures],
    )


@router.get("/jobs/{job_id}/timeline")
async def get_job_timeline(job_id: JobId, tenant: CurrentTenant, session: SessionDep) -> list[TimelineEntryPublic]:
    await jobs_service.get_job(session, tenant_id=tenant.id, job_id=job_id)
    entries = await job_progress.job_timeline(session, tenant_id=tenant.id, job_id=job_id)
    return [TimelineEntryPublic.from_model(entry) for entry in entries]


@router.get("/jobs/{job_id}/progress")
async def get_job_progress(
    job_id: JobId,
    tenant: CurrentTenant,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=2000)] = 500,
) -> list[ProgressSamplePublic]:
    """The job's progress over time (step, loss, samples/s), oldest first: its latest `limit` kept samples."""
    await jobs_service.get_job(session, tenant_id=tenant.id, job_id=job_id)
    samples = await job_progress.progress_samples(session, tenant_id=tenant.id, job_id=job_id, limit=limit)
    return [ProgressSamplePublic.from_model(sample) for sample in samples]


@router.get("/jobs/{job_id}/directives")
async def list_job_directives(
    job_id: JobId,
    tenant: CurrentTenant,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> list[DirectivePublic]:
    await jobs_service.get_job(session, tenant_id=tenant.id, job_id=job_id)
    records = await job_directives.list_directives(session, tenant_id=tenant.id, job_id=job_id, limit=limit)
    return [DirectivePublic.from_model(record) for record in records]


@router.put("/provider/jobs/{tenant_id}/{job_id}/directives")
async def propose_directives(
    tenant_id: TenantId,
    job_id: JobId,
    body: DirectiveProposalBody,
    _admin: AdminDep,
    session: SessionDep,
    now: NowDep,
    wake: WakeRelayDep,
) -> DirectivePublic | None:
    """Issue the micro loop's settings as the job's next directive version (null: nothing changed).

    422 naming every range the proposal leaves; the refusal is stored and published to the tenant all the same.
    """
    decision = await job_directives.propose(
        session,
        tenant_id=tenant_id,
        job_id=job_id,
        proposal=job_directives.DirectiveProposal(**body.model_dump()),
        now=now,
    )
    wake()
    if decision.refused:
        raise InvalidRequestError("directive refused: " + "; ".join(decision.refusals))
    return None if decision.record is None else DirectivePublic.from_model(decision.record)


@router.post("/provider/progress", status_code=202)
async def report_progress(
    body: JobProgress, _admin: AdminDep, session: SessionDep, now: NowDep, wake: WakeRelayDep
) -> dict[str, bool]:
    """A node launcher relays the progress file of a job's rank 0; older reports only add directive outcomes."""
    newer = await job_progress.report_progress(session, body, now=now)
    wake()
    return {"newer": newer}


@router.post("/provider/node-failures")
async def report_node_failure(
    body: NodeFailureReport,
    _admin: AdminDep,
    session: SessionDep,
    now: NowDep,
    wake: WakeRelayDep,
    secret: PseudonymSecretDep,
) -> dict[str, str]:
    """A node launcher found a job's node hung (and killed it) or gave up restarting it (idempotent).

    `outcome`: `released` (the hung node's workers left the job: new epoch, immediate restart), `recorded` (out of
    restarts: recorded and told, the node keeps its place), `duplicate` or `stale` (nothing changed). 404 for an
    unknown job or host, 409 for an epoch the job has not reached.
    """
    outcome = await node_failures.report_node_failure(session, body, now=now, secret=secret)
    wake()
    return {"outcome": outcome.value}


@router.post("/provider/hosts/{host_id}/down")
async def report_host_down(
    host_id: HostId, _admin: AdminDep, session: SessionDep, now: NowDep, wake: WakeRelayDep
) -> dict[str, list[str]]:
    """The fleet monitor lost the host: its workers leave their jobs at once (idempotent)."""
    shrunk = await host_outages.mark_host_down(session, host_id, now=now)
    wake()
    return {"jobs_shrunk": [f"{tenant}/{job}" for tenant, job in shrunk]}


@router.post("/provider/hosts/{host_id}/up")
async def report_host_up(host_id: HostId, _admin: AdminDep, session: SessionDep, now: NowDep) -> HostPublic:
    """The host is back: it may take placements again (idempotent)."""
    return HostPublic.from_model(await host_outages.mark_host_up(session, host_id, now=now))
