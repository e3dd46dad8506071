"""Hold a benchmark's server process to a fixed share of the CPU (a cgroup of its own with a CFS quota).

Why: whether N API replicas carry N times the load is a question about the software (is there a point they all
queue on: the database, the ledger's lock, a shared bucket?), but on a small machine it is answered by the machine:
one replica already takes a core, so a second has nowhere to run. Held to a fraction of a core each, N replicas
need N fractions, which the machine still has to give (beside the database and the load generator); what they
achieve together then says whether they scale.

Each quota is a cgroup named after this benchmark's pid and the process's label (`hz-bench-<pid>-<label>`), made
for one process and removed when it is released, so two benchmarks (or a benchmark beside a running cloud) never
share or remove each other's. cgroup v2 (`cpu.max`, where the root delegates the cpu controller) and v1
(`cpu.cfs_quota_us` under the cpu hierarchy) are both handled; anything else is a clear error, not a silent run
without the limit.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["CpuQuota", "CpuQuotaError", "cpu_quota_root"]

CGROUP_FS = Path("/sys/fs/cgroup")
PERIOD_US = 100_000
"""The CFS period: the quota is refilled every 100 ms (the kernel's default period)."""


class CpuQuotaError(RuntimeError):
    """No cgroup CPU controller this process may use: the reason, for the benchmark's error message."""


def cpu_quota_root(fs: Path = CGROUP_FS) -> tuple[Path, int]:
    """Where quotas can be made, and the cgroup version: v1's cpu hierarchy if mounted, else the v2 root if it
    delegates `cpu`; CpuQuotaError saying what is missing otherwise."""
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        v1 = fs / name
        if (v1 / "cpu.cfs_quota_us").exists():
            if not os.access(v1, os.W_OK):
                raise CpuQuotaError(f"{v1} is not writable (run as root to hold servers to a CPU quota)")
            return v1, 1
    controllers = fs / "cgroup.controllers"
    if controllers.exists():
        if "cpu" not in controllers.read_text().split():
            raise CpuQuotaError(f"the cgroup v2 root {fs} has no cpu controller")
        delegated = (fs / "cgroup.subtree_control").read_text().split()
        if "cpu" not in delegated:
            raise CpuQuotaError(f"the cgroup v2 root {fs} does not delegate cpu to its children "
                                "(cgroup.subtree_control)")
        if not os.access(fs, os.W_OK):
            raise CpuQuotaError(f"{fs} is not writable (run as root to hold servers to a CPU quota)")
        return fs, 2
    raise CpuQuotaError(f"no cgroup CPU controller under {fs} (neither v1's cpu hierarchy nor a v2 root)")


class CpuQuota:
    """One process held to `cores` of CPU time (0.25: a quarter of one core's time, however many cores it uses)."""

    def __init__(self, label: str, cores: float, *, fs: Path = CGROUP_FS) -> None:
        if not 0.01 <= cores <= 64:
            raise ValueError(f"a CPU quota must lie in [0.01, 64] cores, not {cores}")
        root, self.version = cpu_quota_root(fs)
        self.path = root / f"hz-bench-{os.getpid()}-{label}"
        self.path.mkdir()
        quota = int(cores * PERIOD_US)
        try:
            if self.version == 1:
                (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        except OSError:
            self.path.rmdir()
            raise

    def add(self, pid: int) -> None:
        """Move `pid` (and the threads it has) into this quota; its children start inside it."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def throttled_s(self) -> float:
        """Seconds the processes were held back for having spent their quota (the kernel's own count)."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if line.strip())
        if "throttled_usec" in stat:
            return int(stat["throttled_usec"]) / 1e6
        return int(stat.get("throttled_time", 0)) / 1e9

    def release(self, timeout: float = 5.0) -> None:
        """Remove the cgroup once its processes have exited (the caller stops them first); idempotent."""
        deadline = time.monotonic() + timeout
        while self.path.exists():
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # EBUSY: a process still exiting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
