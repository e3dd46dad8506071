"""Liveness beats: every worker tells its host's launcher, through a file, that it runs and where it is.

A daemon thread rewrites `<control_dir>/liveness-<local rank>.json` (a `NodeLiveness`) every beat interval with a
growing beat counter, the current step and phase, and the median time between recent steps. The training loop only
sets attributes (`enter`, `stepped`), so a beat costs the loop nothing. Why a thread and not the loop: a worker
blocked in a collective waiting on a frozen peer must still be told apart from the frozen peer itself; its thread
keeps beating while the peer's, stopped with the whole process, does not. Every worker beats (not only local rank
0), so one frozen worker among a node's several is seen too.

Without a control directory (plain torchrun) nothing is written and no thread starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from harmonaize.job_runtime import (
    LIVENESS_BEAT_INTERVAL_S,
    NodeLiveness,
    NodePhase,
    liveness_path,
    write_model_atomically,
)

__all__ = ["LivenessBeacon"]

STEP_TIME_WINDOW = 20
"""Steps the reported median step time is taken over: long enough to ignore one slow step, short enough to follow a
change of batch size or world size."""

_log = logging.getLogger(__name__)


class LivenessBeacon:
    """One worker's beat, step and phase; `start()` runs the beat thread, `stop()` ends it and removes the file."""

    def __init__(
        self,
        control_dir: Path | None,
        *,
        tenant: str,
        job: str,
        epoch: int,
        local_rank: int,
        interval_s: float = LIVENESS_BEAT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = liveness_path(control_dir, local_rank) if control_dir is not None else None
        self._identity = {"tenant": tenant, "job": job, "epoch": epoch, "local_rank": local_rank, "pid": os.getpid()}
        self._interval_s = interval_s
        self._clock = clock
        self.beats = 0
        self.step = 0
        self.phase = NodePhase.STARTING
        self.transitions = 0
        self._last_step_at: float | None = None
        self._step_times: deque[float] = deque(maxlen=STEP_TIME_WINDOW)
        self.step_time_s: float | None = None
        """Median time between the recent steps (None before the second step)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed_write_logged = False

    def enter(self, phase: NodePhase) -> None:
        """The loop moved to `phase` (the next beat says so)."""
        if phase is not self.phase:
            self.phase = phase
            self.transitions += 1

    def stepped(self, step: int) -> None:
        """Step `step` is done; the time since the previous one joins the median."""
        now = self._clock()
        if self._last_step_at is not None and step > self.step:
            self._step_times.append(now - self._last_step_at)
            self.step_time_s = statistics.median(self._step_times)  # here, not in the thread: one writer of the deque
        self._last_step_at = now
        self.step = step

    def beat(self) -> None:
        """Write one beat now (the thread's work; callable directly)."""
        if self.path is None:
            return
        self.beats += 1
        record = NodeLiveness(
            **self._identity,
            beats=self.beats,
            step=self.step,
            phase=self.phase,
            transitions=self.transitions,
            step_time_s=self.step_time_s,
        )
        try:
            write_model_atomically(self.path, record)
        except OSError as exc:  # a full disk must not kill training; the launcher will see the beat stop
            if not self._failed_write_logged:
                _log.warning("cannot write liveness file %s: %r", self.path, exc)
                self._failed_write_logged = True

    def start(self) -> None:
        if self.path is None or self._thread is not None:
            return
        self.beat()
        self._thread = threading.Thread(target=self._run, name="hz-liveness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread and remove the file: a worker that left on purpose is not a silent one."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.beat()
