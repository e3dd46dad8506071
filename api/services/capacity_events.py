"""Capacity events: a tenant learns, per job, when what the job could grow into changes.

Elasticity is only worth something if the tenant hears of capacity when it appears: polling `GET /v1/capacity`
every second from every controller would be both late and heavy, and no host agent knows the whole fleet. The
control plane does, from its ledger, so it publishes each job's view (`harmonaize.events.Capacity`) through the
outbox whenever the view changes: after a job moved, a host went down or came back, another tenant's job came or
went, or a quarantine ended.

The view is coarse on purpose (free GPUs per group in `bucket_for_free_gpus` buckets under the tenant's pseudonyms)
plus one exact number that is the job's own business: `max_workers`, the size a scale request would be offered now
(its current workers plus whole workers on hosts that are up and not avoided by the job's quarantine, capped at its
`max_workers`).

Level-triggered: the sweeper recomputes every live job's view each tick and publishes those whose digest differs from
the job's `capacity_digest`, with a guarded update, so a restarted API or a second replica publishes a change once
and catches up with whatever changed while it was away.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from api.db import rows_matched
from api.models import Host, Job
from api.services.outbox import enqueue_tenant_event
from api.services.worker_replacement import avoided_hosts
from harmonaize.events import Capacity, GroupCapacity, bucket_for_free_gpus
from harmonaize.jobs import JobPhase
from harmonaize.pseudonyms import locality_pseudonym

__all__ = ["job_capacity", "publish_capacity_changes"]

LIVE_PHASES = tuple(phase for phase in JobPhase if phase is not JobPhase.FINISHED)


def job_capacity(job: Job, hosts: list[Host], *, avoided: frozenset[str], secret: bytes, now: datetime) -> Capacity:
    """The capacity view of `job` (see the module docstring) over `hosts`, the whole fleet as the ledger has it."""
    free_by_group: dict[str, int] = {}
    room = 0
    for host in hosts:
        if host.down_at is not None:
            continue
        free = host.gpus - host.allocated_gpus
        free_by_group[host.locality_group] = free_by_group.get(host.locality_group, 0) + free
        if host.id not in avoided:
            room += free // job.gpus_per_worker
    groups = sorted(
        (GroupCapacity(group=locality_pseudonym(secret, job.tenant_id, group), free_gpus=bucket_for_free_gpus(free))
         for group, free in free_by_group.items()),
        key=lambda entry: entry.group,
    )
    return Capacity(groups=tuple(groups), max_workers=min(job.max_workers, job.desired_workers + room), as_of=now)


def _digest(view: Capacity) -> str:
    """What a change means: the groups and the size, not the time the view was computed."""
    material = json.dumps(view.model_dump(mode="json", exclude={"as_of"}), sort_keys=True).encode()
    return hashlib.sha256(material).hexdigest()


async def publish_capacity_changes(session: AsyncSession, *, secret: bytes, now: datetime) -> int:
    """Queue a capacity event for every live job whose view changed since the last one it was sent; commit; how
    many were queued."""
    hosts = list(await session.scalars(select(Host).order_by(Host.id)))
    jobs = list(await session.scalars(select(Job).where(Job.phase.in_(LIVE_PHASES)).order_by(Job.tenant_id, Job.id)))
    queued = 0
    for job in jobs:
        avoided = await avoided_hosts(session, job, secret=secret, now=now)
        view = job_capacity(job, hosts, avoided=avoided, secret=secret, now=now)
        digest = _digest(view)
        if digest == job.capacity_digest:
            continue
        claimed = await session.execute(
            update(Job)
            .where(Job.tenant_id == job.tenant_id, Job.id == job.id,
                   Job.capacity_digest.is_not_distinct_from(job.capacity_digest))
            .values(capacity_digest=digest)
            .execution_options(synchronize_session=False)
        )
        if rows_matched(claimed) != 1:
            continue  # another process published this change (or a newer one) meanwhile
        enqueue_tenant_event(session, tenant_id=job.tenant_id, job_id=job.id, data=view, now=now)
        queued += 1
    await session.commit()
    return queued
