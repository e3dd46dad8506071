"""Carbon-aware scaler: grow the job while the grid is clean, shrink it when the grid is dirty.

When the region's carbon intensity drops below LOW g/kWh, ask to grow toward the job's maximum, taking any size above
the current one that the provider can run under a carbon cap of LOW; when it rises above HIGH, ask to shrink to the
minimum. Between the two thresholds nothing changes (hysteresis, so a reading hovering at a threshold does not make the
job flap). Acting on the newest reading only, and again at every resync, means a lost or late carbon event cannot
leave the job at the wrong size.

    HZ_JOB=llm-finetune harmonaize controller run tenant_controllers/examples/carbon_aware_scaler.py
"""

import os

from harmonaize.events import CarbonIntensity
from tenant_controllers import Controller, Declined, Job, Offer

LOW = float(os.environ.get("HZ_CARBON_LOW", "200"))
HIGH = float(os.environ.get("HZ_CARBON_HIGH", "350"))

ctl = Controller(job=os.environ.get("HZ_JOB", "llm-finetune"))


def best_option(offer: Offer) -> int:
    """Prefer options that apply now, then the most workers."""
    scored = [(option.start_at is None, option.workers or 0) for option in offer.options]
    return max(range(len(scored)), key=scored.__getitem__)


async def reconcile(job: Job) -> str:
    reading = job.latest(CarbonIntensity)
    if reading is None:
        return "no carbon reading yet"
    if reading.g_per_kwh < LOW and job.workers < job.max_workers:
        target, accept, cap = job.max_workers, (job.workers + 1, job.max_workers), LOW
    elif reading.g_per_kwh > HIGH and job.workers > job.min_workers:
        target, accept, cap = job.min_workers, (job.min_workers, job.workers - 1), None
    else:
        return f"keep {job.workers} workers at {reading.g_per_kwh:.0f} g/kWh"
    try:
        offer = await job.negotiate(scale_to=target, accept=accept, carbon_cap=cap)
    except Declined:
        return f"provider declined {target} workers; trying again on the next reading or resync"
    option = await offer.accept(best_option(offer))
    return f"scaled to {option.workers} workers at {reading.g_per_kwh:.0f} g/kWh"


@ctl.on(CarbonIntensity, latest_only=True)
async def on_carbon(event: CarbonIntensity, job: Job) -> str:
    return await reconcile(job)


@ctl.on_resync
async def resync(job: Job) -> None:
    await reconcile(job)
