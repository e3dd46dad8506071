"""O1 runtime adaptation on the real runtime: capacity beyond a job's guaranteed size appears and disappears; a job
of fixed size against one that negotiates into it and out of it, with its global batch kept at every size.

The fleet's story, the same in both arms: the job is placed on 2 of the 4 hosts (its guaranteed capacity); the other
2 are spare, and the provider takes them back for a while, on a fixed schedule from the job's first step: a
preemption notice for both with the lead time of AWS's Spot interruption notice (scaled like O5's), both taken out
of service at the notice's start (the control plane's own host-down call), both back after the outage (host-up).

- `status_quo`: the job's size is fixed at 2 (min = max = 2); it never hears of the spare hosts.
- `cooperative`: the job may run 2-4 workers and the tenant runs the shipped example `capacity_scaler`: the control
  plane's capacity event says there is room, the scaler negotiates the growth (the joiners start warm and join in
  place); at the preemption notice it moves off the two hosts before their window (a negotiated shrink, no step
  lost); once they are back up, the next capacity event grows the job again.

Both jobs declare the same global batch (`global_batch`, with batch-size and accumulation ranges): each size splits
the same samples per optimizer step (64 x 2 at 2 workers, 64 x 1 at 4), so the loss per step is the same in both
arms and a larger size only makes the steps faster. The example MLP's compute is a stand-in that scales with each
worker's share of the batch (`--sample-delay-ms`, what a GPU would spend; four workers share two CPU cores here).

Measured from rank 0's step lines (`job_log`), the same way in both arms: the time from the first step to the
target loss (the mean of the last `SMOOTH` logged losses at or under `TARGET_LOSS`), and the GPU-hours the job held
until then (its allocated workers, sampled from the control plane, times 4 GPUs each), also priced with the spare
capacity at a spot-like discount (`SPARE_PRICE`; the guaranteed 2 workers at the on-demand price).
"""

from __future__ import annotations

import asyncio
import importlib.resources
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from statistics import fmean
from typing import Any

from harmonaize.events import MaintenanceKind
from harmonaize_cli.evaluation.results import COOPERATIVE, STATUS_QUO, ScenarioResult
from harmonaize_cli.evaluation.runtime.cloud import EvalContext
from harmonaize_cli.evaluation.runtime.job_log import LogWatcher, StepLine, first_smoothed_under
from harmonaize_cli.evaluation.runtime.kept_logs import keep_job_logs
from harmonaize_cli.evaluation.runtime.reliability_events import CHANNELS, LEAD_SCALE
from harmonaize_cli.local_cloud.tenant_probe import DEMO_TENANT, inject_scenario
from provider_agents.telemetry.scenario import MaintenanceSpec, Scenario

__all__ = ["FULL", "KEY", "QUICK", "Shape", "adaptation_scenario", "job_spec", "plot_adaptation", "reached"]

KEY = "o1_adaptation"
_log = logging.getLogger(__name__)
SCALER = Path(str(importlib.resources.files("tenant_controllers") / "examples" / "capacity_scaler.py"))
GUARANTEED, MAX_WORKERS, GPUS_PER_WORKER = 2, 4, 4
GLOBAL_BATCH = 256
BATCH_RANGE, ACCUMULATION_RANGE = (32, 64), (1, 4)
SAMPLE_DELAY_MS = 1.0
LR = 3e-4
LOG_EVERY = 20
SMOOTH = 5
"""Logged losses averaged for the target test (100 steps at LOG_EVERY 20): one step's loss is noisy."""
NOTICE = next(channel for channel in CHANNELS if channel.key == "aws_spot")
SPARE_PRICE = 0.4
"""Price of a GPU-hour of spare (reclaimable) capacity, against 1.0 for the guaranteed one: a 60 % discount, of the
order the clouds' spot and preemptible GPU capacity sells at; an assumption of this scenario, stated as such."""
POLL_S = 0.25
START_TIMEOUT_S = 180.0
QUIET_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Shape:
    """A run's target and the fleet's schedule."""

    target_loss: float
    """Reached near step 600 (0.040) or 350 (0.050) at this global batch and learning rate, whatever the size
    (measured with one worker at batch 256: 0.053 at step 300, 0.043 at 500, 0.039 at 600)."""
    reclaims_s: tuple[float, ...]
    """When (seconds after the job's first step) the provider announces it takes the spare hosts back."""
    outage_s: float
    hard_cap_s: float


FULL = Shape(target_loss=0.040, reclaims_s=(30.0, 90.0), outage_s=25.0, hard_cap_s=600.0)
QUICK = Shape(target_loss=0.050, reclaims_s=(10.0,), outage_s=15.0, hard_cap_s=300.0)


@dataclass
class _Run:
    """One arm's job, as the scenario saw it."""

    arm: str
    job: str
    first_step_ts: float | None = None
    reached_ts: float | None = None
    reached_step: int | None = None
    gpu_s: float = 0.0
    spare_gpu_s: float = 0.0
    workers: list[tuple[float, int]] = field(default_factory=list)
    """(seconds from the first step, allocated workers)."""
    losses: list[tuple[float, int, float]] = field(default_factory=list)
    """(seconds from the first step, step, logged loss)."""
    events: list[tuple[float, str]] = field(default_factory=list)
    kept_logs: Path | None = None
    """Where its logs were kept, for a run that missed the target (`kept_logs`)."""

    @property
    def time_to_target_s(self) -> float | None:
        if self.first_step_ts is None or self.reached_ts is None:
            return None
        return self.reached_ts - self.first_step_ts

    def as_series(self) -> dict[str, Any]:
        return {"arm": self.arm, "job": self.job, "workers": self.workers, "losses": self.losses,
                "events": self.events, "time_to_target_s": self.time_to_target_s}


def job_spec(job: str, arm: str, target_steps: int) -> dict[str, Any]:
    fixed = arm == STATUS_QUO
    return {
        "id": job, "min_workers": GUARANTEED, "max_workers": GUARANTEED if fixed else MAX_WORKERS,
        "initial_workers": GUARANTEED, "gpus_per_worker": GPUS_PER_WORKER,
        "batch_size": {"min": BATCH_RANGE[0], "max": BATCH_RANGE[1]},
        "gradient_accumulation": {"min": ACCUMULATION_RANGE[0], "max": ACCUMULATION_RANGE[1]},
        "global_batch": GLOBAL_BATCH,
        "entrypoint": ["-m", "workloads.examples.mlp", "--lr", f"{LR:g}", "--sample-delay-ms", f"{SAMPLE_DELAY_MS:g}",
                       "--log-every", str(LOG_EVERY), "--max-steps", str(target_steps)],
    }


def reached(steps: list[StepLine], target: float) -> StepLine | None:
    """The first logged step at which the mean of the last `SMOOTH` logged losses is at or under `target`."""
    return first_smoothed_under(steps, target, SMOOTH)


class _Arm:
    """Plays the fleet's story around one job and measures it."""

    def __init__(self, ctx: EvalContext, run: _Run, shape: Shape) -> None:
        self.ctx = ctx
        self.run = run
        self.shape = shape
        self.watcher = LogWatcher(ctx.info.data_dir, (f"hosts/*/jobs/{DEMO_TENANT}.{run.job}/node-e*.log",))
        lead = NOTICE.lead_s(LEAD_SCALE)
        self.actions = sorted(
            [(at, "notice") for at in shape.reclaims_s]
            + [(at + lead, "down") for at in shape.reclaims_s]
            + [(at + lead + shape.outage_s, "up") for at in shape.reclaims_s]
        )
        self.spare: list[str] = []
        self.down: set[str] = set()

    async def _hosts(self) -> list[str]:
        reply = await self.ctx.probe.admin.get("/v1/allocations", params={"tenant_id": DEMO_TENANT,
                                                                          "job_id": self.run.job})
        reply.raise_for_status()
        return sorted({a["host_id"] for a in reply.json() if a.get("released_at") is None})

    async def _set_host(self, host: str, state: str) -> None:
        reply = await self.ctx.probe.admin.post(f"/v1/provider/hosts/{host}/{state}")
        reply.raise_for_status()
        (self.down.add if state == "down" else self.down.discard)(host)

    async def _act(self, action: str, since_first: float) -> None:
        if action == "notice":
            lead = NOTICE.lead_s(LEAD_SCALE)
            specs = tuple(MaintenanceSpec(host=host, kind=MaintenanceKind.PREEMPT, announce=0.0, start=lead,
                                          end=lead + self.shape.outage_s,
                                          notice=f"reclaim-{self.run.job}-{len(self.run.events)}")
                          for host in self.spare)
            await inject_scenario(self.ctx.probe.nats_url, self.ctx.probe.secret, Scenario(maintenance=specs),
                                  at=datetime.now(UTC))
        else:
            for host in self.spare:
                await self._set_host(host, action)
        self.run.events.append((since_first, action))

    async def place(self) -> None:
        """After the submission, before anything grows the job: its hosts are the guaranteed ones, the rest spare."""
        guaranteed = await self._hosts()
        if len(guaranteed) != GUARANTEED:
            raise RuntimeError(f"{self.run.job}: placed on {guaranteed}, expected {GUARANTEED} hosts")
        self.spare = sorted(set(self.ctx.fleet.hosts) - set(guaranteed))

    async def play(self) -> None:
        """From submission to the target loss (or the hard cap): the job's first step, the reclaim schedule, the
        allocation sampled for billing, the losses read as they are logged."""
        probe = self.ctx.probe
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.run.first_step_ts is None:
            self.watcher.poll()
            if self.watcher.steps:
                self.run.first_step_ts = self.watcher.steps[0].ts
            elif time.monotonic() > deadline:
                raise TimeoutError(f"{self.run.job}: no step within {START_TIMEOUT_S:g} s of its submission")
            else:
                await asyncio.sleep(POLL_S)  # polling the job's log for its first step
        last_sample = time.time()
        actions = list(self.actions)
        while True:
            now = time.time()
            since_first = now - self.run.first_step_ts
            while actions and actions[0][0] <= since_first:
                await self._act(actions.pop(0)[1], since_first)
            status = await probe.job_status(self.run.job)
            workers = int(status.get("desired_workers", 0))
            self.run.gpu_s += workers * GPUS_PER_WORKER * (now - last_sample)
            self.run.spare_gpu_s += max(0, workers - GUARANTEED) * GPUS_PER_WORKER * (now - last_sample)
            last_sample = now
            self.run.workers.append((round(since_first, 2), workers))
            self.watcher.poll()
            hit = reached(self.watcher.steps, self.shape.target_loss)
            if hit is not None:
                self.run.reached_ts, self.run.reached_step = hit.ts, hit.step
                break
            if since_first > self.shape.hard_cap_s:
                break
            await asyncio.sleep(POLL_S)  # a sampling period: the measurement, not a wait for a condition
        first = self.run.first_step_ts
        self.run.losses = [(round(s.ts - first, 2), s.step, s.loss) for s in self.watcher.steps]

    async def quiet(self) -> None:
        """Release the job, every host up, and wait until the fleet is free (the next run starts on a quiet one)."""
        await self.ctx.probe.release(self.run.job)
        for host in sorted(self.down):
            await self._set_host(host, "up")
        deadline = time.monotonic() + QUIET_TIMEOUT_S
        while True:
            reply = await self.ctx.probe.admin.get("/v1/hosts")
            reply.raise_for_status()
            busy = [h["id"] for h in reply.json() if h.get("down_at") or h.get("free_gpus") != h.get("gpus")]
            if not busy:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.run.job}: hosts still busy or down {QUIET_TIMEOUT_S:g} s after the "
                                   f"release: {busy}")
            await asyncio.sleep(0.5)  # polling the control plane


async def _one(ctx: EvalContext, arm: str, repeat: int, shape: Shape) -> _Run:
    run = _Run(arm=arm, job=f"adapt-{arm.replace('_', '-')}-{repeat}-{int(time.time()) % 100_000}")
    player = _Arm(ctx, run, shape)
    await ctx.probe.submit(job_spec(run.job, arm, target_steps=10_000))
    await player.place()
    controller = ctx.probe.start_controller(SCALER, run.job) if arm == COOPERATIVE else None
    try:
        await player.play()
    finally:
        if controller is not None:
            await ctx.probe.stop_controller(controller)
        if run.reached_ts is None:  # the cloud's data dir goes with it: keep what explains the miss
            run.kept_logs = keep_job_logs(ctx.info.data_dir, ctx.out_dir, tenant=DEMO_TENANT, job=run.job)
        await player.quiet()
    _log.info("o1 adaptation: %s reached %s in %s s", run.job, run.reached_step, run.time_to_target_s)
    return run


async def adaptation_scenario(ctx: EvalContext) -> ScenarioResult:
    shape = QUICK if ctx.quick else FULL
    lead = NOTICE.lead_s(LEAD_SCALE)
    result = ScenarioResult(
        key=KEY, title="O1 runtime adaptation: spare capacity comes and goes",
        how=(f"Real runtime, {ctx.info.network}. One job per arm, one after the other on the same 4 hosts of 4 GPUs: "
             f"the example MLP (lr {LR:g}), global batch {GLOBAL_BATCH} kept at every size (per-rank batch "
             f"{BATCH_RANGE[0]}-{BATCH_RANGE[1]}, accumulation {ACCUMULATION_RANGE[0]}-{ACCUMULATION_RANGE[1]}), "
             f"compute stand-in {SAMPLE_DELAY_MS:g} ms per sample of each worker's share. The job starts on "
             f"{GUARANTEED} hosts; the other {MAX_WORKERS - GUARANTEED} are spare, and the provider takes them back "
             f"at {', '.join(f'{s:g}' for s in shape.reclaims_s)} s after the first step: a preemption notice "
             f"({NOTICE.label}, {NOTICE.real_lead_s:g} s scaled to {lead:g} s), the hosts out of service for "
             f"{shape.outage_s:g} s, then back. Target: the mean of the last {SMOOTH} logged losses (every "
             f"{LOG_EVERY} steps) at or under {shape.target_loss:g}. Cost: the job's allocated GPUs over time until "
             f"the target; spare capacity priced at {SPARE_PRICE:g} of the guaranteed (an assumption, stated), and "
             "unpriced GPU-hours beside it."),
        arms={
            STATUS_QUO: f"fixed size: {GUARANTEED} workers (min = max), no capacity signal, the spare hosts unused.",
            COOPERATIVE: (f"{GUARANTEED}-{MAX_WORKERS} workers and the shipped capacity_scaler: grows on the control "
                          "plane's capacity event, moves off the spare hosts at the preemption notice, grows back "
                          "when they return."),
        },
    )
    runs: list[_Run] = []
    for repeat in range(ctx.repeats):
        order = (STATUS_QUO, COOPERATIVE) if repeat % 2 == 0 else (COOPERATIVE, STATUS_QUO)
        for arm in order:
            run = await _one(ctx, arm, repeat, shape)
            runs.append(run)
            seconds = run.time_to_target_s
            result.metric("time_to_target_s", unit="s", better="lower").add(
                arm, float("nan") if seconds is None else seconds)
            result.metric("gpu_hours_to_target", unit="GPU-h", better="lower").add(arm, run.gpu_s / 3600)
            cost = (run.gpu_s - run.spare_gpu_s + SPARE_PRICE * run.spare_gpu_s) / 3600
            result.metric("cost_to_target", unit="on-demand GPU-h", better="lower", target="<= 0.8x").add(arm, cost)
            mean_workers = fmean(w for _, w in run.workers) if run.workers else float("nan")
            result.metric("mean_workers", unit="workers", better="higher").add(arm, mean_workers)
    result.seeds = ctx.repeats
    result.series = {"runs": [run.as_series() for run in runs], "target": shape.target_loss}
    for run in runs:
        if run.reached_ts is None:
            result.notes.append(_missed(run))
    result.notes.append("Arms alternate their order between repeats; the loss per step is the same in both arms by "
                        "construction (same global batch), so the time to the target is the size's effect.")
    return result


def _missed(run: _Run) -> str:
    """The note for a run that did not reach the target: how far it got, and where its logs are."""
    if run.losses:
        seconds, step, loss = run.losses[-1]
        got = f"its last logged step was {step} at {seconds:g} s (loss {loss:.4f})"
    else:
        got = "it logged no step"
    workers = f", {run.workers[-1][1]} workers then" if run.workers else ""
    where = f"; its logs: {run.kept_logs}" if run.kept_logs is not None and run.kept_logs.exists() else ""
    return f"{run.job} ({run.arm}) did not reach the target loss within the hard cap: {got}{workers}{where}."


def plot_adaptation(result: ScenarioResult, out_dir: Path) -> list[str]:
    """The first repeat: each arm's workers over time, and its smoothed loss against the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result.series.get("runs", [])
    first: dict[str, dict[str, Any]] = {}
    for run in runs:
        first.setdefault(run["arm"], run)
    if not first:
        return []
    fig, (size_ax, loss_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for arm, run in first.items():
        label = arm.replace("_", " ")
        size_ax.step([t for t, _ in run["workers"]], [w for _, w in run["workers"]], where="post", label=label)
        losses = run["losses"]
        smoothed = [(losses[i][0], fmean(x[2] for x in losses[max(0, i - SMOOTH + 1):i + 1]))
                    for i in range(len(losses))]
        loss_ax.plot([t for t, _ in smoothed], [v for _, v in smoothed], label=label)
        for at, action in run["events"]:
            if arm == COOPERATIVE:
                size_ax.axvline(at, color={"notice": "orange", "down": "red", "up": "green"}[action],
                                linestyle=":", linewidth=0.8)
    loss_ax.axhline(result.series.get("target", FULL.target_loss), color="black", linestyle="--", linewidth=0.8)
    size_ax.set_ylabel("workers allocated")
    size_ax.legend(loc="lower right")
    size_ax.set_title("Spare capacity reclaimed (orange: notice, red: out, green: back)")
    loss_ax.set_ylabel(f"loss (mean of {SMOOTH} logs)")
    loss_ax.set_xlabel("seconds from the first step")
    loss_ax.set_yscale("log")
    loss_ax.legend(loc="upper right")
    fig.tight_layout()
    name = f"{result.key}.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return [name]
