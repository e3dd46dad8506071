"""A rank dies while a checkpoint is being written: the previous checkpoint stays the latest, and loads.

The test hook `HZ_RUN_TEST_CRASH_SAVE=<step>:<point>` SIGKILLs the highest rank inside the save of `<step>`:
`before-write` while the other ranks write their DCP shards (the partial directory is half written, no metadata);
`before-commit` after every shard, the metadata and trainer.json are written but before rank 0's rename (the
partial directory looks complete; only its name says it is not).
"""

from __future__ import annotations

import pytest

from harmonaize.job_runtime import JobRanges
from harmonaize.ranges import IntRange
from tests.workloads.harness import WIDE_RANGES, Cluster, JobDirs, assert_same_state

pytestmark = pytest.mark.slow

RANGES = JobRanges.model_validate({**WIDE_RANGES.model_dump(), "checkpoint_interval_steps": IntRange(min=5, max=100)})


@pytest.mark.parametrize("point", ["before-write", "before-commit"])
def test_the_previous_checkpoint_survives_a_crash_mid_save(job: JobDirs, cluster: Cluster, point: str) -> None:
    args = ["--checkpoint-interval", "5", "--log-every", "5"]
    crashing = cluster.start(
        "workloads.examples.mlp",
        nproc=2,
        args=[*args, "--max-steps", "50"],
        spec=job.spec("node", ranges=RANGES),
        dump_dir=job.dumps,
        crash_save=f"10:{point}",
    )
    assert crashing.wait(timeout=45) != 0
    assert "test hook: killing myself during the save of step 10" in crashing.log()
    assert job.checkpoint_steps() == [5]
    partial = job.checkpoints / "step-00000010.partial"
    assert partial.is_dir(), "the crash should leave the half-done save behind"
    if point == "before-commit":
        assert (partial / ".metadata").is_file() and (partial / "trainer.json").is_file()

    restarted = cluster.start(
        "workloads.examples.mlp",
        nproc=2,
        args=[*args, "--max-steps", "12"],
        spec=job.spec("node", ranges=RANGES, epoch=1),
        dump_dir=job.dumps,
    )
    assert restarted.wait(timeout=45) == 0
    assert_same_state(
        job.dump("saved-step5.pt"), job.dump("loaded-step5-world2-ddp.pt"), exact=True, context="after the crash"
    )
    assert not partial.exists(), "the leftover partial directory is cleaned at start"
    assert job.checkpoint_steps() == [5, 10, 12]
    progress = job.progress()
    assert progress is not None and progress.resumed_from_step == 5 and progress.step == 12
