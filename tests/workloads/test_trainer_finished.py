"""The trainer's final progress says whether the training run is over: the control plane's `finished` phase."""

from __future__ import annotations

from pathlib import Path

from tests.workloads.harness import JobDirs
from tests.workloads.test_trainer_in_process import make_run, single_process_group, train_to_end
from workloads.examples.mlp import make_loss_fn

__all__ = ["single_process_group"]  # the autouse fixture, active here too


def test_a_run_that_reaches_its_last_step_reports_finished(tmp_path: Path) -> None:
    job = JobDirs(tmp_path)
    train_to_end(make_run(job, max_steps=3))
    progress = job.progress()
    assert progress is not None and progress.step == 3 and progress.finished


def test_a_run_stopped_on_request_is_not_finished(tmp_path: Path) -> None:
    job = JobDirs(tmp_path)
    run = make_run(job, max_steps=None)
    loss_fn = make_loss_fn()
    with run:
        while run.running:
            run.train_step(loss_fn)
            if run.step == 2:
                run.request_stop()
            progress = job.progress()
            assert progress is not None and not progress.finished, "not while it runs"
    progress = job.progress()
    assert progress is not None and progress.step == 3 and not progress.finished
