"""Progress reports: global rank 0 rewrites `<control_dir>/progress.json` (a `JobProgress`) at step boundaries.

Throttled, because a step can take a millisecond and the reader (the node launcher, then the tenant) needs a few
updates a second at most; forced right after a resume, a checkpoint, a directive outcome and before exit, because
those are the moments someone waits for. Without a control directory (plain torchrun) nothing is written.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path

from harmonaize.job_runtime import (
    CONTROL_PROGRESS_FILE,
    MAX_OUTCOMES,
    DirectiveOutcome,
    EpochChange,
    JobProgress,
    write_model_atomically,
)
from harmonaize.jobs import Compression, ParallelPlan

__all__ = ["MIN_INTERVAL_S", "ProgressReporter", "ThroughputMeter"]

MIN_INTERVAL_S = 0.2


LOSS_LIMIT = 1e30
"""The contract's bound on a reported loss."""


def reportable_loss(loss: float | None) -> float | None:
    """`loss` if the contract can carry it, else None (a diverged run reports "unknown", not a refused file)."""
    if loss is None or not math.isfinite(loss) or abs(loss) > LOSS_LIMIT:
        return None
    return loss


class ThroughputMeter:
    """Samples per second over the last `window` steps."""

    def __init__(self, window: int = 20, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._marks: deque[tuple[float, int]] = deque(maxlen=window + 1)

    def record(self, samples: int) -> None:
        """One step of `samples` samples (global) just finished."""
        self._marks.append((self._clock(), samples))

    def reset(self) -> None:
        """Forget history (after a pause such as a checkpoint save, which is not training throughput)."""
        self._marks.clear()

    def samples_per_s(self) -> float | None:
        if len(self._marks) < 2:
            return None
        elapsed = self._marks[-1][0] - self._marks[0][0]
        samples = sum(count for _, count in list(self._marks)[1:])
        return samples / elapsed if elapsed > 0 else None


class ProgressReporter:
    """Builds and writes `JobProgress`; a no-op when `control_dir` is None or on ranks other than 0."""

    def __init__(
        self,
        control_dir: Path | None,
        *,
        tenant: str,
        job: str,
        epoch: int,
        enabled: bool,
        outcomes: Iterable[DirectiveOutcome] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = control_dir / CONTROL_PROGRESS_FILE if control_dir is not None and enabled else None
        self.tenant = tenant
        self.job = job
        self.epoch = epoch
        self.outcomes: deque[DirectiveOutcome] = deque(outcomes, maxlen=MAX_OUTCOMES)
        self.plan_note = ""
        """How the plan was laid out (shard groups) or why it fell back; reported with every progress."""
        self._clock = clock
        self._last_write: float | None = None
        self.writes = 0

    def record_outcome(self, outcome: DirectiveOutcome) -> None:
        self.outcomes.append(outcome)

    def report(
        self,
        *,
        force: bool,
        step: int,
        world_size: int,
        parallel_plan: ParallelPlan,
        loss: float | None,
        samples_per_s: float | None,
        resumed_from_step: int | None,
        epoch_step: int | None = None,
        change: EpochChange | None = None,
        pause_s: float | None = None,
        last_checkpoint_step: int | None,
        checkpoint_interval_steps: int,
        compression: Compression,
        powersgd_rank: int | None,
        batch_size: int,
        gradient_accumulation: int,
        directives_version: int,
        finished: bool = False,
    ) -> bool:
        """Write progress if forced or the last write is at least MIN_INTERVAL_S old; True when written."""
        if self.path is None:
            return False
        now = self._clock()
        if not force and self._last_write is not None and now - self._last_write < MIN_INTERVAL_S:
            return False
        progress = JobProgress(
            tenant=self.tenant,
            job=self.job,
            epoch=self.epoch,
            step=step,
            world_size=world_size,
            parallel_plan=parallel_plan,
            plan_note=self.plan_note[:500],
            loss=reportable_loss(loss),
            samples_per_s=samples_per_s,
            resumed_from_step=resumed_from_step,
            epoch_step=epoch_step,
            change=change,
            pause_s=None if pause_s is None else round(pause_s, 4),
            last_checkpoint_step=last_checkpoint_step,
            checkpoint_interval_steps=checkpoint_interval_steps,
            compression=compression,
            powersgd_rank=powersgd_rank,
            batch_size=batch_size,
            gradient_accumulation=gradient_accumulation,
            directives_version=max(0, directives_version),
            outcomes=tuple(self.outcomes),
            finished=finished,
            updated_at=datetime.now(UTC),
        )
        write_model_atomically(self.path, progress)
        self._last_write = now
        self.writes += 1
        return True
