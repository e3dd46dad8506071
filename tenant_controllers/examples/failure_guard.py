"""Failure guard: when one of the job's hosts fails, or is predicted to, keep the job running at the best size it can.

On a failure (or a prediction), ask the provider to keep the job at its agreed size, which means a replacement worker,
and accept one worker fewer (never below the job's minimum) if no replacement is available. For a predicted failure
the change must take effect before the predicted time (`deadline=eta`). Informational failures are ignored.

A replacement is made before the failing worker leaves: the job switches once the new worker has started. With less
warning than a worker takes to start (`HZ_REPLACE_MIN_LEAD_S`: 10 s by default, about what one takes on a CPU host;
a GPU worker that loads a large model needs more, so set it to your job's start-up time), the host would die mid-swap
and the job would wait out the rest of the joiner's start-up. Then the guard moves the worker off first (one fewer, in
place, at the next step) and leaves growing back to whoever grows the job when capacity shows (the capacity scaler,
or the tenant's next decision).

    HZ_JOB=llm-finetune harmonaize controller run tenant_controllers/examples/failure_guard.py
"""

import os
from datetime import timedelta

from harmonaize.events import Failure, Severity
from tenant_controllers import Controller, Declined, Job

ctl = Controller(job=os.environ.get("HZ_JOB", "llm-finetune"))

MIN_LEAD_TO_REPLACE = timedelta(seconds=float(os.environ.get("HZ_REPLACE_MIN_LEAD_S", "10")))


def notice_too_short(failure: Failure) -> bool:
    """A predicted failure whose notice (its eta, from when it was detected) is shorter than a worker's start."""
    return failure.eta is not None and failure.eta - failure.detected_at < MIN_LEAD_TO_REPLACE


@ctl.on(Failure, when=lambda failure: failure.severity is not Severity.INFO)
async def on_failure(event: Failure, job: Job) -> str:
    size = job.workers
    if size == 0:
        return "job is not placed; nothing to replace"
    at_least = max(job.min_workers, size - 1)
    if notice_too_short(event) and at_least < size:
        try:
            offer = await job.negotiate(scale_to=at_least, accept=(at_least, at_least), deadline=event.eta)
        except Declined:
            return f"notice too short to replace and no way to leave {event.host} first: the provider decides"
        option = await offer.accept()
        return f"{event.kind.value} on {event.host}: left first, {option.workers} workers (notice too short)"
    try:
        offer = await job.negotiate(scale_to=size, accept=(at_least, size), deadline=event.eta)
    except Declined:
        return f"no replacement and no smaller size in {at_least}..{size}: the provider decides"
    option = await offer.accept()
    kept = "replaced the worker" if option.workers == size else f"shrank to {option.workers}"
    return f"{event.kind.value} on {event.host}: {kept}"
