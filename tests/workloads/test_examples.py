"""The example jobs run as documented under plain torchrun (no spec, no control directory), and learn."""

from __future__ import annotations

import pytest

from tests.workloads.harness import Cluster, JobDirs

pytestmark = pytest.mark.slow


def test_tiny_lm_under_plain_torchrun_learns_and_checkpoints(job: JobDirs, cluster: Cluster) -> None:
    node = cluster.start(
        "workloads.examples.tiny_lm",
        nproc=2,
        args=["--checkpoint-dir", str(job.checkpoints), "--max-steps", "60", "--checkpoint-interval", "25"],
    )
    assert node.wait(timeout=50) == 0
    losses = node.losses()
    assert [step for step, _ in losses] == [10, 20, 30, 40, 50, 60]
    assert losses[-1][1] < 0.5 * losses[0][1], f"loss did not fall: {losses}"
    assert job.checkpoint_steps() == [25, 50, 60]
    assert not job.control.exists(), "without a spec or --control-dir, progress goes nowhere"
    assert set(node.exits().values()) == {(60, "max_steps 60 reached")}
    ranks = sorted(path.name for path in (node.log_path.parent / "torchelastic").glob("*/attempt_0/*"))
    assert ranks == ["0", "1"], "torchrun's --log-dir is honoured: its run's directories there, not in the temp dir"
