"""The provider's micro loop decides from telemetry, only inside the tenant's ranges (pure decisions, no processes)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from harmonaize.desired_state import AssignedJob, HostAssignment
from harmonaize.events import MaintenanceKind, MaintenanceStatus
from harmonaize.job_runtime import Directives, JobRanges, violations
from harmonaize.jobs import Compression, ParallelPlan
from harmonaize.ranges import IntRange
from provider_agents.micro_loop import JobSignals, decide, job_signals
from provider_agents.telemetry.model import (
    FabricSample,
    FailureSignal,
    HostTelemetry,
    LinkCongestion,
    MaintenanceNotice,
    RawFailureKind,
)
from workloads.directives import plan_violations

NOW = datetime(2026, 11, 30, 12, tzinfo=UTC)
RANGES = JobRanges(
    checkpoint_interval_steps=IntRange(min=5, max=200),
    compression_allowed=(Compression.NONE, Compression.FP16, Compression.POWERSGD),
    powersgd_max_rank=8,
)


def _job(ranges: JobRanges = RANGES, plan: ParallelPlan = ParallelPlan.DDP) -> AssignedJob:
    return AssignedJob(tenant="acme", job="train", workers=1, gpus=1, entrypoint=("-m", "x"), epoch=1, nodes=2,
                       ranges=ranges, parallel_plan=plan)


def _fleet(job: AssignedJob) -> dict[str, HostAssignment]:
    return {
        "h1": HostAssignment(host="h1", locality_group="g1", generation=1, jobs=(job,), updated_at=NOW),
        "h3": HostAssignment(host="h3", locality_group="g2", generation=1, jobs=(job,), updated_at=NOW),
        "h4": HostAssignment(host="h4", locality_group="g2", generation=1, jobs=(), updated_at=NOW),
    }


def _telemetry(host: str, group: str, **parts: Any) -> HostTelemetry:
    return HostTelemetry(host=host, locality_group=group, sampled_at=NOW,
                         fabric=FabricSample(intra_group_gbps=400, inter_group_gbps=100), **parts)


def test_a_predicted_failure_asks_for_one_checkpoint_and_the_tightest_interval() -> None:
    job = _job()
    predicted = FailureSignal(kind=RawFailureKind.PREDICTED_FAILURE, detected_at=NOW, eta=NOW + timedelta(minutes=2),
                              confidence=0.9, gpu_index=0)
    signals = job_signals(job, _fleet(job), {"h1": _telemetry("h1", "g1", failures=(predicted,))})
    first = decide(job, signals, known_risks=frozenset())
    assert first.checkpoint_now and first.checkpoint_interval_steps == 5
    again = decide(job, signals, known_risks=signals.risks)
    assert not again.checkpoint_now and again.checkpoint_interval_steps == 5, "once per episode"
    cleared = decide(job, JobSignals(risks=frozenset(), slowdown=1.0), known_risks=signals.risks)
    assert (cleared.checkpoint_now, cleared.checkpoint_interval_steps, cleared.compression) == (False, None, None)


def test_maintenance_on_a_host_of_the_job_counts_and_on_another_host_does_not() -> None:
    job = _job()
    notice = MaintenanceNotice(notice_id="chg-1", kind=MaintenanceKind.REBOOT, status=MaintenanceStatus.SCHEDULED,
                               not_before=NOW + timedelta(minutes=5), not_after=NOW + timedelta(minutes=10))
    on_job = job_signals(job, _fleet(job), {"h3": _telemetry("h3", "g2", maintenance=(notice,))})
    elsewhere = job_signals(job, _fleet(job), {"h4": _telemetry("h4", "g2", maintenance=(notice,))})
    assert on_job.risks and not elsewhere.risks


def test_congestion_on_the_jobs_paths_compresses_more_as_it_worsens_and_relaxes_when_it_clears() -> None:
    job = _job()

    def link(groups: tuple[str, ...], slowdown: float) -> LinkCongestion:
        return LinkCongestion(link="spine-1", groups=groups, utilization=0.9, slowdown=slowdown, since=NOW)

    moderate = job_signals(job, _fleet(job), {"h1": _telemetry("h1", "g1", links=(link(("g1", "g2"), 1.5),))})
    heavy = job_signals(job, _fleet(job), {"h1": _telemetry("h1", "g1", links=(link(("g1", "g2"), 3.0),))})
    inside_one_host_group = job_signals(job, _fleet(job), {"h1": _telemetry("h1", "g1", links=(link(("g1",), 3.0),))})
    assert decide(job, moderate, known_risks=frozenset()).compression is Compression.FP16
    strong = decide(job, heavy, known_risks=frozenset())
    assert (strong.compression, strong.powersgd_rank) == (Compression.POWERSGD, 2)
    assert inside_one_host_group.slowdown == 1.0, "a link inside g1 carries none of this job's traffic (one host there)"
    assert decide(job, JobSignals(frozenset(), 1.0), known_risks=frozenset()).compression is None


def test_decisions_never_leave_the_tenants_ranges() -> None:
    narrow = JobRanges(checkpoint_interval_steps=IntRange(min=50, max=50), compression_allowed=(Compression.NONE,))
    job = _job(narrow)
    for risks in (frozenset(), frozenset({"predicted:h1"})):
        for slowdown in (1.0, 1.3, 2.5, 10.0):
            proposal = decide(job, JobSignals(risks, slowdown), known_risks=frozenset())
            directives = Directives(
                checkpoint_interval_steps=proposal.checkpoint_interval_steps,
                compression=proposal.compression,
                powersgd_rank=proposal.powersgd_rank,
            )
            assert violations(narrow, directives) == [], (risks, slowdown, proposal)


def test_compression_is_proposed_only_to_a_plan_that_can_apply_it() -> None:
    """FSDP and HSDP reduce gradients themselves: a compression directive would only be refused by the job."""
    for plan in (ParallelPlan.FSDP, ParallelPlan.HSDP):
        proposal = decide(_job(plan=plan), JobSignals(frozenset(), 3.0), known_risks=frozenset())
        assert proposal.compression is None and proposal.powersgd_rank is None, (plan, proposal)
        assert plan_violations(plan, Directives(compression=proposal.compression)) == []
    risky = decide(_job(plan=ParallelPlan.HSDP), JobSignals(frozenset({"predicted:h1"}), 3.0), known_risks=frozenset())
    assert risky.checkpoint_now and risky.checkpoint_interval_steps == 5, "checkpoints do not depend on the plan"
