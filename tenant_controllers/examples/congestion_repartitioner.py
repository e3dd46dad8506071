"""Congestion repartitioner: switch DDP to HSDP grouped by locality while traffic between locality groups is slow.

With inter-group congestion at MODERATE or worse, full all-reduces across groups are the bottleneck: HSDP shards the
model inside each locality group (fast fabric) and only replicates across groups. When the congestion clears (level
NONE) the job goes back to DDP. LOW changes nothing either way, so the plan does not flap on a noisy link. Only the
newest inter-group reading counts, and resync re-applies it.

    HZ_JOB=llm-finetune harmonaize controller run tenant_controllers/examples/congestion_repartitioner.py
"""

import os

from harmonaize.events import Congestion, CongestionLevel, CongestionScope
from harmonaize.jobs import ParallelPlan
from tenant_controllers import Controller, Declined, Job

CONGESTED = {CongestionLevel.MODERATE, CongestionLevel.HIGH, CongestionLevel.SEVERE}

ctl = Controller(job=os.environ.get("HZ_JOB", "llm-finetune"))


def inter_group(event: Congestion) -> bool:
    return event.scope is CongestionScope.INTER_GROUP


async def reconcile(job: Job, congestion: Congestion | None) -> str:
    if congestion is None or not inter_group(congestion):
        return "no inter-group reading"
    if congestion.level in CONGESTED:
        plan = ParallelPlan.HSDP
    elif congestion.level is CongestionLevel.NONE:
        plan = ParallelPlan.DDP
    else:
        return f"keep {job.parallel_plan.value} at {congestion.level.value} congestion"
    if job.parallel_plan is plan:
        return f"already {plan.value}"
    try:
        offer = await job.repartition(plan)
    except Declined:
        return f"provider declined {plan.value}"
    await offer.accept()
    return f"repartitioned to {plan.value} ({congestion.level.value} inter-group congestion)"


@ctl.on(Congestion, when=inter_group, latest_only=True)
async def on_congestion(event: Congestion, job: Job) -> str:
    return await reconcile(job, event)


@ctl.on_resync
async def resync(job: Job) -> None:
    await reconcile(job, job.latest(Congestion))
