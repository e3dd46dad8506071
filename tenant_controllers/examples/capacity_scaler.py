"""Capacity scaler: grow into capacity when the provider says it is there; leave hosts ahead of their maintenance.

On a capacity event whose `max_workers` is above the job's size, ask to grow to it, taking any size above the
current one. On a scheduled maintenance notice that takes some of the job's hosts away (a preemption, a reboot, a
termination: anything but a live migration or a mere rebalance recommendation), move off those hosts before the
window opens: keep the size if the provider has room elsewhere, shrink (never below the job's minimum) if not. The
provider keeps the job off those hosts until they come back from their outage, and their return is the next
capacity event, so the job grows back by the same rule.

Pair it with a global batch in the job spec (`global_batch` with a batch-size and an accumulation range): the job
then splits the same samples per step over whatever size it has, so a resize changes its speed, not its training.

    HZ_JOB=llm-finetune harmonaize controller run tenant_controllers/examples/capacity_scaler.py
"""

import os

from harmonaize.events import Capacity, Maintenance, MaintenanceKind, MaintenanceStatus
from tenant_controllers import Controller, Declined, Job

STAYS = {MaintenanceKind.LIVE_MIGRATE, MaintenanceKind.REBALANCE_RECOMMENDATION}
"""Notices a job can ride through on its hosts."""

ctl = Controller(job=os.environ.get("HZ_JOB", "llm-finetune"))


async def grow(job: Job) -> str:
    capacity = job.latest(Capacity)
    if capacity is None:
        return "no capacity view yet"
    target = min(capacity.max_workers, job.max_workers)
    if target <= job.workers:
        return f"keep {job.workers} workers (room for {capacity.max_workers})"
    try:
        offer = await job.negotiate(scale_to=target, accept=(job.workers + 1, target), replace=())
    except Declined:
        return f"provider declined {target} workers; trying again on the next capacity event or resync"
    option = await offer.accept()
    return f"grew to {option.workers} workers"


@ctl.on(Capacity, latest_only=True)
async def on_capacity(event: Capacity, job: Job) -> str:
    return await grow(job)


@ctl.on(Maintenance, when=lambda notice: notice.status is MaintenanceStatus.SCHEDULED and notice.kind not in STAYS)
async def on_maintenance(event: Maintenance, job: Job) -> str:
    if job.workers == 0:
        return "job is not placed; nothing to move"
    try:
        offer = await job.negotiate(scale_to=job.workers, accept=(job.min_workers, job.workers),
                                    deadline=event.window.not_before, replace=event.hosts)
    except Declined:
        return f"could not leave {len(event.hosts)} host(s) before {event.kind.value}: the provider decides"
    option = await offer.accept()
    return f"left {len(event.hosts)} host(s) ahead of {event.kind.value}: {option.workers} workers"


@ctl.on_resync
async def resync(job: Job) -> None:
    await grow(job)
