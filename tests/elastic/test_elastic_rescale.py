"""Agreements carried out on a running job: a negotiated scale-up adds a node, the job re-forms at the larger world
size from its checkpoint; a scale-down likewise. Real agents, real torchrun nodes, gloo on CPU."""

from __future__ import annotations

import pytest

from harmonaize.event_loop import resolve_event_loop
from tests.elastic.harness import ElasticCloud, mlp_job

pytestmark = pytest.mark.timeout(300)


async def test_negotiated_scale_up_and_down_continue_from_the_checkpoint(cloud: ElasticCloud) -> None:
    await cloud.create_job("train", initial_workers=2, **mlp_job())
    first = await cloud.running_at("train", world=2, steps_after=10)
    assert first["resumed_from_step"] is None

    await cloud.negotiate("train", {"kind": "scale", "terms": {"desired_workers": 3}})
    bigger = await cloud.running_at("train", world=3, epoch_at_least=first["epoch"] + 1, steps_after=5)
    assert bigger["resumed_from_step"] is not None
    assert bigger["resumed_from_step"] >= first["step"], "the graceful stop checkpoints at the step it agreed on"

    await cloud.negotiate("train", {"kind": "scale", "terms": {"desired_workers": 2}})
    smaller = await cloud.running_at("train", world=2, epoch_at_least=bigger["epoch"] + 1, steps_after=5)
    assert smaller["resumed_from_step"] >= bigger["step"]

    timeline = await cloud.timeline("train")
    assert [entry["world_size"] for entry in timeline] == [2, 3, 2]
    steps = [entry["step"] for entry in timeline]
    assert steps == sorted(steps) and steps[0] == 0

    # the agents launched and stopped those torchrun nodes from the default loop (uvloop where installed)
    logs = [path.read_text(errors="replace") for path in cloud.data_dir.glob("agent-*.log")]
    assert logs and all(f"event loop {resolve_event_loop('auto')}" in log for log in logs)
