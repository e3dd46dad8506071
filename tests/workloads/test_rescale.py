"""Rescale: SIGTERM a running job (it agrees on a stop step, checkpoints, exits), restart it at another world size.

What must hold across the restart: the step counter continues from the checkpoint, the parameters right after the
load equal the ones saved (bitwise when no sharding is involved, allclose where FSDP reshards), and the loss keeps
falling rather than starting over. The measured SIGTERM -> first step of the new run is printed.
"""

from __future__ import annotations

import statistics
import time

import pytest

from harmonaize.jobs import ParallelPlan
from tests.workloads.harness import Cluster, JobDirs, assert_same_state, free_port, wait_for

pytestmark = pytest.mark.slow

MORE_STEPS = 40


@pytest.mark.parametrize(
    ("before", "after"),
    [
        pytest.param((2, ParallelPlan.DDP), (3, ParallelPlan.DDP), id="ddp2-to-ddp3"),
        pytest.param((3, ParallelPlan.FSDP), (2, ParallelPlan.FSDP), id="fsdp3-to-fsdp2"),
        pytest.param((2, ParallelPlan.FSDP), (3, ParallelPlan.DDP), id="fsdp2-to-ddp3"),
    ],
)
def test_sigterm_checkpoints_and_the_job_resumes_at_a_new_size(
    job: JobDirs, cluster: Cluster, before: tuple[int, ParallelPlan], after: tuple[int, ParallelPlan]
) -> None:
    (nproc_before, plan_before), (nproc_after, plan_after) = before, after
    common = ["--step-delay-ms", "2", "--log-every", "5", "--checkpoint-interval", "1000"]
    first = cluster.start(
        "workloads.examples.mlp",
        nproc=nproc_before,
        args=common,
        spec=job.spec("first", plan=plan_before),
        dump_dir=job.dumps,
    )
    wait_for(lambda: (p := job.progress()) is not None and p.step >= 40, timeout=40, what="40 steps")

    sigterm = time.monotonic()
    first.terminate()
    first.wait(timeout=35)
    stopped = time.monotonic()
    exits = first.exits()
    assert sorted(exits) == list(range(nproc_before)), f"not every rank exited through the runtime: {exits}"
    stop_steps = {step for step, _ in exits.values()}
    assert len(stop_steps) == 1, f"ranks stopped at different steps: {exits}"
    (stop_step,) = stop_steps
    assert all("SIGTERM" in reason or "peer" in reason for _, reason in exits.values())
    assert "closing signal SIGKILL" not in first.log()
    assert job.checkpoint_steps()[-1] == stop_step
    progress = job.progress()
    assert progress is not None and progress.step == stop_step and progress.last_checkpoint_step == stop_step

    second = cluster.start(
        "workloads.examples.mlp",
        nproc=nproc_after,
        args=[*common, "--max-steps", str(stop_step + MORE_STEPS)],
        spec=job.spec("second", plan=plan_after, epoch=1),
        dump_dir=job.dumps,
    )
    wait_for(
        lambda: (p := job.progress()) is not None and p.world_size == nproc_after and p.step > stop_step,
        timeout=30,
        what="the first step of the restarted run",
        interval=0.01,
    )
    resumed = time.monotonic()
    assert second.wait(timeout=30) == 0
    print(
        f"resume {nproc_before}x{plan_before.value} -> {nproc_after}x{plan_after.value}: SIGTERM -> old run exited "
        f"{stopped - sigterm:.2f} s, -> first step of the new run {resumed - sigterm:.2f} s"
    )

    progress = job.progress()
    assert progress is not None
    assert progress.resumed_from_step == stop_step
    assert progress.step == stop_step + MORE_STEPS
    assert (progress.world_size, progress.parallel_plan) == (nproc_after, plan_after)
    assert progress.epoch == 1

    saved = job.dump(f"saved-step{stop_step}.pt")
    loaded = job.dump(f"loaded-step{stop_step}-world{nproc_after}-{plan_after.value}.pt")
    exact = plan_before is ParallelPlan.DDP and plan_after is ParallelPlan.DDP
    assert_same_state(saved, loaded, exact=exact, context=f"after restart at step {stop_step}")

    early = [loss for step, loss in first.losses() if step <= 10]
    late_first = [loss for step, loss in first.losses() if step > stop_step - 15]
    resumed_losses = [loss for step, loss in second.losses() if step > stop_step]
    assert early and late_first and resumed_losses
    assert statistics.mean(late_first) < 0.6 * statistics.mean(early), "loss did not fall before the stop"
    assert resumed_losses[0] < 0.6 * statistics.mean(early), "the restarted run started over"
    assert statistics.mean(resumed_losses[-3:]) < statistics.mean(late_first), "loss did not keep falling"


def test_sigterm_to_one_node_stops_every_rank_of_every_node_at_one_step(job: JobDirs, cluster: Cluster) -> None:
    """Launchers signal nodes one by one; the stop flag travels in the step's all-reduce, so nobody runs ahead."""
    port = free_port()
    nodes = [
        cluster.start(
            "workloads.examples.mlp", nproc=1, args=["--step-delay-ms", "2", "--checkpoint-interval", "1000"],
            rendezvous=(port, 2), spec=job.spec(f"node-{name}", plan=ParallelPlan.DDP, locality_group=name),
        )
        for name in ("east", "west")
    ]
    wait_for(lambda: (p := job.progress()) is not None and p.step >= 20, timeout=40, what="20 steps")
    nodes[1].terminate()
    nodes[1].wait(timeout=35)
    exits = wait_for(lambda: {**nodes[0].exits(), **nodes[1].exits()}.values() if
                     len(nodes[0].exits()) + len(nodes[1].exits()) == 2 else None, timeout=20,
                     what="both ranks to exit")
    steps = {step for step, _ in exits}
    assert len(steps) == 1, f"ranks stopped at different steps: {exits}"
    reasons = sorted(reason for _, reason in exits)
    assert reasons == ["stop requested (SIGTERM)", "stop requested (by a peer)"]
    assert job.checkpoint_steps() == sorted(steps)
