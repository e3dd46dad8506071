"""Elastic in place on real torchrun nodes over gloo, with the test playing the provider.

The test hosts the job's store (as the provider's rendezvous host does) and writes each node's `membership.json`
(as its launcher does); every node is a single-node torchrun with its own control directory, like one host. What
must hold across every change: the surviving workers' pids stay the same, the step never goes back more than one,
the loss keeps falling, every rank's parameters agree after the change, and a joiner's equal the survivors' bitwise.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harmonaize.job_runtime import (
    CONTROL_DIRECTIVES_FILE,
    CONTROL_MEMBERSHIP_FILE,
    CONTROL_PROGRESS_FILE,
    Directives,
    EpochChange,
    JobProgress,
    JobRanges,
    Membership,
    NodeLiveness,
    WorkerSpec,
    liveness_path,
    read_model,
    write_model_atomically,
)
from harmonaize.jobs import Compression
from tests.workloads.harness import WIDE_RANGES, Cluster, Node, wait_for

pytestmark = pytest.mark.timeout(240)

MLP_ARGS = ("--step-delay-ms", "20", "--log-every", "1", "--checkpoint-interval", "1000")


@dataclass
class Host:
    name: str
    control: Path
    node: Node


@dataclass
class InPlaceJob:
    """One in-place job: the store, and one single-worker node per host."""

    root: Path
    cluster: Cluster
    store: Any
    hosts: dict[str, Host] = field(default_factory=dict)
    epoch: int = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.store.port}"

    def start(self, name: str, *, args: tuple[str, ...] = MLP_ARGS, ranges: JobRanges = WIDE_RANGES) -> Host:
        control = self.root / "hosts" / name
        spec_path = control / f"spec-e{self.epoch}.json"
        write_model_atomically(
            spec_path,
            WorkerSpec(
                tenant="acme", job="train-1", epoch=self.epoch, checkpoint_dir=self.root / "checkpoints",
                control_dir=control, ranges=ranges, store_endpoint=self.endpoint,
            ),
        )
        node = self.cluster.start(
            "workloads.examples.mlp", nproc=1, args=args, spec=spec_path, dump_dir=self.root / "dumps"
        )
        host = Host(name, control, node)
        self.hosts[name] = host
        return host

    def announce(self, members: list[str], *, leaving: tuple[str, ...] = (), urgent: bool = False,
                 reason: str = "") -> int:
        """A new epoch of `members` (nodes of 1 worker): joiners' files first, as launchers start them first."""
        self.epoch += 1
        for name in [*leaving, *members]:
            write_model_atomically(
                self.hosts[name].control / CONTROL_MEMBERSHIP_FILE,
                Membership(epoch=self.epoch, nodes=len(members), workers=1, member=name in members,
                           urgent=urgent, reason=reason),
            )
        return self.epoch

    def progress(self) -> JobProgress | None:
        found = [read_model(h.control / CONTROL_PROGRESS_FILE, JobProgress) for h in self.hosts.values()]
        return max((p for p in found if p is not None), key=lambda p: p.updated_at, default=None)

    def running(self, *, world: int, epoch: int, steps_after: int = 3, timeout: float = 60) -> JobProgress:
        def at_size() -> JobProgress | None:
            p = self.progress()
            return p if p is not None and p.world_size == world and p.epoch == epoch else None

        first = wait_for(at_size, timeout=timeout, what=f"world {world} in epoch {epoch}")

        def stepped() -> JobProgress | None:
            p = at_size()
            return p if p is not None and p.step >= first.step + steps_after else None

        return wait_for(stepped, timeout=timeout, what=f"{steps_after} steps in epoch {epoch}")

    def worker_pid(self, name: str) -> int:
        beat = wait_for(
            lambda: read_model(liveness_path(self.hosts[name].control, 0), NodeLiveness),
            timeout=60, what=f"{name}'s worker beating",
        )
        return beat.pid

    def replicas(self, epoch: int, world: int) -> list[dict[str, torch.Tensor]]:
        paths = [self.root / "dumps" / f"inplace-e{epoch}-rank{rank}.pt" for rank in range(world)]
        wait_for(lambda: all(p.exists() for p in paths), timeout=30, what=f"every rank's replica of epoch {epoch}")
        return [torch.load(p, weights_only=True) for p in paths]


@pytest.fixture
def in_place(tmp_path: Path, cluster: Cluster) -> InPlaceJob:
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    return InPlaceJob(tmp_path, cluster, store)


def _assert_replicas_agree(replicas: list[dict[str, torch.Tensor]], *, exact: bool) -> None:
    first = replicas[0]
    for other in replicas[1:]:
        assert first.keys() == other.keys()
        for name, tensor in first.items():
            if exact:
                assert torch.equal(tensor, other[name]), name
            else:
                torch.testing.assert_close(tensor, other[name], msg=name)


def _losses(job: InPlaceJob) -> dict[int, float]:
    """step -> loss, from every node's log (rank 0 logs; rank 0 may move between nodes)."""
    steps: dict[int, float] = {}
    for host in job.hosts.values():
        steps.update(dict(host.node.losses()))
    return steps


def test_scale_up_and_down_keep_the_processes(in_place: InPlaceJob) -> None:
    job = in_place
    job.start("h1")
    job.start("h2")
    first = job.announce(["h1", "h2"])
    before = job.running(world=2, epoch=first, steps_after=10)
    pids = {name: job.worker_pid(name) for name in ("h1", "h2")}

    job.start("h3")
    grown = job.announce(["h1", "h2", "h3"], reason="scale 2 -> 3")
    bigger = job.running(world=3, epoch=grown)
    assert bigger.resumed_from_step is None, "no checkpoint was loaded: the state came from a live peer"
    assert bigger.step > before.step
    _assert_replicas_agree(job.replicas(grown, 3), exact=True)
    assert {name: job.worker_pid(name) for name in ("h1", "h2")} == pids

    shrunk = job.announce(["h1", "h3"], leaving=("h2",), reason="scale 3 -> 2")
    smaller = job.running(world=2, epoch=shrunk)
    assert job.hosts["h2"].node.wait(timeout=30) == 0, "the leaving node exits cleanly"
    _assert_replicas_agree(job.replicas(shrunk, 2), exact=True)
    assert job.worker_pid("h1") == pids["h1"]
    losses = _losses(job)
    steps = sorted(losses)
    assert steps == list(range(steps[0], steps[-1] + 1)), "every step was logged once, none went back"
    assert smaller.loss is not None and losses[steps[0]] > smaller.loss


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_survivors_go_on_after_a_peer_fails(in_place: InPlaceJob, fault: str) -> None:
    job = in_place
    for name in ("h1", "h2", "h3"):
        job.start(name)
    first = job.announce(["h1", "h2", "h3"])
    before = job.running(world=3, epoch=first, steps_after=10)
    pids = {name: job.worker_pid(name) for name in ("h1", "h2")}
    victim = job.worker_pid("h3")

    os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    try:
        after_epoch = job.announce(["h1", "h2"], urgent=True, reason=f"h3 {fault}")
        after = job.running(world=2, epoch=after_epoch, steps_after=5, timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    assert after.resumed_from_step is None
    assert {name: job.worker_pid(name) for name in ("h1", "h2")} == pids
    _assert_replicas_agree(job.replicas(after_epoch, 2), exact=True)
    losses = _losses(job)
    assert max(losses) > before.step
    assert after.loss is not None and before.loss is not None and after.loss < before.loss * 1.5


def test_with_no_survivor_the_job_resumes_from_its_checkpoint(in_place: InPlaceJob) -> None:
    """The fallback: every worker of the job is gone, so nobody holds the state in memory; the next epoch's workers
    load the latest checkpoint, and say so."""
    job = in_place
    args = (*MLP_ARGS[:-1], "10")  # a checkpoint every 10 steps
    for name in ("h1", "h2"):
        job.start(name, args=args)
    first = job.announce(["h1", "h2"])
    job.running(world=2, epoch=first, steps_after=25)
    for name in ("h1", "h2"):
        os.kill(job.worker_pid(name), signal.SIGKILL)
        job.hosts[name].node.wait(timeout=30)
    saved = max(int(p.name.split("-")[1]) for p in (job.root / "checkpoints").glob("step-*") if "." not in p.name)

    job.epoch += 1
    job.start("h3", args=args)
    job.start("h4", args=args)
    again = job.announce(["h3", "h4"])
    resumed = job.running(world=2, epoch=again)
    assert resumed.resumed_from_step == saved and resumed.change == EpochChange.CHECKPOINT
    assert resumed.epoch_step == saved
    assert resumed.pause_s is not None and resumed.pause_s > 0, "from the checkpoint's save to the restart"


def test_a_frozen_peer_cannot_hold_a_powersgd_step(in_place: InPlaceJob) -> None:
    """PowerSGD (rank 2, the provider's directive) runs through the group's abortable all-reduces, not DDP's hook:
    a peer frozen mid-step releases the survivors as soon as the urgent membership comes, and their replicas still
    agree bitwise (the compressed mean is computed alike on every rank)."""
    job = in_place
    for name in ("h1", "h2", "h3"):
        job.start(name)
    first = job.announce(["h1", "h2", "h3"])
    job.running(world=3, epoch=first, steps_after=5)
    directive = Directives(version=1, compression=Compression.POWERSGD, powersgd_rank=2, reason="congestion")
    for host in job.hosts.values():
        write_model_atomically(host.control / CONTROL_DIRECTIVES_FILE, directive)

    def compressed() -> JobProgress | None:
        p = job.progress()
        return p if p is not None and p.compression is Compression.POWERSGD and p.powersgd_rank == 2 else None

    applied = wait_for(compressed, timeout=60, what="PowerSGD applied")
    before = job.running(world=3, epoch=first, steps_after=5)
    assert before.step > applied.step
    pids = {name: job.worker_pid(name) for name in ("h1", "h2")}
    victim = job.worker_pid("h3")
    os.kill(victim, signal.SIGSTOP)
    try:
        after_epoch = job.announce(["h1", "h2"], urgent=True, reason="h3 frozen")
        after = job.running(world=2, epoch=after_epoch, steps_after=5, timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    assert after.compression is Compression.POWERSGD and after.resumed_from_step is None
    assert {name: job.worker_pid(name) for name in ("h1", "h2")} == pids
    _assert_replicas_agree(job.replicas(after_epoch, 2), exact=True)
    assert after.loss is not None and before.loss is not None and after.loss < before.loss * 1.5


def test_a_frozen_peer_cannot_hold_a_checkpoint_save(in_place: InPlaceJob) -> None:
    """In place every rank holds the whole state, so rank 0 alone saves it, with no collective: a peer frozen while
    the job checkpoints every step cannot hold the others in DCP's collectives (which nothing can abandon; they
    would wait out gloo's 10 min). The checkpoints stay loadable: the last one resumes the job after everyone is
    gone."""
    job = in_place
    args = ("--step-delay-ms", "0", "--log-every", "1", "--checkpoint-interval", "1")  # the time goes to saving
    every_step = JobRanges.model_validate({**WIDE_RANGES.model_dump(), "checkpoint_interval_steps": {"min": 1,
                                                                                                     "max": 10}})
    for name in ("h1", "h2", "h3"):
        job.start(name, args=args, ranges=every_step)
    first = job.announce(["h1", "h2", "h3"])
    job.running(world=3, epoch=first, steps_after=10)
    rank0 = next(h.name for h in job.hosts.values() if (h.control / CONTROL_PROGRESS_FILE).exists())  # rank 0's
    victim_host = next(name for name in ("h1", "h2", "h3") if name != rank0)
    survivors = sorted(set(job.hosts) - {victim_host})
    victim = job.worker_pid(victim_host)
    os.kill(victim, signal.SIGSTOP)
    try:
        after_epoch = job.announce(survivors, urgent=True, reason=f"{victim_host} frozen")
        after = job.running(world=2, epoch=after_epoch, steps_after=5, timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    assert after.resumed_from_step is None and after.last_checkpoint_step is not None
    _assert_replicas_agree(job.replicas(after_epoch, 2), exact=True)

    for name in survivors:
        os.kill(job.worker_pid(name), signal.SIGKILL)
        job.hosts[name].node.wait(timeout=30)
    saved = max(int(p.name.split("-")[1]) for p in (job.root / "checkpoints").glob("step-*") if "." not in p.name)
    job.epoch += 1
    job.start("h4", args=args, ranges=every_step)
    again = job.announce(["h4"])
    resumed = job.running(world=1, epoch=again, steps_after=2)
    assert resumed.resumed_from_step == saved and resumed.change == EpochChange.CHECKPOINT
