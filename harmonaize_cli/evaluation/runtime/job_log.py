"""A training job's progress as its rank 0 logs it, and the reliability accounting read from it.

The example jobs' rank 0 logs `HH:MM:SS.mmm workloads.examples INFO step=N loss=X world=W plan=P` after every step
(`--log-every 1`; `workloads.examples.common`). The same lines are written whether the job runs under plain torchrun
or as an in-place job of the local cloud, and rank 0 may move between nodes (a restart, an in-place re-formation),
so a job's progress is the union of every node log's step lines in time order. Every figure of the reliability
scenario is read from those lines on the wall clock, the same way in both arms:

* steps lost around a failure: each time the logged step goes back (a step logged again), the steps between the one
  resumed from and the last logged before it (`steps_lost`);
* recovery: from the failure to the first step done after it (`recovery_step`);
* the healthy step time: the median time between two consecutive steps (`median_step_s`);
* the effective training time ratio (`ettr`), the time to a step (`first_reaching`) and to a smoothed target loss
  (`first_smoothed_under`).
"""

from __future__ import annotations

import datetime as dt
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean, median

__all__ = [
    "STANDBY_TEXT",
    "LogWatcher",
    "StepLine",
    "clock_time",
    "ettr",
    "first_reaching",
    "first_smoothed_under",
    "first_step_after",
    "last_step_before",
    "median_step_s",
    "parse_step_line",
    "recovery_step",
    "steps_lost",
]

STEP_RE = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) workloads\.examples INFO step=(\d+) loss=(\S+) world=(\d+)")
LEAVING_RE = re.compile(r"\] leaving the job at step (\d+)")
"""What a node leaving an in-place job logs before its last line: its rank 0, if it was, logs that step once more
(the script's final line), after or before the new group's rank 0 logged it. That line is not a step done again."""
STANDBY_TEXT = "standing by for an open offer"
IN_FLIGHT_S = 0.05
"""A step logged this soon after a failure finished before it (`recovery_step`)."""
"""What a warm joiner of an in-place job logs once its model is built and it waits for the accept."""


@dataclass(frozen=True)
class StepLine:
    """One step as rank 0 logged it: when (epoch seconds), which step, at what world size, from which log."""

    ts: float
    step: int
    world: int
    loss: float
    source: str


def clock_time(text: str, ref: float) -> float:
    """`HH:MM:SS.fff` (local time, no date) -> epoch seconds, on the day that puts it nearest to `ref`."""
    hms, _, frac = text.partition(".")
    h, m, s = (int(x) for x in hms.split(":"))
    base = dt.datetime.fromtimestamp(ref).astimezone()
    best = math.inf
    for shift in (-1, 0, 1):
        day = base + dt.timedelta(days=shift)
        stamp = day.replace(hour=h, minute=m, second=s, microsecond=0).timestamp() + float("0." + (frac or "0"))
        if abs(stamp - ref) < abs(best - ref):
            best = stamp
    return best


def parse_step_line(line: str, source: str, ref: float) -> StepLine | None:
    """The step line's fields, or None for any other line (`ref`: a wall-clock time near the line's)."""
    match = STEP_RE.match(line)
    if match is None:
        return None
    try:
        loss = float(match[3])
    except ValueError:
        loss = math.nan
    return StepLine(ts=clock_time(match[1], ref), step=int(match[2]), world=int(match[4]), loss=loss, source=source)


class LogWatcher:
    """Reads what was appended to the logs under `root` matching `patterns` since the last poll.

    Keeps every step line (`steps`, in time order) but a leaving node's repeat of its last step (`LEAVING_RE`), and
    when a warm joiner's log first said it stands by (`standby_seen`: the wall-clock time of that poll, per log)."""

    def __init__(self, root: Path, patterns: tuple[str, ...]) -> None:
        self.root = root
        self.patterns = patterns
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._steps: list[StepLine] = []
        self._sorted = True
        self._leaving: dict[str, int] = {}
        self.standby_seen: dict[str, float] = {}

    def poll(self, now: float | None = None) -> None:
        ref = time.time() if now is None else now
        for pattern in self.patterns:
            for path in sorted(self.root.glob(pattern)):
                try:
                    with open(path, "rb") as handle:
                        handle.seek(self._offsets.get(path, 0))
                        data = handle.read()
                except OSError:
                    continue
                if not data:
                    continue
                self._offsets[path] = self._offsets.get(path, 0) + len(data)
                data = self._partial.pop(path, b"") + data
                lines = data.split(b"\n")
                if lines[-1]:
                    self._partial[path] = lines[-1]
                source = str(path.relative_to(self.root))
                for raw in lines[:-1]:
                    text = raw.decode(errors="replace")
                    step = parse_step_line(text, source, ref)
                    if step is not None:
                        if self._leaving.get(source) == step.step:  # a leaving node's last words
                            del self._leaving[source]
                            continue
                        if self._steps and step.ts < self._steps[-1].ts:
                            self._sorted = False
                        self._steps.append(step)
                    elif (leaving := LEAVING_RE.search(text)) is not None:
                        self._leaving[source] = int(leaving[1])
                    elif STANDBY_TEXT in text:
                        self.standby_seen.setdefault(source, ref)

    @property
    def steps(self) -> list[StepLine]:
        """Every step line seen so far, in time order (ties: in the order read)."""
        if not self._sorted:
            self._steps.sort(key=lambda line: line.ts)
            self._sorted = True
        return self._steps

    def last(self) -> StepLine | None:
        steps = self.steps
        return steps[-1] if steps else None

    def standby_after(self, after: float) -> bool:
        """Whether a warm joiner's log first said it stands by at or after `after` (wall clock)."""
        return any(seen >= after for seen in self.standby_seen.values())


def first_step_after(steps: list[StepLine], after: float) -> StepLine | None:
    """The first step logged strictly after `after` (steps in time order)."""
    for line in steps:
        if line.ts > after:
            return line
    return None


def recovery_step(steps: list[StepLine], failed: float) -> StepLine | None:
    """The first step done after a failure at `failed`: the first logged more than `IN_FLIGHT_S` after it (a line
    logged sooner is the step that was finishing when the host died: its collectives were done, its log line was
    not yet written)."""
    return first_step_after(steps, failed + IN_FLIGHT_S)


def last_step_before(steps: list[StepLine], before: float) -> StepLine | None:
    """The last step logged at or before `before`."""
    found = None
    for line in steps:
        if line.ts > before:
            break
        found = line
    return found


def steps_lost(steps: list[StepLine], start: float, end: float = math.inf) -> int:
    """Steps done twice because of what happened in (start, end]: for every logged step in the window that goes back
    (step b after step a with b <= a: the job resumed from b - 1), the a - (b - 1) steps it must redo.

    A job that re-forms in place goes on at a + 1 and loses nothing; one that restarts from the checkpoint of step c
    logs c + 1 next and loses a - c. Two restarts in a row (a failure, then a late node joining) add up."""
    lost = 0
    previous: StepLine | None = None
    for line in steps:
        if previous is not None and start < line.ts <= end and line.step <= previous.step:
            lost += previous.step - (line.step - 1)
        previous = line
    return lost


def median_step_s(steps: list[StepLine], *, start: float = -math.inf, end: float = math.inf) -> float | None:
    """The median time between two consecutive logged steps (step n, then n + 1) in [start, end]: a healthy step."""
    gaps = [b.ts - a.ts for a, b in zip(steps, steps[1:], strict=False)
            if b.step == a.step + 1 and start <= a.ts and b.ts <= end and b.ts >= a.ts]
    return median(gaps) if gaps else None


def first_reaching(steps: list[StepLine], step: int, *, after: float = -math.inf) -> StepLine | None:
    """The first line logged after `after` at `step` or beyond."""
    for line in steps:
        if line.ts > after and line.step >= step:
            return line
    return None


def first_smoothed_under(steps: list[StepLine], target: float, window: int) -> StepLine | None:
    """The first logged step at which the mean of the last `window` logged losses is at or under `target`: a time to
    a target loss that one lucky step's loss cannot reach on its own."""
    recent: list[float] = []
    for line in steps:
        recent = [*recent[-(window - 1):], line.loss] if window > 1 else [line.loss]
        if len(recent) == window and fmean(recent) <= target:
            return line
    return None


def ettr(*, start: StepLine, end: StepLine, healthy_step_s: float) -> float:
    """Effective training time ratio over [start, end]: the steps kept (end.step - start.step: progress, so a step
    redone counts once) times the healthy step time, over the wall time between the two lines."""
    wall = end.ts - start.ts
    if wall <= 0:
        return math.nan
    return (end.step - start.step) * healthy_step_s / wall
