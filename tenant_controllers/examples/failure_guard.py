"""Failure guard: when one of the job's hosts fails, or is predicted to, keep the job running at the best size it can.

On a failure (or a prediction), ask the provider to keep the job at its agreed size, which means a replacement worker,
and accept one worker fewer (never below the job's minimum) if no replacement is available. For a predicted failure
the change must take effect before the predicted time (`deadline=eta`). Informational failures are ignored.

    HZ_JOB=llm-finetune harmonaize controller run tenant_controllers/examples/failure_guard.py
"""

import os

from harmonaize.events import Failure, Severity
from tenant_controllers import Controller, Declined, Job

ctl = Controller(job=os.environ.get("HZ_JOB", "llm-finetune"))


@ctl.on(Failure, when=lambda failure: failure.severity is not Severity.INFO)
async def on_failure(event: Failure, job: Job) -> str:
    size = job.workers
    if size == 0:
        return "job is not placed; nothing to replace"
    at_least = max(job.min_workers, size - 1)
    try:
        offer = await job.negotiate(scale_to=size, accept=(at_least, size), deadline=event.eta)
    except Declined:
        return f"no replacement and no smaller size in {at_least}..{size}: the provider decides"
    option = await offer.accept()
    kept = "replaced the worker" if option.workers == size else f"shrank to {option.workers}"
    return f"{event.kind.value} on {event.host}: {kept}"
