"""What the node launcher reads to judge its nodes for hangs: the workers' liveness files, of live workers only.

A liveness file outlives its worker when the worker dies without closing (a crash, SIGKILL). Such a file is not a
hang: the dead worker's node exits, and the launcher's exit handling deals with that. So a record counts only while
its pid is alive and still carries the node's marker (a recycled pid belongs to some other process and never beats,
and must not be taken for a frozen worker). A node starts with no files (`clear_liveness`), so nothing a previous
node wrote is judged against the new one.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from pydantic import ValidationError

from harmonaize.job_runtime import CONTROL_LIVENESS_GLOB, ENV_NODE_MARKER, NodeLiveness, read_model
from provider_agents.processes import alive

__all__ = ["WATCH_INTERVAL_S", "clear_liveness", "read_liveness"]

WATCH_INTERVAL_S = 0.1
"""How often the agent reads its nodes' liveness and process states: a hang is declared at most this late (a
stopped process within `HangBounds.stopped_s` plus this)."""

log = logging.getLogger(__name__)


def read_liveness(control_dir: Path, *, tenant: str, job: str, epoch: int, marker: str) -> list[NodeLiveness]:
    """The liveness records of the node's live workers (this job and epoch, carrying `marker`)."""
    records = []
    for path in sorted(control_dir.glob(CONTROL_LIVENESS_GLOB)):
        try:
            record = read_model(path, NodeLiveness)
        except (ValidationError, ValueError, OSError) as exc:
            log.debug("ignoring unreadable liveness file %s: %r", path, exc)
            continue
        if record is None or (record.tenant, record.job, record.epoch) != (tenant, job, epoch):
            continue
        if alive(record.pid) and _carries(record.pid, marker):
            records.append(record)
    return records


def clear_liveness(control_dir: Path) -> None:
    """Remove every liveness file (before a node starts)."""
    for path in control_dir.glob(CONTROL_LIVENESS_GLOB):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _carries(pid: int, marker: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{ENV_NODE_MARKER}={marker}".encode() in environ.split(b"\0")
