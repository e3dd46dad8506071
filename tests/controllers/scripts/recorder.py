"""A controller script for the crash tests: records every carbon event it handles.

Each run of the handler body appends the event id to $RECORDER_RUNS (a side effect outside the SDK, so the test can
see re-executions); the returned outcome is what the SDK records, once, with the event id.
"""

import asyncio
import os

from harmonaize.events import CarbonIntensity, CloudEvent
from tenant_controllers import Controller, Job

ctl = Controller(job="llm-finetune", name=os.environ.get("RECORDER_NAME", "recorder"))


@ctl.on(CarbonIntensity)
async def record(envelope: CloudEvent[CarbonIntensity], job: Job) -> dict[str, object]:
    with open(os.environ["RECORDER_RUNS"], "a") as runs:
        runs.write(envelope.id + "\n")
    await asyncio.sleep(0.001)  # a handler that takes a moment, so kills land mid-handler
    return {"g": envelope.data.g_per_kwh, "at": envelope.time.isoformat(), "max_workers": job.max_workers}
