"""Repartition: DDP -> FSDP -> HSDP (two torchrun nodes, one locality group each) -> DDP, through DCP checkpoints.

Each phase is a fresh torchrun run with another plan (and for HSDP another world size); the full model state dict
right after each load must equal the one saved by the phase before. The HSDP phase must really shard within a
locality group: the runtime's mesh description lists every rank's actual shard process group.
"""

from __future__ import annotations

import json

import pytest

from harmonaize.jobs import ParallelPlan
from tests.workloads.harness import Cluster, JobDirs, assert_same_state, free_port, wait_for

pytestmark = pytest.mark.slow

LM = "workloads.examples.tiny_lm"
PHASE_STEPS = 8


def check_mesh_groups_by_locality(job: JobDirs, world: int) -> dict[str, object]:
    info = json.loads((job.dumps / f"mesh-world{world}-hsdp.json").read_text())
    assert info["used"] == "hsdp", info
    groups, rows = info["groups_by_rank"], info["mesh_rows"]
    assert sorted(rank for row in rows for rank in row) == list(range(world))
    assert all(len({groups[rank] for rank in row}) == 1 for row in rows), f"a shard group spans localities: {info}"
    assert len({groups[row[0]] for row in rows}) == len(rows), f"two rows share a locality group: {info}"
    for rank, actual in enumerate(info["shard_group_of_rank"]):
        assert actual == next(row for row in rows if rank in row), f"rank {rank} shards with {actual}: {info}"
        assert {groups[member] for member in actual} == {groups[rank]}
    return info


def test_ddp_fsdp_hsdp_ddp_round_trip_keeps_the_model(job: JobDirs, cluster: Cluster) -> None:
    args = ["--log-every", "4", "--checkpoint-interval", "1000"]
    phases: list[tuple[ParallelPlan, int]] = [(ParallelPlan.DDP, 2), (ParallelPlan.FSDP, 2), (ParallelPlan.HSDP, 4),
                                              (ParallelPlan.DDP, 2)]
    for index, (plan, world) in enumerate(phases):
        max_steps = str(PHASE_STEPS * (index + 1))
        if plan is ParallelPlan.HSDP:
            port = free_port()
            nodes = [
                cluster.start(
                    LM, nproc=2, args=[*args, "--max-steps", max_steps], rendezvous=(port, 2), dump_dir=job.dumps,
                    spec=job.spec(f"phase{index}-{group}", plan=plan, locality_group=group, epoch=index),
                )
                for group in ("grp-east", "grp-west")
            ]
        else:
            nodes = [
                cluster.start(LM, nproc=world, args=[*args, "--max-steps", max_steps], dump_dir=job.dumps,
                              spec=job.spec(f"phase{index}", plan=plan, epoch=index))
            ]
        assert [node.wait(timeout=45) for node in nodes] == [0] * len(nodes), f"phase {index} ({plan.value}) failed"
        progress = job.progress()
        assert progress is not None
        assert (progress.step, progress.world_size, progress.parallel_plan) == (int(max_steps), world, plan)
        if index == 0:
            continue
        loaded_step = PHASE_STEPS * index
        saved = job.dump(f"saved-step{loaded_step}.pt")
        loaded = job.dump(f"loaded-step{loaded_step}-world{world}-{plan.value}.pt")
        assert_same_state(saved, loaded, exact=True, context=f"{phases[index - 1][0].value} -> {plan.value}")
        if plan is ParallelPlan.HSDP:
            check_mesh_groups_by_locality(job, world)
    losses = [loss for node in cluster.nodes for _, loss in node.losses()]
    assert losses[-1] < 0.5 * losses[0], f"loss did not fall across the round trip: {losses}"


def test_hsdp_with_unequal_locality_groups_falls_back_to_fsdp_and_says_so(job: JobDirs, cluster: Cluster) -> None:
    port = free_port()
    nodes = [
        cluster.start(
            "workloads.examples.mlp", nproc=nproc, args=["--max-steps", "6"], rendezvous=(port, 2),
            dump_dir=job.dumps, spec=job.spec(f"node-{group}", plan=ParallelPlan.HSDP, locality_group=group),
        )
        for group, nproc in (("grp-east", 2), ("grp-west", 1))
    ]
    assert [node.wait(timeout=45) for node in nodes] == [0, 0]
    progress = wait_for(job.progress, timeout=5, what="progress")
    assert progress.parallel_plan is ParallelPlan.FSDP and progress.world_size == 3 and progress.step == 6
    info = json.loads((job.dumps / "mesh-world3-fsdp.json").read_text())
    assert info["requested"] == "hsdp" and info["used"] == "fsdp"
    assert "differ in size" in info["fallback_reason"]
    assert any("HSDP not possible" in node.log() and "differ in size" in node.log() for node in nodes)
