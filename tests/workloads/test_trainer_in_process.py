"""`TrainingRun` in this process at world size 1 (gloo over an in-memory store): the trainer's logic, fast.

The process-level tests prove the distributed parts; these pin the bookkeeping: a resumed run continues exactly as
an unbroken one (deterministic data, optimizer state in the checkpoint), directives are applied at a step boundary
and survive a restart, a checkpoint request is honoured once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harmonaize.job_runtime import Directives, DirectiveState
from harmonaize.jobs import Compression, ParallelPlan
from tests.workloads.harness import WIDE_RANGES, JobDirs
from workloads.examples.mlp import make_loss_fn, make_model
from workloads.spec import RunConfig
from workloads.trainer import TrainingRun


@pytest.fixture(autouse=True)
def single_process_group() -> Iterator[None]:
    store = dist.HashStore()  # type: ignore[attr-defined]  # torch.distributed re-exports it without listing it
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_run(job: JobDirs, *, max_steps: int | None, spec: bool = True, **options: object) -> TrainingRun:
    config = RunConfig(
        tenant="acme",
        job="train-1",
        checkpoint_dir=job.checkpoints,
        control_dir=job.control,
        ranges=WIDE_RANGES,
        has_spec=spec,
        parallel_plan=ParallelPlan.DDP,
    )
    return TrainingRun(
        model_factory=make_model,
        optimizer_factory=lambda params: torch.optim.AdamW(params, lr=3e-3),
        batch_size=32,
        checkpoint_interval_steps=1000,
        max_steps=max_steps,
        config=config,
        install_signal_handlers=False,
        **options,  # type: ignore[arg-type]
    )


def train_to_end(run: TrainingRun) -> dict[str, torch.Tensor]:
    loss_fn = make_loss_fn()
    with run:
        while run.running:
            run.train_step(loss_fn)
        return {name: value.detach().clone() for name, value in run.module.state_dict().items()}


def test_a_resumed_run_ends_bitwise_where_an_unbroken_one_does(tmp_path: Path) -> None:
    unbroken = train_to_end(make_run(JobDirs(tmp_path / "a"), max_steps=12))
    job = JobDirs(tmp_path / "b")
    train_to_end(make_run(job, max_steps=5))
    assert job.checkpoint_steps() == [5]
    resumed_run = make_run(job, max_steps=12)
    resumed = train_to_end(resumed_run)
    assert resumed_run.resumed_from_step == 5 and resumed_run.step == 12
    assert unbroken.keys() == resumed.keys()
    assert all(torch.equal(unbroken[name], resumed[name]) for name in unbroken)


def test_request_stop_checkpoints_at_the_agreed_step(tmp_path: Path) -> None:
    job = JobDirs(tmp_path)
    run = make_run(job, max_steps=None)
    loss_fn = make_loss_fn()
    with run:
        while run.running:
            run.train_step(loss_fn)
            if run.step == 7:
                run.request_stop()
    assert run.step == 8, "the stop is agreed at the boundary after the step it was requested in"
    assert job.checkpoint_steps() == [8]
    progress = job.progress()
    assert progress is not None and progress.step == 8 and progress.last_checkpoint_step == 8


def test_directives_apply_at_a_boundary_and_survive_a_restart(tmp_path: Path) -> None:
    job = JobDirs(tmp_path)
    loss_fn = make_loss_fn()
    run = make_run(job, max_steps=None)
    with run:
        run.train_step(loss_fn)
        job.direct(Directives(version=1, compression=Compression.FP16, batch_size=16, gradient_accumulation=2,
                              checkpoint_requests=1))
        run.train_step(loss_fn)
        assert (run.batch_size, run.gradient_accumulation, run.settings.compression) == (16, 2, Compression.FP16)
        assert job.checkpoint_steps() == [2], "checkpoint now = at this step boundary"
        job.direct(Directives(version=2, batch_size=4096, checkpoint_requests=2))
        run.train_step(loss_fn)
        assert run.batch_size == 16, "a refused version changes nothing"
        run.train_step(loss_fn)
        assert job.checkpoint_steps() == [2], "the refused version's checkpoint request is not honoured"
        run.request_stop()
        run.train_step(loss_fn)
    progress = job.progress()
    assert progress is not None
    assert [(o.version, o.status, o.step) for o in progress.outcomes] == [
        (1, DirectiveState.APPLIED, 2),
        (2, DirectiveState.REFUSED, 3),
    ]
    assert "batch_size 4096" in progress.outcomes[1].reasons[0]
    assert (progress.batch_size, progress.gradient_accumulation, progress.compression) == (16, 2, Compression.FP16)

    restarted = make_run(job, max_steps=7)
    with restarted:
        assert restarted.resumed_from_step == 5
        assert (restarted.batch_size, restarted.gradient_accumulation) == (16, 2)
        assert restarted.settings.compression is Compression.FP16
        while restarted.running:
            restarted.train_step(loss_fn)
    progress = job.progress()
    assert progress is not None and len(progress.outcomes) == 2, "nothing is re-handled after a restart"
    assert progress.directives_version == 2
    assert job.checkpoint_steps() == [2, 5, 7]


def test_without_a_spec_the_interval_is_the_scripts_own(tmp_path: Path) -> None:
    run = make_run(JobDirs(tmp_path), max_steps=None, spec=False)
    assert run.settings.checkpoint_interval_steps == 1000
    clamped = TrainingRun(
        model_factory=nn.Identity,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        batch_size=1,
        checkpoint_interval_steps=1,
        config=RunConfig(checkpoint_dir=tmp_path, ranges=WIDE_RANGES, has_spec=True),
        install_signal_handlers=False,
    )
    assert clamped.settings.checkpoint_interval_steps == WIDE_RANGES.checkpoint_interval_steps.min
