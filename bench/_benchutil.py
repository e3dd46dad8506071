"""Small helpers shared by the benchmark scripts: statistics, deadlines, a plain-text table, JSON output.

Not a test helper and not imported by the project: `bench/*.py` put this directory on `sys.path` themselves (it is
`sys.path[0]` when a script is run as `python bench/<script>.py`).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def ensure_repo_on_path() -> None:
    """Make `broker_config`, `api`, `harmonaize` importable even when the project is not installed."""
    if str(ROOT) not in sys.path:
        sys.path.insert(1, str(ROOT))


def event_loop_choice() -> str:
    """The loop a benchmark's servers and agents run on: `HZ_EVENT_LOOP`, as the shipped processes read it, resolved
    ('uvloop' or 'asyncio'), so a report says what actually ran."""
    ensure_repo_on_path()
    from harmonaize.event_loop import resolve_event_loop

    return resolve_event_loop(os.environ.get("HZ_EVENT_LOOP", "auto"))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of `values`; NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Iterable[float]) -> float:
    data = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(data) if data else math.nan


def ratio(a: float, b: float) -> float:
    if b is None or a is None or math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


class Deadline:
    """A monotonic time budget: `expired` once `seconds` have passed since creation."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.end

    @property
    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


def fmt(value: Any, unit: str = "") -> str:
    """Compact number formatting for the tables."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, str):
        return value
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "ms":
        return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 100 else f"{value:.0f}"
    if unit == "/s":
        return f"{value:,.0f}"
    if unit == "s":
        return f"{value:.3f}"
    return f"{value}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, cell in enumerate(cells):
            out.append(str(cell).ljust(widths[i]) if i == 0 else str(cell).rjust(widths[i]))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def package_version(dist: str) -> str:
    """The installed version of a distribution, or '?' (the JSON records what each figure was measured with)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def machine_line() -> str:
    cpus = os.cpu_count()
    return (f"{platform.node() or 'host'}: {cpus} CPUs, Python {platform.python_version()}, "
            f"{platform.system()} {platform.release()}")


def git_state() -> str:
    """The commit the measured code is at, and whether tracked files differ from it (figures belong to a tree)."""
    import subprocess

    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "not a git checkout"
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def loadavg() -> str:
    """1-minute load average (Linux), to tell a quiet machine from a busy one in the report."""
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def proc_cpu_seconds(pid: int | None) -> float:
    """user + system CPU seconds used so far by process `pid` (Linux /proc), NaN where unavailable."""
    if pid is None:
        return math.nan
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return math.nan


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all cores, everything but idle and I/O wait; Linux /proc/stat),
    NaN where unavailable: beside a process's own CPU it tells whether the machine, not the process, was the limit."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return math.nan
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    # guest time is already counted in user time: only the first eight fields add up to the total
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def write_json(path: str, payload: dict[str, Any]) -> None:
    text = json.dumps(payload, indent=2, default=_json_default, allow_nan=False)
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def clean_nan(value: Any) -> Any:
    """NaN is not JSON: turn it into null, recursively."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: clean_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_nan(v) for v in value]
    return value
