"""The discrete-event simulation of one arm on one workload: a 64-GPU cluster (16 nodes x 4 GPUs), jobs arriving as
the Pollux workload says, each running at the samples/s of its GPU count until its work is done.

Events: arrivals, completions, failures (failures.py) and hourly ticks (the carbon trace's steps). After an arrival
or a completion the arm's policy re-allocates; every change is charged as the arm's costs say. A job's progress is
piecewise linear: a plan of (from time, samples/s) segments, a pause being a segment at 0.

Checkpoints: every job saves every `checkpoint_interval_s` of wall time since it (re)started, in every arm; the save's
blocking time is charged as a throughput factor interval / (interval + write time), the same for all. A restart from
a checkpoint rolls the job back to its last save; an in-place recovery or a move with notice rolls back nothing.

A failure hits one GPU of the 64 at random; if a job holds it, that job is interrupted. The failed GPU is replaced at
once (the cluster stays at 64), in every arm.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from enum import IntEnum

from harmonaize_cli.evaluation.cluster.apps import work_samples
from harmonaize_cli.evaluation.cluster.arms import ArmSpec
from harmonaize_cli.evaluation.cluster.energy import T4, EnergyMeter
from harmonaize_cli.evaluation.cluster.failures import LLAMA3, FailureEvent, FailureSource, event_stream
from harmonaize_cli.evaluation.cluster.policies import JobView
from harmonaize_cli.evaluation.cluster.throughput import load_throughput
from harmonaize_cli.evaluation.cluster.trace import CarbonTrace, JobSpec, carbon_trace
from harmonaize_cli.evaluation.energy import GpuPowerModel

__all__ = ["CLUSTER_GPUS", "FailureRecord", "JobRecord", "SimConfig", "SimResult", "job_cap", "simulate"]

CLUSTER_GPUS = 64
HOUR_S = 3600.0
EPS = 1e-9


@dataclass(frozen=True)
class SimConfig:
    gpus: int = CLUSTER_GPUS
    checkpoint_interval_s: float = 1800.0
    """Periodic checkpoint interval (assumed; the same in every arm)."""
    failure_source: FailureSource = LLAMA3
    failure_multiplier: float = 1.0
    predictable: float = 0.0
    failure_horizon_s: float = 60 * 24 * HOUR_S
    """Failures are drawn over this long (far past any run's makespan)."""
    elastic_cap_factor: int = 2
    """A job may grow to this many times its requested size (and no further than its batch allows)."""


def job_cap(spec: JobSpec, factor: int, gpus: int) -> int:
    """The most GPUs a job may use: `factor` x requested, no more than the per-GPU batch stays at or above the
    smallest measured one (so the global batch is kept), the table's largest size and the cluster."""
    table = load_throughput(spec.app)
    by_batch = max(1, math.floor(spec.batch_size / table.min_local_bsz))
    return max(spec.requested, min(factor * spec.requested, by_batch, table.max_gpus, gpus))


@dataclass
class _Job:
    key: int
    spec: JobSpec
    work: float
    cap: int
    thr: tuple[float, ...]
    """Samples/s at n GPUs, the checkpoint factor applied."""
    gpus: int = 0
    done: float = 0.0
    processed: float = 0.0
    lost: float = 0.0
    t: float = 0.0
    plan: list[tuple[float, float]] = field(default_factory=list)
    ckpt_done: float = 0.0
    next_ckpt_s: float = math.inf
    start_s: float | None = None
    end_s: float | None = None
    version: int = 0
    rescales: int = 0
    interruptions: int = 0

    def rate_at(self, t: float) -> float:
        rate = 0.0
        for start, r in self.plan:
            if start > t:
                break
            rate = r
        return rate

    def progress(self, t0: float, t1: float) -> float:
        total = 0.0
        for i, (start, r) in enumerate(self.plan):
            end = self.plan[i + 1][0] if i + 1 < len(self.plan) else math.inf
            lo, hi = max(start, t0), min(end, t1)
            if hi > lo:
                total += r * (hi - lo)
        return total

    def busy_s(self, t0: float, t1: float) -> float:
        total = 0.0
        for i, (start, r) in enumerate(self.plan):
            end = self.plan[i + 1][0] if i + 1 < len(self.plan) else math.inf
            lo, hi = max(start, t0), min(end, t1)
            if hi > lo and r > 0:
                total += hi - lo
        return total

    def stalled_until(self, now: float) -> float:
        """When a pause under way at `now` ends (now if the job is stepping)."""
        if self.rate_at(now) > 0:
            return now
        for start, r in self.plan:
            if start > now and r > 0:
                return start
        return now

    def finish_time(self) -> float:
        left = self.work - self.done
        if left <= EPS:
            return self.t
        for i, (start, r) in enumerate(self.plan):
            end = self.plan[i + 1][0] if i + 1 < len(self.plan) else math.inf
            lo = max(start, self.t)
            if end <= lo or r <= 0:
                continue
            if r * (end - lo) >= left:
                return lo + left / r
            left -= r * (end - lo)
        return math.inf

    def view(self) -> JobView:
        return JobView(key=self.key, submit_s=self.spec.submit_s, requested=self.spec.requested, cap=self.cap,
                       gpus=self.gpus, remaining=self.work - self.done, thr=self.thr)


@dataclass(frozen=True)
class JobRecord:
    name: str
    app: str
    requested: int
    submit_s: float
    start_s: float
    end_s: float
    work: float
    processed: float
    lost: float
    rescales: int
    interruptions: int
    requested_run_s: float
    """Its run time alone at the size it asked for (no pause, no failure): what a static run would take."""

    @property
    def jct_s(self) -> float:
        return self.end_s - self.submit_s


@dataclass(frozen=True)
class FailureRecord:
    t_s: float
    notice: bool
    job: str | None
    """The job interrupted, None when the GPU was idle."""
    handling: str
    """'notice' (moved before), 'in_place', 'restart' or 'idle'."""
    pause_s: float
    lost_gpu_h: float
    """Work rolled back, in GPU-hours at the job's rate then."""
    pause_gpu_h: float


@dataclass
class SimResult:
    arm: str
    jobs: list[JobRecord]
    makespan_s: float
    gpu_hours: float
    """GPU-hours held by jobs (stepping or not)."""
    energy_kwh: float
    kg_co2: float
    max_gpus_in_use: int
    failures: list[FailureRecord]
    usage: list[tuple[float, int]]
    """(time, GPUs held) after every change."""

    @property
    def jcts(self) -> list[float]:
        return [j.jct_s for j in self.jobs]


class _Kind(IntEnum):
    FINISH = 0
    ARRIVAL = 1
    FAILURE = 2
    TICK = 3


class _Sim:
    def __init__(self, workload: list[JobSpec], arm: ArmSpec, config: SimConfig, failures: list[FailureEvent],
                 carbon: CarbonTrace, power: GpuPowerModel) -> None:
        self.arm, self.cfg = arm, config
        factor = config.checkpoint_interval_s / (config.checkpoint_interval_s + arm.checkpoint_write_s)
        self.jobs: list[_Job] = []
        for key, spec in enumerate(workload):
            cap = job_cap(spec, config.elastic_cap_factor, config.gpus)
            table = load_throughput(spec.app)
            thr = (0.0,) + tuple(table.samples_per_s(n, spec.batch_size) * factor for n in range(1, cap + 1))
            self.jobs.append(_Job(key=key, spec=spec, work=work_samples(spec.app), cap=cap, thr=thr))
        self.queued: list[_Job] = []
        self.running: list[_Job] = []
        self.events: list[tuple[float, int, int, int, int]] = []
        self.payload: dict[int, FailureEvent] = {}
        self.seq = 0
        self.now = 0.0
        self.meter = EnergyMeter(power=power, carbon=carbon)
        self.gpu_s = 0.0
        self.max_in_use = 0
        self.usage: list[tuple[float, int]] = [(0.0, 0)]
        self.failures: list[FailureRecord] = []
        for job in self.jobs:
            self._push(job.spec.submit_s, _Kind.ARRIVAL, job.key)
        for i, event in enumerate(failures):
            self.payload[i] = event
            self._push(event.t_s, _Kind.FAILURE, i)
        self._push(HOUR_S, _Kind.TICK, 0)

    # -- the event loop --------------------------------------------------------------------------------------------

    def _push(self, t: float, kind: _Kind, ref: int, version: int = 0) -> None:
        """Simultaneous events in kind order: completions free GPUs before arrivals are placed."""
        heapq.heappush(self.events, (t, int(kind), self.seq, ref, version))
        self.seq += 1

    def run(self) -> SimResult:
        finished = 0
        while finished < len(self.jobs):
            t, kind, _, ref, version = heapq.heappop(self.events)
            if kind == _Kind.FINISH and version != self.jobs[ref].version:
                continue
            self._advance(t)
            if kind == _Kind.ARRIVAL:
                self.queued.append(self.jobs[ref])
                self._allocate()
            elif kind == _Kind.FINISH:
                self._finish(self.jobs[ref])
                finished += 1
                self._allocate()
            elif kind == _Kind.FAILURE:
                self._failure(self.payload.pop(ref))
            else:
                self._push(t + HOUR_S, _Kind.TICK, 0)
        return self._result()

    def _in_use(self) -> int:
        return sum(j.gpus for j in self.running)

    def _advance(self, t: float) -> None:
        """Energy, GPU-hours and every running job's progress (and periodic checkpoints) up to t."""
        if t > self.now:
            busy = sum(j.gpus * j.busy_s(self.now, t) for j in self.running)
            held = self._in_use() * (t - self.now)
            self.meter.add(self.now, busy, self.cfg.gpus * (t - self.now) - busy)
            self.gpu_s += held
        for job in self.running:
            while job.next_ckpt_s <= t:
                self._step(job, job.next_ckpt_s)
                job.ckpt_done = job.done
                job.next_ckpt_s += self.cfg.checkpoint_interval_s
            self._step(job, t)
        self.now = max(self.now, t)

    @staticmethod
    def _step(job: _Job, t: float) -> None:
        if t <= job.t:
            return
        gained = min(job.progress(job.t, t), job.work - job.done)
        job.done += gained
        job.processed += gained
        job.t = t
        keep = [seg for seg in job.plan if seg[0] <= t]
        job.plan = keep[-1:] + [seg for seg in job.plan if seg[0] > t]

    def _schedule_finish(self, job: _Job) -> None:
        job.version += 1
        end = job.finish_time()
        if math.isfinite(end):
            self._push(end, _Kind.FINISH, job.key, job.version)

    def _record_usage(self) -> None:
        in_use = self._in_use()
        if in_use > self.cfg.gpus:
            raise AssertionError(f"{self.arm.name}: {in_use} GPUs placed on a {self.cfg.gpus}-GPU cluster")
        self.max_in_use = max(self.max_in_use, in_use)
        self.usage.append((self.now, in_use))

    # -- allocation ------------------------------------------------------------------------------------------------

    def _allocate(self) -> None:
        free = self.cfg.gpus - self._in_use()
        decision = self.arm.policy.allocate(free, [j.view() for j in self.running], [j.view() for j in self.queued])
        if not decision:
            return
        shrunk = any(decision[j.key] < j.gpus for j in self.running if j.key in decision)
        for job in list(self.running) + list(self.queued):
            n = decision.get(job.key)
            if n is None or n == job.gpus:
                continue
            if n < 1:
                raise AssertionError(f"{self.arm.name}: policy gave job {job.spec.name} {n} GPUs")
            if job.gpus == 0:
                self._admit(job, n, wait=self.arm.launch_s + (self.arm.admit_wait_s if shrunk else 0.0))
            elif n > job.gpus:
                self._grow(job, n)
            else:
                self._shrink(job, n)
            self._schedule_finish(job)
        self._record_usage()

    def _admit(self, job: _Job, n: int, wait: float) -> None:
        self.queued.remove(job)
        self.running.append(job)
        self.running.sort(key=lambda j: j.key)
        job.gpus, job.t, job.start_s = n, self.now, self.now
        job.plan = [(self.now, 0.0), (self.now + wait, job.thr[n])]
        job.next_ckpt_s = self.now + wait + self.cfg.checkpoint_interval_s

    def _grow(self, job: _Job, n: int) -> None:
        """The new GPUs are placed now; the job keeps its old rate for the offer's hold, then pauses, then runs at n
        (a pause already under way is not cut short)."""
        start = job.stalled_until(self.now)
        old = job.thr[job.gpus]
        plan = [seg for seg in job.plan if seg[0] < start]
        hold = self.arm.grow_hold_s
        if hold > 0:
            plan.append((start, old))
        plan += [(start + hold, 0.0), (start + hold + self.arm.grow_pause_s, job.thr[n])]
        job.plan, job.gpus = plan, n
        job.rescales += 1

    def _shrink(self, job: _Job, n: int) -> None:
        """The GPUs given back leave now; the job stands still for the shrink (after any pause under way)."""
        resume = job.stalled_until(self.now) + self.arm.shrink_pause_s
        job.plan = [seg for seg in job.plan if seg[0] < self.now] + [(self.now, 0.0), (resume, job.thr[n])]
        job.gpus = n
        job.rescales += 1

    def _finish(self, job: _Job) -> None:
        job.done = job.work
        job.end_s = self.now
        job.gpus = 0
        job.plan = []
        self.running.remove(job)
        self._record_usage()

    # -- failures --------------------------------------------------------------------------------------------------

    def _victim(self, event: FailureEvent) -> _Job | None:
        index = int(event.gpu * self.cfg.gpus)
        for job in self.running:
            if index < job.gpus:
                return job
            index -= job.gpus
        return None

    def _failure(self, event: FailureEvent) -> None:
        job = self._victim(event)
        if job is None:
            self.failures.append(FailureRecord(self.now, event.notice, None, "idle", 0.0, 0.0, 0.0))
            return
        arm, rate = self.arm, job.thr[job.gpus]
        lost = 0.0
        if event.notice and arm.notice_aware:
            handling = "notice"
            pause = arm.notice_pause_s if job.gpus > 1 else arm.notice_single_pause_s
            if job.gpus == 1:
                job.ckpt_done = job.done
                job.next_ckpt_s = self.now + pause + self.cfg.checkpoint_interval_s
        elif arm.in_place_recovery and job.gpus > 1:
            handling, pause = "in_place", arm.in_place_pause_s
        else:
            handling, pause = "restart", arm.restart_pause_s
            lost = job.done - job.ckpt_done
            job.done = job.ckpt_done
            job.lost += lost
            job.next_ckpt_s = self.now + pause + self.cfg.checkpoint_interval_s
        resume = max(self.now + pause, job.stalled_until(self.now))
        job.plan = [seg for seg in job.plan if seg[0] < self.now] + [(self.now, 0.0), (resume, rate)]
        job.interruptions += 1
        self._schedule_finish(job)
        lost_gpu_h = lost / rate * job.gpus / HOUR_S if rate > 0 else 0.0
        self.failures.append(FailureRecord(self.now, event.notice, job.spec.name, handling, pause, lost_gpu_h,
                                           pause * job.gpus / HOUR_S))

    def _result(self) -> SimResult:
        records = [JobRecord(name=j.spec.name, app=j.spec.app, requested=j.spec.requested, submit_s=j.spec.submit_s,
                             start_s=j.start_s if j.start_s is not None else math.nan,
                             end_s=j.end_s if j.end_s is not None else math.nan, work=j.work, processed=j.processed,
                             lost=j.lost, rescales=j.rescales, interruptions=j.interruptions,
                             requested_run_s=j.work / j.thr[j.spec.requested]) for j in self.jobs]
        makespan = max(r.end_s for r in records)
        return SimResult(arm=self.arm.name, jobs=records, makespan_s=makespan, gpu_hours=self.gpu_s / HOUR_S,
                         energy_kwh=self.meter.kwh, kg_co2=self.meter.kg_co2, max_gpus_in_use=self.max_in_use,
                         failures=self.failures, usage=self.usage)


def simulate(workload: list[JobSpec], arm: ArmSpec, *, seed: int, config: SimConfig | None = None,
             failures: list[FailureEvent] | None = None, carbon: CarbonTrace | None = None,
             power: GpuPowerModel = T4) -> SimResult:
    """One arm on one workload. `seed` draws the failure events (unless `failures` gives them), so every arm run
    with the same seed and config meets the same events."""
    config = config or SimConfig()
    if failures is None:
        failures = event_stream(config.failure_source, gpus=config.gpus, horizon_s=config.failure_horizon_s,
                                rng=random.Random(seed), multiplier=config.failure_multiplier,
                                predictable=config.predictable)
    return _Sim(workload, arm, config, failures, carbon or carbon_trace(), power).run()
