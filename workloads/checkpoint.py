"""Atomic, reshardable checkpoints: torch.distributed.checkpoint (DCP) written into a `.partial` directory, renamed.

Layout of a checkpoint directory:

    step-00000120/           a complete checkpoint (renamed by global rank 0 after every rank finished writing)
        .metadata            DCP's index, written by DCP's coordinator after all ranks' shards
        __<rank>_0.distcp    DCP shards (model + optimizer, keyed by plan-independent FQNs)
        trainer.json         the trainer's own state (step, applied directives, outcomes, ...), see `TrainerState`
    step-00000130.partial/   a save in progress, or the remains of one that crashed: never loaded, cleaned at start

Why this shape: a directory only gets its final name by one `rename` after a barrier, so a crash at any point leaves
either the old latest checkpoint or the new one, never a half-written one under a loadable name. The model and
optimizer go through `get_state_dict`/`set_state_dict`, so the keys are the module's own FQNs whatever the wrapper
(DDP's `module.` prefix and FSDP's DTensors disappear) and DCP reshards them to any world size and plan on load.

A replicated state (DDP in place, where every rank holds all of it) is written by rank 0 alone, with DCP's `no_dist`
and no barrier: the same directory, loadable and reshardable like the others, and a save no frozen peer can hold.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "METADATA_FILE",
    "PARTIAL_SUFFIX",
    "TRAINER_FILE",
    "CheckpointIO",
    "CheckpointInfo",
    "checkpoint_name",
    "commit",
    "complete_checkpoints",
    "latest_checkpoint",
    "partial_dirs",
    "prune",
    "read_trainer_state",
    "remove_partials",
    "write_trainer_state",
]

METADATA_FILE = ".metadata"
TRAINER_FILE = "trainer.json"
PARTIAL_SUFFIX = ".partial"
_NAME = re.compile(r"^step-(\d{8,})$")

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk."""

    step: int
    path: Path


def checkpoint_name(step: int) -> str:
    """`step-00000042`: fixed width so that names sort like steps (up to 10^8; wider still parses)."""
    return f"step-{step:08d}"


def complete_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Every complete checkpoint under `root`, oldest first.

    Complete means: the final name (no `.partial`), DCP's `.metadata` and our `trainer.json` are all there. A
    directory that has the name but lacks a file (someone copied half of one) is skipped with a warning.
    """
    found: list[CheckpointInfo] = []
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    for entry in entries:
        match = _NAME.match(entry.name)
        if match is None or not entry.is_dir():
            continue
        if not (entry / METADATA_FILE).is_file() or not (entry / TRAINER_FILE).is_file():
            _log.warning("ignoring %s: it lacks %s or %s", entry, METADATA_FILE, TRAINER_FILE)
            continue
        found.append(CheckpointInfo(step=int(match.group(1)), path=entry))
    return sorted(found, key=lambda info: info.step)


def latest_checkpoint(root: Path) -> CheckpointInfo | None:
    """The complete checkpoint with the highest step, or None."""
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None


def partial_dirs(root: Path) -> list[Path]:
    """Leftovers of saves that never committed."""
    try:
        return sorted(entry for entry in root.iterdir() if entry.name.endswith(PARTIAL_SUFFIX) and entry.is_dir())
    except FileNotFoundError:
        return []


def remove_partials(root: Path) -> list[Path]:
    """Delete every `.partial` directory under `root`; returns what was removed. Call only when no save runs."""
    removed = partial_dirs(root)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def prune(root: Path, *, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints; returns what was removed."""
    doomed = [info.path for info in complete_checkpoints(root)[:-keep]] if keep > 0 else []
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The `trainer.json` of the checkpoint at `path`."""
    state: dict[str, Any] = json.loads((path / TRAINER_FILE).read_text(encoding="utf-8"))
    return state


def write_trainer_state(path: Path, state: dict[str, Any]) -> None:
    """Write `trainer.json` and make it durable before the directory is committed."""
    target = path / TRAINER_FILE
    with open(target, "w", encoding="utf-8") as handle:
        json.dump(state, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())


def commit(partial: Path, final: Path) -> None:
    """Give a finished save its final name in one rename (replacing a stale same-step checkpoint, if any)."""
    if final.exists():
        stale = final.with_name(final.name + ".stale")
        shutil.rmtree(stale, ignore_errors=True)
        os.rename(final, stale)
        os.rename(partial, final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.rename(partial, final)
    _fsync_dir(final.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointIO:
    """Saves and loads one job's checkpoints with DCP; every method is collective (all ranks call it in step)."""

    def __init__(
        self,
        root: Path,
        *,
        rank: int,
        world_size: int,
        keep: int = 3,
        crash_hook: Callable[[int, str], None] | None = None,
        replicated: bool = False,
    ) -> None:
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.replicated = replicated
        """Every rank holds the same state (DDP in place): rank 0 alone writes it, with no collective at all, so a
        frozen peer cannot hold a save (DCP's own collectives cannot be abandoned) and the others go on meanwhile."""
        self._crash_hook = crash_hook or (lambda step, point: None)

    def save(self, step: int, app_state: dict[str, Any], trainer_state: dict[str, Any]) -> Path:
        """Save `app_state` (DCP state dict) and `trainer_state` (JSON) as the checkpoint of `step`; returns its path.

        Sequence: rank 0 clears a stale partial of this step; barrier; every rank writes its DCP shards into the
        partial (DCP's coordinator writes `.metadata` once all have); rank 0 adds `trainer.json`; barrier, so every
        rank has finished; rank 0 renames partial -> final and prunes old checkpoints. `replicated`: rank 0 alone
        runs the same sequence, with DCP's `no_dist` and no barrier; the other ranks write nothing.
        """
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        final = self.root / checkpoint_name(step)
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        if self.replicated and self.rank != 0:
            return final
        barrier = (lambda: None) if self.replicated else dist.barrier
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        barrier()
        self._crash_hook(step, "before-write")
        dcp_save(app_state, checkpoint_id=partial, no_dist=self.replicated)
        if self.rank == 0:
            write_trainer_state(partial, trainer_state)
        self._crash_hook(step, "before-commit")
        barrier()
        if self.rank == 0:
            commit(partial, final)
            for path in prune(self.root, keep=self.keep):
                _log.info("pruned old checkpoint %s", path.name)
        return final

    def find_latest(self) -> tuple[CheckpointInfo | None, dict[str, Any] | None]:
        """Rank 0 picks the latest complete checkpoint and reads its trainer state; every rank gets the same answer.

        Deciding on one rank and broadcasting keeps ranks from loading different checkpoints if the directory
        changes under them.
        """
        import torch.distributed as dist

        payload: list[Any] = [None]
        if self.rank == 0:
            latest = latest_checkpoint(self.root)
            if latest is not None:
                payload = [(latest.step, str(latest.path), read_trainer_state(latest.path))]
        dist.broadcast_object_list(payload, src=0)
        if payload[0] is None:
            return None, None
        step, path, trainer_state = payload[0]
        return CheckpointInfo(step=step, path=Path(path)), trainer_state

    def load(self, info: CheckpointInfo, app_state: dict[str, Any]) -> None:
        """Load the checkpoint into `app_state` in place, resharded to this run's world size and plan."""
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        dcp_load(app_state, checkpoint_id=info.path)

    def clean_partials(self) -> None:
        """Rank 0 removes leftovers of crashed saves (called at start, before any save of this run)."""
        if self.rank == 0:
            for path in remove_partials(self.root):
                _log.warning("removed %s: a save that never committed", path.name)
