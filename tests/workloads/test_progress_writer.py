"""The progress writer's throttle and content, and the throughput meter, without processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harmonaize.job_runtime import (
    CONTROL_PROGRESS_FILE,
    MAX_OUTCOMES,
    DirectiveOutcome,
    DirectiveState,
    JobProgress,
    read_model,
)
from harmonaize.jobs import Compression, ParallelPlan
from tests.support import ManualClock
from workloads.progress import MIN_INTERVAL_S, ProgressReporter, ThroughputMeter


def fields(step: int) -> dict[str, Any]:
    return dict(
        step=step, world_size=2, parallel_plan=ParallelPlan.DDP, loss=0.5, samples_per_s=None, resumed_from_step=None,
        last_checkpoint_step=None, checkpoint_interval_steps=100, compression=Compression.NONE, powersgd_rank=None,
        batch_size=32, gradient_accumulation=1, directives_version=0,
    )


def test_writes_are_throttled_unless_forced(tmp_path: Path) -> None:
    clock = ManualClock()
    reporter = ProgressReporter(tmp_path, tenant="acme", job="j", epoch=1, enabled=True, clock=clock)
    assert reporter.report(force=False, **fields(1))
    clock.now += MIN_INTERVAL_S / 2
    assert not reporter.report(force=False, **fields(2))
    assert reporter.report(force=True, **fields(3))
    clock.now += MIN_INTERVAL_S
    assert reporter.report(force=False, **fields(4))
    progress = read_model(tmp_path / CONTROL_PROGRESS_FILE, JobProgress)
    assert progress is not None and progress.step == 4 and progress.tenant == "acme" and reporter.writes == 3


def test_disabled_or_without_a_control_dir_nothing_is_written(tmp_path: Path) -> None:
    assert not ProgressReporter(None, tenant="a", job="j", epoch=0, enabled=True).report(force=True, **fields(1))
    assert not ProgressReporter(tmp_path, tenant="a", job="j", epoch=0, enabled=False).report(force=True, **fields(1))
    assert list(tmp_path.iterdir()) == []


def test_outcomes_keep_the_last_twenty(tmp_path: Path) -> None:
    reporter = ProgressReporter(tmp_path, tenant="a", job="j", epoch=0, enabled=True)
    for version in range(MAX_OUTCOMES + 5):
        reporter.record_outcome(DirectiveOutcome(version=version, status=DirectiveState.APPLIED, step=version))
    reporter.report(force=True, **fields(1))
    progress = read_model(tmp_path / CONTROL_PROGRESS_FILE, JobProgress)
    assert progress is not None and [o.version for o in progress.outcomes] == list(range(5, MAX_OUTCOMES + 5))


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), -float("inf"), 1e31])
def test_a_diverged_loss_is_reported_as_unknown(tmp_path: Path, loss: float) -> None:
    reporter = ProgressReporter(tmp_path, tenant="a", job="j", epoch=0, enabled=True)
    reporter.report(force=True, **{**fields(1), "loss": loss})
    progress = read_model(tmp_path / CONTROL_PROGRESS_FILE, JobProgress)
    assert progress is not None and progress.loss is None


def test_throughput_over_recent_steps() -> None:
    clock = ManualClock()
    meter = ThroughputMeter(window=4, clock=clock)
    assert meter.samples_per_s() is None
    for _ in range(10):
        clock.now += 0.5
        meter.record(64)
    assert meter.samples_per_s() == 128.0
