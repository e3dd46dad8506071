"""The hang detector: from what a node's workers write about themselves, is the node hung?

A host that stops heartbeating is the fleet monitor's. This is the other hang, on a healthy host: a job's node whose
processes stopped running (SIGSTOP, a native call that holds the GIL for good) or whose own code never gets back to
the next step, while its peers wait for it inside a collective. It reads the node's liveness files (`NodeLiveness`,
one per worker) and times what it *sees change* on the launcher's own clock, so no clock has to agree with another
and a launcher that was itself paused sees fresh beats, not a silence, when it resumes. Two rules:

- **frozen**: a worker's beat counter has not moved for `max(5 s, 3 x step time)`. Its beat thread runs while the
  worker waits on a peer, so only a process none of whose threads run is silent. 5 s is fifty beats: a busy host
  delays a thread by a fraction of a second, not five. Three step times leave room for a step whose native call keeps
  the GIL (the beat thread cannot run meanwhile). Judged in every phase: a stopped process is not checkpointing either.
- **stopped**: a worker's process is stopped by a signal (the launcher reads its state in /proc) for `stopped_s`
  (0.3 s). A stopped process runs no thread at all, so this is the frozen case seen directly and at once, without
  waiting out a bound made for busy machines; 0.3 s lets a stop-and-continue of job control pass. The verdict is
  `frozen`, like the silence it would otherwise become.
- **stalled**: a worker stays in the script phase (its own loop between steps, where the runtime waits on nobody)
  with neither its step nor its phase moving for `max(60 s, 20 x step time)`. Twenty steps: a slow step or a log
  flush is not a hang. 60 s: longer than a training loop normally spends between two steps, and far shorter than
  torch's collective timeouts (10 to 30 min), the only other way out of the hang.

Not judged as stalled: the waiting phases (rendezvous and resume, the step with the collectives the plan puts in it,
the step-boundary agreement, a checkpoint, stopping). A live worker there may be waiting on a peer, and from one host a
waiter cannot be told from the culprit; the culprit's own host catches it (frozen, or stuck in its own code). A job
whose processes all run but sit in a collective that never completes needs the job-wide view; the node failure
report and event this detector feeds are the path such a job-level detector would use.

Besides verdicts, the detector says how long the node's workers have been *waiting*: beating, their step and phase
unmoved, for longer than `max(0.5 s, 5 x step time)`. That is no verdict on this node (its workers run; most likely a
peer does not), but the agent says so in its heartbeat, and the fleet monitor, seeing a host of the same job silent
at that moment, declares that host down at once instead of after the full heartbeat window.

The step time is the median the workers report (the slowest worker's); before a second step none is known and the
floors apply. Pure: no I/O, the clock injected, so tests script time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from harmonaize.job_runtime import NodeLiveness, NodePhase
from harmonaize.node_failures import NodeFailureReason

__all__ = ["HangBounds", "HangDetector", "HangVerdict"]


@dataclass(frozen=True)
class HangBounds:
    """How long a worker may be silent (frozen) or stand still between steps (stalled): a floor, or that many steps."""

    frozen_floor_s: float = 5.0
    frozen_steps: float = 3.0
    stopped_s: float = 0.3
    stalled_floor_s: float = 60.0
    stalled_steps: float = 20.0
    peer_wait_floor_s: float = 0.5
    peer_wait_steps: float = 5.0

    def frozen_after(self, step_time_s: float | None) -> float:
        return max(self.frozen_floor_s, self.frozen_steps * (step_time_s or 0.0))

    def stalled_after(self, step_time_s: float | None) -> float:
        return max(self.stalled_floor_s, self.stalled_steps * (step_time_s or 0.0))

    def waiting_after(self, step_time_s: float | None) -> float:
        return max(self.peer_wait_floor_s, self.peer_wait_steps * (step_time_s or 0.0))


@dataclass(frozen=True)
class HangVerdict:
    """Why the node is hung: which worker, doing what, silent or still for how long against which bound."""

    reason: NodeFailureReason
    local_rank: int
    pid: int
    step: int
    phase: NodePhase
    for_s: float
    bound_s: float
    stopped: bool = False
    """Seen stopped by a signal (rather than silent)."""

    def describe(self) -> str:
        what = "no step" if self.reason is NodeFailureReason.STALLED else "stopped" if self.stopped else "no beat"
        return (
            f"local rank {self.local_rank} (pid {self.pid}) {self.reason.value}: {what} for {self.for_s:.1f} s "
            f"(bound {self.bound_s:.1f} s) at step {self.step}, phase {self.phase.value}"
        )


@dataclass
class _Seen:
    pid: int
    beats: int
    beat_at: float
    mark: tuple[int, int]
    mark_at: float
    stopped_at: float | None = None


class HangDetector:
    """One node's judge; feed it every read of the node's liveness records (`observe`)."""

    def __init__(self, bounds: HangBounds | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.bounds = bounds or HangBounds()
        self._clock = clock
        self._seen: dict[int, _Seen] = {}
        self._step_time: float | None = None

    def waiting(self) -> bool:
        """Whether a worker beats (within the last second) but has not moved its step or phase for the peer-wait
        bound: it is blocked, most likely on a peer. Judged on the last `observe`d records."""
        now = self._clock()
        bound = self.bounds.waiting_after(self._step_time)
        return any(now - seen.beat_at < 1.0 and now - seen.mark_at > bound for seen in self._seen.values())

    def observe(self, records: Iterable[NodeLiveness], *, stopped: Collection[int] = ()) -> HangVerdict | None:
        """Take in one read of the node's records (live workers only) and which of their pids are stopped by a
        signal now; a verdict once one of them is hung."""
        now = self._clock()
        current = sorted(records, key=lambda record: record.local_rank)
        for gone in set(self._seen) - {record.local_rank for record in current}:
            del self._seen[gone]
        step_times = [record.step_time_s for record in current if record.step_time_s is not None]
        step_time = self._step_time = max(step_times) if step_times else None
        verdicts: list[HangVerdict] = []
        for record in current:
            mark = (record.step, record.transitions)
            seen = self._seen.get(record.local_rank)
            if seen is None or seen.pid != record.pid:  # a new worker (or a restarted one): start timing it now
                self._seen[record.local_rank] = _Seen(record.pid, record.beats, now, mark, now)
                continue
            if record.beats != seen.beats:
                seen.beats, seen.beat_at = record.beats, now
            if mark != seen.mark:
                seen.mark, seen.mark_at = mark, now
            if record.pid not in stopped:
                seen.stopped_at = None
            elif seen.stopped_at is None:
                seen.stopped_at = now
            elif now - seen.stopped_at > self.bounds.stopped_s:
                verdicts.append(self._verdict(NodeFailureReason.FROZEN, record, now - seen.stopped_at,
                                              self.bounds.stopped_s, stopped=True))
                continue
            silent, bound = now - seen.beat_at, self.bounds.frozen_after(step_time)
            if silent > bound:
                verdicts.append(self._verdict(NodeFailureReason.FROZEN, record, silent, bound))
                continue
            still, bound = now - seen.mark_at, self.bounds.stalled_after(step_time)
            if record.phase is NodePhase.SCRIPT and still > bound:
                verdicts.append(self._verdict(NodeFailureReason.STALLED, record, still, bound))
        return verdicts[0] if verdicts else None

    @staticmethod
    def _verdict(
        reason: NodeFailureReason, record: NodeLiveness, for_s: float, bound_s: float, *, stopped: bool = False
    ) -> HangVerdict:
        return HangVerdict(
            stopped=stopped,
            reason=reason, local_rank=record.local_rank, pid=record.pid, step=record.step, phase=record.phase,
            for_s=for_s, bound_s=bound_s,
        )
