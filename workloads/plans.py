"""Parallel plans: wrap one model as DDP, FSDP2 or HSDP (replicate across locality groups, shard within one).

HSDP keeps the frequent all-gathers and reduce-scatters of sharding inside a locality group (fast links) and sends
only a gradient all-reduce across groups. torchrun numbers ranks by node, not by group, so the runtime arranges the
2-D DeviceMesh itself: every rank all-gathers its node's `locality_group`, and `arrange_mesh` puts each group on one
row (the shard dimension), rows ordered by their lowest rank. A mesh must be rectangular: with groups of unequal
size the run falls back to FSDP over the whole world and says so (`ParallelSetup.fallback_reason`, the log, and the
plan reported in progress).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from harmonaize.jobs import ParallelPlan

if TYPE_CHECKING:  # imported at run time only where a mesh is built
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MESH_DIMS", "MeshArrangement", "ParallelSetup", "arrange_mesh", "plan_parallelism", "shard_model"]

MESH_DIMS = ("replicate", "shard")

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeshArrangement:
    """The outcome of arranging ranks by locality group: rows (one per group) or why that is impossible."""

    rows: tuple[tuple[int, ...], ...] | None
    groups: tuple[str, ...]
    reason: str = ""


def arrange_mesh(groups_by_rank: Sequence[str]) -> MeshArrangement:
    """Arrange ranks into an HSDP mesh: one row per locality group (ranks ascending), rows by their lowest rank.

    `groups_by_rank[r]` is rank r's locality group. Returns rows=None with a reason when the groups differ in size.
    """
    members: dict[str, list[int]] = {}
    for rank, group in enumerate(groups_by_rank):
        members.setdefault(group, []).append(rank)
    ordered = sorted(members.items(), key=lambda item: item[1][0])
    sizes = {len(ranks) for _, ranks in ordered}
    names = tuple(name for name, _ in ordered)
    if len(sizes) != 1:
        detail = ", ".join(f"{name or '<none>'}: {len(ranks)}" for name, ranks in ordered)
        return MeshArrangement(rows=None, groups=names, reason=f"locality groups differ in size ({detail})")
    return MeshArrangement(rows=tuple(tuple(ranks) for _, ranks in ordered), groups=names)


@dataclass
class ParallelSetup:
    """How this run is actually partitioned (which may differ from the plan asked for)."""

    requested: ParallelPlan
    used: ParallelPlan
    groups_by_rank: tuple[str, ...] = ()
    mesh_rows: tuple[tuple[int, ...], ...] | None = None
    fallback_reason: str = ""
    mesh: DeviceMesh | None = field(default=None, repr=False)
    shard_group_ranks: tuple[int, ...] = ()

    def describe(self) -> str:
        if self.used is ParallelPlan.HSDP:
            return f"hsdp, shard groups (one per locality group) {[list(row) for row in self.mesh_rows or ()]}"
        if self.fallback_reason:
            return f"{self.used.value} (asked for {self.requested.value}: {self.fallback_reason})"
        return self.used.value


def plan_parallelism(requested: ParallelPlan, locality_group: str, *, device_type: str) -> ParallelSetup:
    """Collective: decide the plan actually used, and build the HSDP DeviceMesh when that is HSDP."""
    if requested is not ParallelPlan.HSDP:
        return ParallelSetup(requested=requested, used=requested)
    gathered: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(gathered, locality_group)
    arrangement = arrange_mesh(gathered)
    if arrangement.rows is None:
        return ParallelSetup(
            requested=requested,
            used=ParallelPlan.FSDP,
            groups_by_rank=tuple(gathered),
            fallback_reason=f"{arrangement.reason}: FSDP over the whole world instead",
        )
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(device_type, torch.tensor(arrangement.rows, dtype=torch.int), mesh_dim_names=MESH_DIMS)
    shard_ranks = tuple(dist.get_process_group_ranks(mesh.get_group(MESH_DIMS[1])))
    rank = dist.get_rank()
    # The runtime checks its own arrangement: a shard group must never span locality groups.
    if rank not in shard_ranks or {gathered[member] for member in shard_ranks} != {gathered[rank]}:
        raise RuntimeError(f"rank {rank}: shard group {shard_ranks} does not match locality group {gathered[rank]!r}")
    return ParallelSetup(
        requested=requested,
        used=ParallelPlan.HSDP,
        groups_by_rank=tuple(gathered),
        mesh_rows=arrangement.rows,
        mesh=mesh,
        shard_group_ranks=shard_ranks,
    )


def shard_model(model: nn.Module, setup: ParallelSetup, *, shard_modules: tuple[type[nn.Module], ...]) -> nn.Module:
    """Apply FSDP2 (`fully_shard`) to every submodule of a `shard_modules` type, then to the root.

    Sharding each block separately lets FSDP all-gather one block at a time; the root call catches the rest.
    """
    from torch.distributed.fsdp import fully_shard

    mesh = setup.mesh if setup.used is ParallelPlan.HSDP else None
    for module in list(model.modules())[1:]:
        if shard_modules and isinstance(module, shard_modules):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
