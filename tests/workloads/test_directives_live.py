"""Provider directives on a running 2-worker DDP job: applied by every rank at the same step, or refused with reasons.

The provider side is played by the test: it rewrites `<control_dir>/directives.json` atomically with growing
versions and reads `progress.json`, exactly the files a node launcher uses.
"""

from __future__ import annotations

import math

import pytest

from harmonaize.job_runtime import Directives, DirectiveState, JobProgress
from harmonaize.jobs import Compression
from tests.workloads.harness import APPLIED_LINE, Cluster, JobDirs, Node, wait_for

pytestmark = pytest.mark.slow


def outcome_of(job: JobDirs, version: int) -> JobProgress | None:
    progress = job.progress()
    if progress is None or not any(o.version == version for o in progress.outcomes):
        return None
    return progress


def handled_by_all_ranks(node: Node, version: int, world: int) -> set[int]:
    """The steps at which each rank logged handling `version` (one step when they agreed)."""
    found = {
        int(m.group(1)): int(m.group(3))
        for m in APPLIED_LINE.finditer(node.log())
        if int(m.group(4)) == version
    }
    assert sorted(found) == list(range(world)), f"not every rank handled v{version}: {found}"
    return set(found.values())


def test_directives_are_applied_or_refused_at_one_step_boundary(job: JobDirs, cluster: Cluster) -> None:
    spec = job.spec("node")
    args = ["--step-delay-ms", "3", "--checkpoint-interval", "1000", "--log-every", "10"]
    node = cluster.start("workloads.examples.mlp", nproc=2, args=args, spec=spec)
    wait_for(lambda: (p := job.progress()) is not None and p.step >= 5, timeout=40, what="5 steps")

    job.direct(Directives(version=1, compression=Compression.FP16, reason="congestion between groups"))
    progress = wait_for(lambda: outcome_of(job, 1), timeout=15, what="outcome of v1")
    assert progress.outcomes[-1].status is DirectiveState.APPLIED
    assert progress.compression is Compression.FP16
    assert handled_by_all_ranks(node, 1, 2) == {progress.outcomes[-1].step}

    job.direct(
        Directives(version=2, compression=Compression.POWERSGD, powersgd_rank=1, batch_size=16, checkpoint_requests=1)
    )
    progress = wait_for(lambda: outcome_of(job, 2), timeout=15, what="outcome of v2")
    applied = progress.outcomes[-1]
    assert applied.status is DirectiveState.APPLIED
    assert (progress.compression, progress.powersgd_rank, progress.batch_size) == (Compression.POWERSGD, 1, 16)
    assert handled_by_all_ranks(node, 2, 2) == {applied.step}
    assert applied.step in job.checkpoint_steps(), "checkpoint now: saved at the boundary that applied it"
    assert progress.last_checkpoint_step == applied.step

    job.direct(Directives(version=3, batch_size=4096, powersgd_rank=8, compression=Compression.POWERSGD,
                          gradient_accumulation=9, checkpoint_requests=2))
    progress = wait_for(lambda: outcome_of(job, 3), timeout=15, what="outcome of v3")
    refused = progress.outcomes[-1]
    assert refused.status is DirectiveState.REFUSED
    assert len(refused.reasons) == 3
    assert any("batch_size 4096" in r for r in refused.reasons)
    assert any("powersgd_rank 8" in r for r in refused.reasons)
    assert any("gradient_accumulation 9" in r for r in refused.reasons)
    assert (progress.compression, progress.powersgd_rank, progress.batch_size) == (Compression.POWERSGD, 1, 16)
    assert progress.directives_version == 3
    assert handled_by_all_ranks(node, 3, 2) == {refused.step}

    job.direct(Directives(version=4, gradient_accumulation=2, checkpoint_interval_steps=5))
    progress = wait_for(lambda: outcome_of(job, 4), timeout=15, what="outcome of v4")
    v4_step = progress.outcomes[-1].step
    assert progress.outcomes[-1].status is DirectiveState.APPLIED
    assert (progress.compression, progress.batch_size, progress.gradient_accumulation) == (Compression.NONE, 32, 2)
    assert progress.checkpoint_interval_steps == 5
    wait_for(lambda: any(step > v4_step for step in job.checkpoint_steps()), timeout=15,
             what="a periodic checkpoint at the new interval")
    last = job.progress()
    assert last is not None and last.loss is not None and math.isfinite(last.loss)
    assert [o.version for o in last.outcomes] == [1, 2, 3, 4]

    node.terminate()
    node.wait(timeout=35)
    stop_step = {step for step, _ in node.exits().values()}
    assert len(stop_step) == 1 and len(node.exits()) == 2
