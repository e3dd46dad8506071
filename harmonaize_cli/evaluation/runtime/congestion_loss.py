"""O2/O4's time to a target loss: the rate arms' job (`local_cloud.congestion_trial`), submitted while another
tenant's bulk flows already share the inter-group uplink, and trained until its loss reaches a target.

The rate windows say how fast each arm steps once its answer is in place; this run says what that is worth to the
tenant, answer time, restart and any loss of gradient quality (PowerSGD's low-rank gradients) included: the wall time
from the job's first step to the target loss, read from rank 0's step lines (`job_log`) the same way in every arm.

An injected congestion episode cannot be cut short, and the run's length is not known in advance, so the congestion
is a chain of short episodes (`SEGMENT_S`), each injected before the previous one ends, until the run is over; the
flows then stop within one segment. The testbed plays a long episode in segments too, so the chain is the same
traffic as one long episode.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from harmonaize.waits import wait_set
from harmonaize_cli.evaluation.runtime.cloud import EvalContext
from harmonaize_cli.evaluation.runtime.job_log import LogWatcher, first_smoothed_under
from harmonaize_cli.local_cloud.congestion_trial import REPARTITIONER, TrialShape, job_spec
from harmonaize_cli.local_cloud.tenant_probe import DEMO_TENANT, TenantProbe, inject_scenario
from provider_agents.telemetry.scenario import CongestionEpisode, Scenario

__all__ = ["LOG_EVERY", "SMOOTH", "TARGET_LOSS", "LossRun", "run_to_loss"]

LOG_EVERY = 2
SMOOTH = 5
"""Logged losses averaged for the target test (10 steps at LOG_EVERY 2): one step's loss is noisy."""
TARGET_LOSS = {"full": 0.042, "quick": 0.046}
"""On the example MLP (hidden 500, 4 x 32 samples a step, lr 3e-3) the smoothed loss falls steeply through these
(measured on one process at batch 128: 0.049 at step 25, 0.041 at 50, 0.036 at 75, then a plateau), so the target
is crossed by the job's progress, not by chance: about step 45 (full) or 30 (quick) without compression."""
SEGMENT_S = 20.0
AHEAD_S = 6.0
"""The next segment is injected this long before the current one ends (an injection waits ~2 s for replies)."""
START_TIMEOUT_S = 180.0
LOSS_TIMEOUT_S = {"full": 360.0, "quick": 240.0}
POLL_S = 0.25


@dataclass
class LossRun:
    """One arm's run to the target loss."""

    arm: str
    job: str
    target_loss: float
    time_to_target_s: float | None = None
    """From the job's first logged step to the first step whose smoothed loss is at or under the target; None if
    the run hit its time limit first."""
    steps_to_target: int | None = None
    losses: list[tuple[float, int, float]] = field(default_factory=list)
    """(seconds from the first step, step, logged loss)."""

    def as_dict(self) -> dict[str, Any]:
        return {"arm": self.arm, "job": self.job, "target_loss": self.target_loss,
                "time_to_target_s": self.time_to_target_s, "steps_to_target": self.steps_to_target,
                "losses": self.losses}


class _CongestionChain:
    """Back-to-back congestion episodes of `SEGMENT_S` on the trial's groups, until `stop` is set."""

    def __init__(self, probe: TenantProbe, shape: TrialShape) -> None:
        self.probe = probe
        self.shape = shape
        self.ends: datetime | None = None
        """When the last injected segment ends (the flows are gone a moment after)."""
        self.started = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        at = datetime.now(UTC)
        while True:
            episode = CongestionEpisode(groups=self.shape.groups, start=0.0, duration=SEGMENT_S,
                                        slowdown=self.shape.slowdown)
            await inject_scenario(self.probe.nats_url, self.probe.secret, Scenario(congestion=(episode,)), at=at)
            at += timedelta(seconds=SEGMENT_S)
            self.ends = at
            self.started.set()
            wait = (at - timedelta(seconds=AHEAD_S) - datetime.now(UTC)).total_seconds()
            if await wait_set(stop, wait):
                return

    async def wait_gone(self) -> None:
        """Until the last segment has ended (and a second more for its flows to be stopped)."""
        while self.ends is not None and datetime.now(UTC) < self.ends + timedelta(seconds=1):
            await asyncio.sleep(0.2)  # the segment's end is a point in time, not a condition to poll for


async def run_to_loss(ctx: EvalContext, arm: str, shape: TrialShape, *, repeat: int) -> LossRun:
    """Congest the uplink, submit the arm's job (its controller running, for the repartition arm), train it to the
    target loss or the time limit, then release it and let the flows end (the next run starts on a quiet link)."""
    mode = "quick" if ctx.quick else "full"
    probe = ctx.probe
    spec = job_spec(arm, replace(shape, log_every=LOG_EVERY), suffix=f"-loss{repeat}")
    run = LossRun(arm=arm, job=spec["id"], target_loss=TARGET_LOSS[mode])
    watcher = LogWatcher(ctx.info.data_dir, (f"hosts/*/jobs/{DEMO_TENANT}.{run.job}/node-e*.log",))
    chain = _CongestionChain(probe, shape)
    stop = asyncio.Event()
    flows = asyncio.create_task(chain.run(stop))
    controller = None
    try:
        if not await wait_set(chain.started, 30):
            raise TimeoutError("the congestion flows did not start within 30 s")
        if arm == "repartition":
            controller = probe.start_controller(REPARTITIONER, run.job)
        await probe.submit(spec)
        first = await _first_step(watcher, run.job)
        while True:
            watcher.poll()
            hit = first_smoothed_under(watcher.steps, run.target_loss, SMOOTH)
            if hit is not None:
                run.time_to_target_s, run.steps_to_target = hit.ts - first, hit.step
                break
            if time.time() - first > LOSS_TIMEOUT_S[mode]:
                break
            await asyncio.sleep(POLL_S)  # the job's log grows a line every LOG_EVERY steps
        run.losses = [(round(s.ts - first, 2), s.step, s.loss) for s in watcher.steps]
        return run
    finally:
        if controller is not None:
            await probe.stop_controller(controller)
        await probe.release(run.job)
        stop.set()
        await flows
        await chain.wait_gone()


async def _first_step(watcher: LogWatcher, job: str) -> float:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        watcher.poll()
        if watcher.steps:
            return watcher.steps[0].ts
        if time.monotonic() > deadline:
            raise TimeoutError(f"{job}: no step within {START_TIMEOUT_S:g} s of its submission")
        await asyncio.sleep(POLL_S)  # polling the job's log for its first step
