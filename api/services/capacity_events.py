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
and catches up with whatever changed while it was away. A tick reads the hosts, the live jobs and the quarantines in
three queries and sums the fleet once (`FleetFree`), so its cost grows with hosts + jobs, not hosts x jobs.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from api.db import rows_matched
from api.models import Host, Job
from api.services.outbox import enqueue_tenant_event
from api.services.worker_replacement import avoided_hosts_of_all
from harmonaize.events import Capacity, GroupCapacity, bucket_for_free_gpus
from harmonaize.jobs import JobPhase
from harmonaize.pseudonyms import locality_pseudonym

__all__ = ["FleetFree", "job_capacity", "publish_capacity_changes"]

LIVE_PHASES = tuple(phase for phase in JobPhase if phase is not JobPhase.FINISHED)


@dataclass
class FleetFree:
    """What every job's view is computed from, summed once per sweep: free GPUs per up host and per group."""

    free: dict[str, int]
    """Free GPUs of each host that is up."""
    by_group: dict[str, int]
    _workers: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, hosts: list[Host]) -> FleetFree:
        free = {host.id: host.gpus - host.allocated_gpus for host in hosts if host.down_at is None}
        by_group: dict[str, int] = {}
        for host in hosts:
            if host.down_at is None:
                by_group[host.locality_group] = by_group.get(host.locality_group, 0) + free[host.id]
        return cls(free=free, by_group=by_group)

    def whole_workers(self, gpus_per_worker: int) -> int:
        """Workers of this size that fit on the up hosts, each on one host (summed once per size and sweep)."""
        if gpus_per_worker not in self._workers:
            self._workers[gpus_per_worker] = sum(free // gpus_per_worker for free in self.free.values())
        return self._workers[gpus_per_worker]


def job_capacity(job: Job, fleet: FleetFree, *, avoided: frozenset[str], secret: bytes, now: datetime) -> Capacity:
    """The capacity view of `job` (see the module docstring) over the whole fleet as the ledger has it."""
    room = fleet.whole_workers(job.gpus_per_worker)
    room -= sum(fleet.free[host] // job.gpus_per_worker for host in avoided if host in fleet.free)
    groups = sorted(
        (GroupCapacity(group=_group_pseudonym(secret, job.tenant_id, group), free_gpus=bucket_for_free_gpus(free))
         for group, free in fleet.by_group.items()),
        key=lambda entry: entry.group,
    )
    return Capacity(groups=tuple(groups), max_workers=min(job.max_workers, job.desired_workers + room), as_of=now)


@functools.lru_cache(maxsize=65536)
def _group_pseudonym(secret: bytes, tenant_id: str, group: str) -> str:
    """A tenant's name for a group never changes, and every sweep needs every job's names for every group."""
    return locality_pseudonym(secret, tenant_id, group)


def _digest(view: Capacity) -> str:
    """What a change means: the groups and the size, not the time the view was computed."""
    material = json.dumps(view.model_dump(mode="json", exclude={"as_of"}), sort_keys=True).encode()
    return hashlib.sha256(material).hexdigest()


async def publish_capacity_changes(session: AsyncSession, *, secret: bytes, now: datetime) -> int:
    """Queue a capacity event for every live job whose view changed since the last one it was sent; commit; how
    many were queued."""
    hosts = list(await session.scalars(select(Host).order_by(Host.id)))
    jobs = list(await session.scalars(select(Job).where(Job.phase.in_(LIVE_PHASES)).order_by(Job.tenant_id, Job.id)))
    fleet = FleetFree.of(hosts)
    avoided = await avoided_hosts_of_all(session, hosts, secret=secret, now=now)
    queued = 0
    for job in jobs:
        view = job_capacity(job, fleet, avoided=avoided.get((job.tenant_id, job.id), frozenset()), secret=secret,
                            now=now)
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
