"""A tenant controller that counts: every run of its handler body appends the event's CloudEvent id to $COUNTER_RUNS.

The append is a side effect outside the SDK, so the test sees every execution, including any the SDK's
de-duplication failed to suppress. Run with `python -m tenant_controllers.cli run counting_controller.py`.
"""

import os

from harmonaize.events import CarbonIntensity, CloudEvent
from tenant_controllers import Controller

ctl = Controller(job=os.environ["COUNTER_JOB"], name="counter")
RUNS = os.environ["COUNTER_RUNS"]


@ctl.on(CarbonIntensity)
async def count(envelope: CloudEvent[CarbonIntensity]) -> None:
    with open(RUNS, "a") as runs:
        runs.write(envelope.id + "\n")
