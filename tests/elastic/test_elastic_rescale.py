"""Agreements carried out on a running job, in place: a negotiated scale-up adds a node whose worker takes the state
from a live peer, a scale-down lets one node leave; the other workers keep their processes and their memory (no
checkpoint is loaded). The tenant's global batch is kept across both: each worker count gets its own split of it
into per-rank batch and accumulation. Real agents, real torchrun nodes, gloo on CPU."""

from __future__ import annotations

import pytest

from harmonaize.event_loop import resolve_event_loop
from tests.elastic.harness import ElasticCloud, mlp_job, wait_for, worker_pids

pytestmark = pytest.mark.timeout(300)

GLOBAL_BATCH = 192
"""Within the MLP job's batch range 8..64 and accumulation 1..6: 48 x 2 at two workers, 64 x 1 at three."""


def split(progress: dict[str, object]) -> tuple[object, object, object]:
    return progress["batch_size"], progress["gradient_accumulation"], progress["world_size"]


async def test_negotiated_scale_up_and_down_keep_the_running_workers(cloud: ElasticCloud) -> None:
    body = {**mlp_job(), "gradient_accumulation": {"min": 1, "max": 6}, "global_batch": GLOBAL_BATCH}
    await cloud.create_job("train", initial_workers=2, **body)
    first = await cloud.running_at("train", world=2, steps_after=10)
    assert first["resumed_from_step"] is None
    assert split(first) == (48, 2, 2)
    original = cloud.hosts_running("train")
    pids = await worker_pids(cloud, "train", original)

    offer = await cloud.open_offer("train", {"kind": "scale", "terms": {"desired_workers": 3}})
    await wait_for(lambda: len(cloud.hosts_running("train")) == 3 or None, timeout=30,
                   what="the offer's warm joiner started on a third host")
    (joiner,) = set(cloud.hosts_running("train")) - set(original)
    standby_pid = (await worker_pids(cloud, "train", [joiner]))[joiner]  # it beats while it waits for the accept
    assert (await cloud.progress("train") or {}).get("world_size") == 2, "a standby does not join before the accept"

    await cloud.accept(offer)
    bigger = await cloud.running_at("train", world=3, epoch_at_least=first["epoch"] + 1, steps_after=5)
    assert bigger["resumed_from_step"] is None, "in place: the joiner took the state from a live peer, not a checkpoint"
    assert split(bigger) == (64, 1, 3), "the global batch is kept at three workers"
    assert bigger["step"] > first["step"]
    assert await worker_pids(cloud, "train", original) == pids, "the running workers were not restarted"
    assert (await worker_pids(cloud, "train", [joiner]))[joiner] == standby_pid, "the warm joiner joined, not a new one"

    await cloud.negotiate("train", {"kind": "scale", "terms": {"desired_workers": 2}})
    smaller = await cloud.running_at("train", world=2, epoch_at_least=bigger["epoch"] + 1, steps_after=5)
    assert smaller["resumed_from_step"] is None
    assert split(smaller) == (48, 2, 2)
    assert smaller["step"] > bigger["step"]

    timeline = await cloud.timeline("train")
    assert [(entry["world_size"], entry["change"]) for entry in timeline] == [
        (2, "fresh"), (3, "in_place"), (2, "in_place")
    ]
    steps = [entry["step"] for entry in timeline]
    assert steps[0] == 0 and first["step"] <= steps[1] <= bigger["step"] <= steps[2] <= smaller["step"], steps
    assert all(entry["pause_s"] is not None and entry["pause_s"] >= 0 for entry in timeline[1:])

    logs = [path.read_text(errors="replace") for path in cloud.data_dir.glob("agent-*.log")]
    assert sum(log.count("in place") for log in logs) >= 4, "both changes reached the running nodes in place"
    # the agents launched and stopped those torchrun nodes from the default loop (uvloop where installed)
    assert logs and all(f"event loop {resolve_event_loop('auto')}" in log for log in logs)
