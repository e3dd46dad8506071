"""A congestion trial on the testbed: one DDP job across two locality groups, then another tenant's bulk flow over
the inter-group uplink; what the job keeps of its training rate with and without cooperation.

Arms, in one cloud, the same job shape each, one after the other:
- `status_quo`: the tenant allowed no compression and runs no controller, so the job keeps its plan.
- `cooperative`: the tenant allowed fp16 and PowerSGD; the provider's micro loop, seeing the congestion its agents
  measured on the job's path, turns compression on in place.
- `repartition`: no compression allowed, but the tenant runs the example congestion repartitioner
  (`tenant_controllers/examples/congestion_repartitioner.py`): at the congestion event it negotiates HSDP grouped by
  locality (shards inside a group, replicas across), and the job restarts into it from its checkpoint.
Each arm measures samples/s uncongested, then congested once the arm's answer is in place, and when the congestion
event reached the tenant after the flow started. The job is wide enough (`hidden`) that its all-reduce, not its
compute, decides its step time when the link is shared.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from harmonaize_cli.local_cloud.tenant_probe import Rate, TenantProbe, inject_scenario
from provider_agents.telemetry.scenario import CongestionEpisode, Scenario

__all__ = ["ARMS", "REPARTITIONER", "ArmResult", "TrialShape", "job_spec", "run_arm"]

ARMS = ("status_quo", "cooperative", "repartition")
REPARTITIONER = Path(str(importlib.resources.files("tenant_controllers") / "examples" / "congestion_repartitioner.py"))
CONGESTED_LEVELS = {"moderate", "high", "severe"}


@dataclass(frozen=True)
class TrialShape:
    workers: int = 4
    hidden: int = 500
    """~0.27 M parameters: ~1 MB of gradients per all-reduce, ~1.6 MB across each uplink per step (a ring)."""
    step_delay_ms: float = 250.0
    window_s: float = 20.0
    slowdown: float = 3.0
    """The congestion episode's: the testbed plays it as round(slowdown) - 1 bulk flows over the uplink. Two flows,
    not three: with three, the uplink's 20 ms tail-drop FIFO is full so often that even a compressed all-reduce
    waits out TCP's retransmission timeouts (200 ms, doubling), and both arms can stall for seconds a step on a
    loaded machine, a pathology of the queue rather than the congestion the trial is about."""
    groups: tuple[str, str] = ("g1", "g2")
    log_every: int = 50
    """Rank 0 logs its loss every this many steps (the rates come from progress reports, not the log)."""
    detect_timeout_s: float = 10.0
    answer_timeout_s: float = 60.0


@dataclass(frozen=True)
class ArmResult:
    arm: str
    uncongested: Rate
    congested: Rate
    detected_s: float | None
    """From the episode's start to the first congestion event (moderate or worse) of the job at the tenant."""
    measured_s: float | None
    """From the episode's start to when the agents first measured the link congested (that event's `since`): the
    flows' start and the monitor's window. What detected_s adds to it is the event's way to the tenant."""
    compression: str
    plan: str

    @property
    def kept(self) -> float:
        """Congested samples/s as a fraction of the same arm's uncongested ones."""
        return self.congested.samples_per_s / self.uncongested.samples_per_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kept": self.kept}


def job_spec(arm: str, shape: TrialShape, *, suffix: str = "") -> dict[str, Any]:
    """The arm's job; `suffix` tells apart jobs of the same arm in one cloud (their logs are kept per job id)."""
    allowed = ["none", "fp16", "powersgd"] if arm == "cooperative" else ["none"]
    return {
        "id": f"congestion-{arm.replace('_', '-')}{suffix}",
        "min_workers": shape.workers, "max_workers": shape.workers, "initial_workers": shape.workers,
        "gpus_per_worker": 4,
        "gradient_compression": {"allowed": allowed, **({"powersgd_max_rank": 8} if arm == "cooperative" else {})},
        "entrypoint": ["-m", "workloads.examples.mlp", "--hidden", str(shape.hidden),
                       "--step-delay-ms", str(shape.step_delay_ms), "--log-every", str(shape.log_every)],
    }


async def run_arm(probe: TenantProbe, arm: str, shape: TrialShape, *, suffix: str = "") -> ArmResult:
    """Run one arm to the end: submit, measure uncongested, start the flow, wait for the arm's answer, measure,
    release the job and wait out the flow (so the next arm starts on a quiet link). `suffix`: `job_spec`'s, for a
    second run of the arm in the same cloud (a released job keeps its id)."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; arms: {', '.join(ARMS)}")
    spec = job_spec(arm, shape, suffix=suffix)
    job = spec["id"]
    await probe.submit(spec)
    await probe.wait_progress(job, lambda p: p["step"] >= 20 and p["world_size"] == shape.workers,
                              timeout=180, what=f"{job}: training at {shape.workers} workers")
    uncongested = await probe.rate(job, shape.window_s)
    controller = probe.start_controller(REPARTITIONER, job) if arm == "repartition" else None
    try:
        return await _congested(probe, arm, shape, job, uncongested)
    finally:
        if controller is not None:
            await probe.stop_controller(controller)


async def _congested(probe: TenantProbe, arm: str, shape: TrialShape, job: str, uncongested: Rate) -> ArmResult:
    answer_s = {"status_quo": 0.0, "cooperative": shape.answer_timeout_s / 3}.get(arm, shape.answer_timeout_s)
    duration = shape.detect_timeout_s + answer_s + shape.window_s + 10  # ends after the window
    started = time.monotonic()
    begins = datetime.now(UTC)
    episode = CongestionEpisode(groups=shape.groups, start=0.0, duration=duration, slowdown=shape.slowdown)
    await inject_scenario(probe.nats_url, probe.secret, Scenario(congestion=(episode,)), at=begins)
    detected = None
    deadline = started + shape.detect_timeout_s
    while detected is None and time.monotonic() < deadline:
        detected = probe.first_match("congestion", job, lambda d: d.get("level") in CONGESTED_LEVELS, after=started)
        await _tick()
    if arm == "cooperative":
        await probe.wait_progress(job, lambda p: p["compression"] != "none", timeout=answer_s,
                                  what=f"{job}: compression turned on by the micro loop")
    elif arm == "repartition":
        hsdp = await probe.wait_progress(job, lambda p: p["parallel_plan"] == "hsdp", timeout=answer_s,
                                         what=f"{job}: repartitioned to HSDP by the tenant's controller")
        await probe.wait_progress(job, lambda p: p["step"] >= hsdp["step"] + 5, timeout=answer_s,
                                  what=f"{job}: stepping in HSDP")
    congested = await probe.rate(job, shape.window_s)
    last = await probe.progress(job)
    await probe.release(job)
    ends = begins + timedelta(seconds=duration)
    while datetime.now(UTC) < ends + timedelta(seconds=1):  # the flow is scheduled to stop then
        await _tick()
    return ArmResult(
        arm=arm, uncongested=uncongested, congested=congested,
        detected_s=None if detected is None else detected[0] - started,
        measured_s=None if detected is None else _seconds_after(begins, detected[1]["since"]),
        compression=str((last or {}).get("compression", "?")), plan=str((last or {}).get("parallel_plan", "?")),
    )


def _seconds_after(begins: datetime, when: str) -> float:
    return (datetime.fromisoformat(when) - begins).total_seconds()


async def _tick() -> None:
    await asyncio.sleep(0.1)
