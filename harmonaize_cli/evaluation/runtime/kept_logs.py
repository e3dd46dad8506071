"""Keeping a run's logs beside the report when the run did not do what it should.

The local cloud lives in a temporary data dir that is removed with it, so a run that missed its target (no value
for a metric in the report) would leave nothing to explain why: was the job stuck in a rendezvous, did the
controller fail, did an agent die? `keep_job_logs` copies what tells: every node log of the job (named
`<host>-<file>`, since every host's are called alike), its controller's log, and the agents' and the fleet monitor's
logs, each cut to its last `MAX_BYTES` (the end is where a failure shows; a whole agent log of a long run is large).
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["MAX_BYTES", "keep_job_logs", "tail"]

MAX_BYTES = 256 * 1024
"""What is kept of each log: its end."""


def tail(path: Path, max_bytes: int = MAX_BYTES) -> bytes:
    """The last `max_bytes` of `path` (all of it if shorter), starting at a line's start where it was cut."""
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        handle.seek(max(0, size - max_bytes))
        data = handle.read()
    if size > max_bytes:
        cut = data.find(b"\n")
        data = data[cut + 1:] if cut >= 0 else data
    return data


def keep_job_logs(data_dir: Path, out_dir: Path, *, tenant: str, job: str) -> Path:
    """Copy the logs that explain `job`'s run from the cloud's `data_dir` into `<out_dir>/logs/<job>/`; that dir."""
    kept = out_dir / "logs" / job
    kept.mkdir(parents=True, exist_ok=True)
    for node_log in sorted(data_dir.glob(f"hosts/*/jobs/{tenant}.{job}/*.log")):
        host = node_log.parents[2].name
        (kept / f"{host}-{node_log.name}").write_bytes(tail(node_log))
    logs = data_dir / "logs"
    for name in [f"controller-{job}.log", "fleet-monitor.log", *(p.name for p in sorted(logs.glob("agent-*.log")))]:
        source = logs / name
        if source.is_file():
            (kept / name).write_bytes(tail(source))
    if not any(kept.iterdir()):
        shutil.rmtree(kept)  # nothing of this job was ever written: say so by its absence
    return kept
