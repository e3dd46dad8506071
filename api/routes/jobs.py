"""A tenant's jobs and their allocations (hosts and groups shown as the tenant's pseudonyms)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import CurrentTenant, NowDep, PseudonymSecretDep, SessionDep, WakeRelayDep
from api.schemas import JobCreate, TenantAllocationPublic, job_public
from api.services import jobs as service
from api.services.allocations import list_placements
from api.services.tenant_views import tenant_allocation
from harmonaize.ids import JobId
from harmonaize.rest import JobPublic

router = APIRouter(tags=["jobs"])


@router.post("/jobs", status_code=201)
async def create_job(
    body: JobCreate, tenant: CurrentTenant, session: SessionDep, now: NowDep, wake: WakeRelayDep
) -> JobPublic:
    """Create a job; with `initial_workers`, place them too (all or 409, and then no job)."""
    job = await service.create_job(session, tenant_id=tenant.id, spec=body, now=now)
    wake()
    return job_public(job)


@router.get("/jobs")
async def list_jobs(
    tenant: CurrentTenant,
    session: SessionDep,
    after: Annotated[JobId | None, Query(description="Last job id of the previous page.")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> list[JobPublic]:
    jobs = await service.list_jobs(session, tenant_id=tenant.id, after=after, limit=limit)
    return [job_public(job) for job in jobs]


@router.get("/jobs/{job_id}")
async def get_job(job_id: JobId, tenant: CurrentTenant, session: SessionDep) -> JobPublic:
    return job_public(await service.get_job(session, tenant_id=tenant.id, job_id=job_id))


@router.get("/jobs/{job_id}/allocations")
async def list_job_allocations(
    job_id: JobId,
    tenant: CurrentTenant,
    session: SessionDep,
    secret: PseudonymSecretDep,
    include_released: bool = False,
) -> list[TenantAllocationPublic]:
    await service.get_job(session, tenant_id=tenant.id, job_id=job_id)
    placements = await list_placements(
        session, tenant_id=tenant.id, job_id=job_id, include_released=include_released
    )
    return [tenant_allocation(placement, secret=secret) for placement in placements]
