"""The provider's micro-level loop: real-time infrastructure state becomes directives, inside the tenant's ranges.

The paper's split: the tenant's macro loop decides *what* the job should be (size, plan, when to run), slowly and
through negotiation; the provider's micro loop decides fast, alone, and only within ranges the tenant declared.
This loop reads every host's raw telemetry (provider-internal), maps it to the jobs placed there, and for each job
proposes the settings it should run with now:

| observed on the job's hosts                        | directive                                                    |
|----------------------------------------------------|--------------------------------------------------------------|
| a new predicted failure or maintenance notice      | checkpoint now, once per episode                             |
| any predicted failure or maintenance still pending | checkpoint every `checkpoint_interval_steps.min` steps       |
| congestion on the job's paths, slowdown >= 1.2     | fp16 compression (if fp16 is not allowed: PowerSGD at the    |
|                                                    | tenant's max rank)                                           |
| slowdown >= 2                                      | PowerSGD at a quarter of the max rank (stronger), else fp16  |
| none of that                                       | the job's own settings (every field None)                    |

Compression exists only as DDP communication hooks, so it is proposed only to a job whose desired plan is DDP: a job
repartitioned to FSDP or HSDP (the tenant's answer to the same congestion) would have to refuse it.

`decide` is a pure function of the job, its signals and what it already knew, so tests script telemetry and check
decisions without processes. The runner proposes through the control plane, which checks the ranges again, stores
every version and tells the tenant; an unchanged proposal is not even sent (and would be a no-op if it were).
Why central rather than in each host agent: a job spans hosts, and its compression must follow the worst of its
paths, which no single host sees.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

from nats.aio.client import Client
from nats.aio.msg import Msg
from pydantic import ValidationError

from harmonaize.desired_state import AssignedJob, HostAssignment
from harmonaize.events import MaintenanceStatus
from harmonaize.jobs import Compression, ParallelPlan
from harmonaize.subjects import ANY, provider_filter
from harmonaize.waits import wait_set
from provider_agents.clock import Clock, SystemClock
from provider_agents.control_plane import ControlPlane, ControlPlaneRefusal
from provider_agents.desired import DesiredState
from provider_agents.telemetry.model import HostTelemetry, RawFailureKind

__all__ = ["TELEMETRY_FILTER", "JobSignals", "MicroLoop", "Proposal", "decide", "job_signals"]

log = logging.getLogger(__name__)

TELEMETRY_FILTER = provider_filter("telemetry", ANY)
MODERATE_SLOWDOWN = 1.2
HEAVY_SLOWDOWN = 2.0
STALE_TELEMETRY_S = 10.0


@dataclass(frozen=True)
class JobSignals:
    risks: frozenset[str]
    """Pending predicted failures and maintenance notices on the job's hosts (provider-internal keys)."""
    slowdown: float
    """The worst expected slowdown on the job's communication paths (1.0: none)."""


@dataclass(frozen=True)
class Proposal:
    checkpoint_now: bool = False
    checkpoint_interval_steps: int | None = None
    compression: Compression | None = None
    powersgd_rank: int | None = None
    reason: str = ""

    def settings(self) -> tuple[object, ...]:
        return (self.checkpoint_interval_steps, self.compression, self.powersgd_rank)

    def body(self) -> dict[str, object]:
        return {**asdict(self), "compression": None if self.compression is None else self.compression.value}


def job_signals(
    job: AssignedJob, fleet: Mapping[str, HostAssignment], telemetry: Mapping[str, HostTelemetry]
) -> JobSignals:
    """What the telemetry of the job's hosts says about the job."""
    hosts = [
        host
        for host, assignment in fleet.items()
        if any(j.tenant == job.tenant and j.job == job.job for j in assignment.jobs)
    ]
    hosts_per_group = Counter(fleet[host].locality_group for host in hosts)
    risks: set[str] = set()
    slowdown = 1.0
    for host in hosts:
        sample = telemetry.get(host)
        if sample is None:
            continue
        for failure in sample.failures:
            if failure.kind is RawFailureKind.PREDICTED_FAILURE:
                component = failure.component or failure.gpu_index
                risks.add(f"predicted:{host}:{component}:{failure.detected_at.isoformat()}")
        for notice in sample.maintenance:
            if notice.status in (MaintenanceStatus.SCHEDULED, MaintenanceStatus.STARTED):
                risks.add(f"maintenance:{host}:{notice.notice_id}")
        for link in sample.links:
            if _on_paths(link.groups, hosts_per_group):
                slowdown = max(slowdown, link.slowdown)
    return JobSignals(risks=frozenset(risks), slowdown=slowdown)


def _on_paths(link_groups: Iterable[str], hosts_per_group: Counter[str]) -> bool:
    """A link between two of the job's groups, or inside a group where the job has two hosts or more, carries the
    job's traffic (the same rule as the tenant's congestion events, `projection._on_job_path`)."""
    link = list(link_groups)
    if len(link) == 1:
        return hosts_per_group[link[0]] >= 2
    return all(hosts_per_group[group] >= 1 for group in link)


def decide(job: AssignedJob, signals: JobSignals, *, known_risks: frozenset[str]) -> Proposal:
    """The settings the job should run with now (see the module table)."""
    ranges = job.ranges
    reasons: list[str] = []
    checkpoint_now = bool(signals.risks - known_risks)
    interval = None
    if signals.risks:
        interval = ranges.checkpoint_interval_steps.min
        reasons.append("a failure is predicted or maintenance is scheduled on one of the job's hosts")
    compression, rank = None, None
    allowed = set(ranges.compression_allowed) if job.parallel_plan is ParallelPlan.DDP else set()
    max_rank = ranges.powersgd_max_rank
    powersgd = Compression.POWERSGD in allowed and max_rank is not None
    if signals.slowdown >= HEAVY_SLOWDOWN:
        if powersgd:
            compression, rank = Compression.POWERSGD, max(1, max_rank // 4)  # type: ignore[operator]
        elif Compression.FP16 in allowed:
            compression = Compression.FP16
    elif signals.slowdown >= MODERATE_SLOWDOWN:
        if Compression.FP16 in allowed:
            compression = Compression.FP16
        elif powersgd:
            compression, rank = Compression.POWERSGD, max_rank
    if compression is not None:
        reasons.append(f"congestion on the job's paths (expected slowdown x{signals.slowdown:.1f})")
    return Proposal(
        checkpoint_now=checkpoint_now,
        checkpoint_interval_steps=interval,
        compression=compression,
        powersgd_rank=rank,
        reason="; ".join(reasons) or "conditions normal: the job's own settings",
    )


class MicroLoop:
    """Keeps the latest telemetry of every host and proposes each running job's settings every `interval_s`."""

    def __init__(
        self,
        *,
        desired: DesiredState,
        control_plane: ControlPlane,
        clock: Clock | None = None,
        interval_s: float = 0.5,
    ) -> None:
        self._desired = desired
        self._control = control_plane
        self._clock: Clock = clock or SystemClock()
        self._interval_s = interval_s
        self._telemetry: dict[str, tuple[float, HostTelemetry]] = {}
        self._known_risks: dict[tuple[str, str], frozenset[str]] = {}
        self._sent: dict[tuple[str, str], tuple[object, ...]] = {}
        self._stop = asyncio.Event()
        self.proposals = 0
        self.refusals = 0

    def observe(self, sample: HostTelemetry) -> None:
        self._telemetry[sample.host] = (self._clock.monotonic(), sample)

    async def tick(self) -> list[tuple[str, str, Proposal]]:
        """One pass over every running job; returns the proposals sent."""
        fleet = self._desired.snapshot()
        if fleet is None:
            return []
        now = self._clock.monotonic()
        fresh = {host: sample for host, (seen, sample) in self._telemetry.items() if now - seen <= STALE_TELEMETRY_S}
        jobs = {
            (job.tenant, job.job): job for assignment in fleet.values() for job in assignment.jobs if job.entrypoint
        }
        sent = []
        for key, job in sorted(jobs.items()):
            signals = job_signals(job, fleet, fresh)
            proposal = decide(job, signals, known_risks=self._known_risks.get(key, frozenset()))
            if not proposal.checkpoint_now and self._sent.get(key) == proposal.settings():
                self._known_risks[key] = signals.risks
                continue
            try:
                await self._control.propose_directives(job.tenant, job.job, proposal.body())
            except ControlPlaneRefusal as exc:
                self.refusals += 1
                log.warning("micro loop: %s/%s: %s", job.tenant, job.job, exc.reason)
            self.proposals += 1
            self._sent[key] = proposal.settings()
            self._known_risks[key] = signals.risks
            sent.append((job.tenant, job.job, proposal))
        for key in set(self._sent) - set(jobs):
            self._sent.pop(key, None)
            self._known_risks.pop(key, None)
        return sent

    async def run(self, nc: Client) -> None:
        subscription = await nc.subscribe(TELEMETRY_FILTER, cb=self._on_telemetry)
        try:
            while not self._stop.is_set():
                try:
                    await self.tick()
                except Exception as exc:  # the control plane may be briefly unreachable; the next tick retries
                    log.warning("micro loop tick failed: %r", exc)
                await wait_set(self._stop, self._interval_s)
        finally:
            await subscription.unsubscribe()

    def stop(self) -> None:
        self._stop.set()

    async def _on_telemetry(self, msg: Msg) -> None:
        try:
            self.observe(HostTelemetry.model_validate_json(msg.data))
        except ValidationError:
            log.warning("ignoring malformed telemetry on %s", msg.subject)
