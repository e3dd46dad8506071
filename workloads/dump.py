"""Test hook (`$HZ_RUN_DUMP_DIR`): the full model state dict on disk after every checkpoint load and save.

Tests compare parameters across restarts and plan changes with these files: `loaded-step<N>-world<W>-<plan>.pt`
right after a checkpoint was loaded (plan = the plan actually used), `saved-step<N>.pt` right after one was saved,
and `mesh-world<W>-<plan>.json` describing how ranks were arranged. Gathering a full state dict is collective and
costs a copy of the model, so nothing happens unless the variable is set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from workloads.plans import ParallelSetup

__all__ = ["dump_mesh", "dump_model", "dump_replica"]


def full_model_state(model: nn.Module) -> dict[str, Any]:
    """Collective: the unsharded model state on CPU at rank 0 (an empty dict elsewhere), keyed by plain FQNs.

    Values are tensors, except what a module's `get_extra_state` adds, which can be any object.
    """
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def dump_replica(dump_dir: Path | None, name: str, model: nn.Module) -> None:
    """Not collective: this rank writes its own replica's state dict (in place, after every epoch change)."""
    if dump_dir is None:
        return
    dump_dir.mkdir(parents=True, exist_ok=True)
    tmp = dump_dir / f".{name}.tmp"
    torch.save({key: value.detach().clone() for key, value in model.state_dict().items()}, tmp)
    tmp.replace(dump_dir / name)


def dump_model(dump_dir: Path | None, name: str, model: nn.Module, *, rank: int) -> None:
    """Collective when `dump_dir` is set: rank 0 writes the full model state dict to `<dump_dir>/<name>`."""
    if dump_dir is None:
        return
    state = full_model_state(model)
    if rank == 0:
        dump_dir.mkdir(parents=True, exist_ok=True)
        tmp = dump_dir / f".{name}.tmp"
        torch.save(state, tmp)
        tmp.replace(dump_dir / name)


def dump_mesh(dump_dir: Path | None, setup: ParallelSetup, *, rank: int, world_size: int) -> None:
    """Collective when `dump_dir` is set: rank 0 writes the plan used and every rank's actual shard group."""
    if dump_dir is None:
        return
    shard_groups: list[Any] = [None] * world_size
    dist.all_gather_object(shard_groups, list(setup.shard_group_ranks))
    if rank == 0:
        dump_dir.mkdir(parents=True, exist_ok=True)
        info = {
            "requested": setup.requested.value,
            "used": setup.used.value,
            "groups_by_rank": list(setup.groups_by_rank),
            "mesh_rows": [list(row) for row in setup.mesh_rows] if setup.mesh_rows else None,
            "shard_group_of_rank": shard_groups,
            "fallback_reason": setup.fallback_reason,
        }
        target = dump_dir / f"mesh-world{world_size}-{setup.used.value}.json"
        target.write_text(json.dumps(info, indent=1), encoding="utf-8")
