"""Liveness beats: what a worker writes (step, phase, median step time), that its thread keeps beating while the
worker blocks (as in a collective) and stops with the process (SIGSTOP), and the phases a training run reports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import torch.distributed as dist

from harmonaize.job_runtime import NodeLiveness, NodePhase, liveness_path, read_model
from harmonaize.node_failures import NodeFailureReason
from provider_agents.hang_detector import HangBounds, HangDetector
from tests.support import ManualClock
from tests.workloads.harness import WIDE_RANGES, JobDirs
from workloads.examples.mlp import make_loss_fn, make_model
from workloads.liveness import LivenessBeacon
from workloads.spec import RunConfig
from workloads.trainer import TrainingRun

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def wait_until(probe: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.05) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_a_beat_carries_step_phase_and_the_median_step_time(tmp_path: Path) -> None:
    clock = ManualClock(50)
    beacon = LivenessBeacon(tmp_path, tenant="acme", job="train", epoch=4, local_rank=1, clock=clock)
    beacon.stepped(7)  # resumed at step 7
    for gap in (1.0, 3.0, 2.0):
        beacon.enter(NodePhase.STEP)
        clock.now += gap
        beacon.stepped(beacon.step + 1)
        beacon.enter(NodePhase.SCRIPT)
    beacon.beat()
    beacon.beat()
    written = read_model(liveness_path(tmp_path, 1), NodeLiveness)
    assert written == NodeLiveness(
        tenant="acme", job="train", epoch=4, local_rank=1, pid=os.getpid(), beats=2, step=10, phase=NodePhase.SCRIPT,
        transitions=6, step_time_s=2.0,
    )
    beacon.stop()
    assert not liveness_path(tmp_path, 1).exists(), "a worker that left on purpose leaves no silent file behind"


def test_without_a_control_dir_nothing_is_written_and_no_thread_starts(tmp_path: Path) -> None:
    beacon = LivenessBeacon(None, tenant="a", job="j", epoch=0, local_rank=0)
    beacon.start()
    beacon.beat()
    assert beacon.beats == 0 and beacon._thread is None
    beacon.stop()


BEATING_WORKER = textwrap.dedent(
    """
    import sys, threading
    from pathlib import Path
    from workloads.liveness import LivenessBeacon
    from harmonaize.job_runtime import NodePhase
    beacon = LivenessBeacon(Path(sys.argv[1]), tenant="acme", job="train", epoch=1, local_rank=0, interval_s=0.1)
    beacon.enter(NodePhase.AGREEMENT)
    beacon.start()
    print("beating", flush=True)
    threading.Event().wait()  # blocked like a worker in a collective whose peer never comes
    """
)


@pytest.fixture
def beating_worker(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", BEATING_WORKER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "beating"
        yield proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_a_blocked_worker_keeps_beating_and_a_stopped_one_is_found_frozen(
    tmp_path: Path, beating_worker: subprocess.Popen[str]
) -> None:
    """The detector on real beats: 2 s of a blocked worker (twice the bound) pass unjudged; SIGSTOP is declared."""
    path = liveness_path(tmp_path, 0)
    detector = HangDetector(HangBounds(frozen_floor_s=1.0))

    def observe() -> object:
        record = read_model(path, NodeLiveness)
        return detector.observe([record] if record is not None else [])

    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert observe() is None, "a worker blocked on a peer but beating was taken for hung"
        time.sleep(0.1)
    assert read_model(path, NodeLiveness).beats >= 10  # type: ignore[union-attr]

    os.kill(beating_worker.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    verdict: Any = wait_until(observe, timeout=10, what="the stopped worker declared frozen")
    assert (verdict.reason, verdict.phase) == (NodeFailureReason.FROZEN, NodePhase.AGREEMENT)
    assert 1.0 <= time.monotonic() - stopped < 5.0


@pytest.fixture
def single_process_group() -> Iterator[None]:
    store = dist.HashStore()  # type: ignore[attr-defined]  # torch.distributed re-exports it without listing it
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_training_run_beats_its_steps_and_phases_and_removes_its_file(
    single_process_group: None, tmp_path: Path
) -> None:
    job = JobDirs(tmp_path / "job")
    config = RunConfig(
        tenant="acme", job="train", epoch=2, checkpoint_dir=job.checkpoints, control_dir=job.control,
        ranges=WIDE_RANGES, has_spec=True,
    )
    run = TrainingRun(
        model_factory=make_model, optimizer_factory=lambda params: torch.optim.AdamW(params, lr=1e-3), batch_size=8,
        checkpoint_interval_steps=1000, max_steps=40, config=config, install_signal_handlers=False,
    )
    path = liveness_path(job.control, 0)
    loss_fn = make_loss_fn()

    def beat(step: int) -> NodeLiveness | None:
        """The first beat back in the script at `step` or later (the thread writes what the loop set meanwhile)."""
        record = read_model(path, NodeLiveness)
        return record if record is not None and record.step >= step and record.phase is NodePhase.SCRIPT else None

    with run:
        started = wait_until(lambda: beat(0), timeout=5, what="a beat after start")
        assert (started.epoch, started.pid, started.local_rank) == (2, os.getpid(), 0)
        for _ in range(3):
            run.train_step(loss_fn)
        stepped = wait_until(lambda: beat(3), timeout=5, what="a beat at step 3")
        assert stepped.step_time_s is not None
        assert stepped.transitions >= 2 * 3, "each step went through step, agreement and back to the script"
        while run.running:
            run.train_step(loss_fn)
    assert not path.exists(), "closed: the file is gone with the worker"
