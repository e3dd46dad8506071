"""The job lifecycle as an explicit transition table: every allowed (phase, event) pair and where it leads.

A job's phase (`harmonaize.jobs.JobPhase`, stored on the job and shown in its status) changes only through `advance`,
in the transaction that changes what it describes:

- a new placement epoch (`host_assignments`: whatever changes the job's node set or plan, i.e. an accepted
  agreement, an admin allocation, a reservation's start, a host down, a hung node taken out): `NEW_EPOCH` while
  workers remain, else `RELEASED_ALL` (an agreed change: graceful restart) or `LOST_ALL` (a failure: immediate);
- a progress report from the job's current epoch (`job_progress`): `PROGRESS`, or `FINISH` for the run's final
  report; a report from an epoch the job has left says nothing about where it stands now and is no event;
- a node of the current epoch out of restarts (`node_failures`): `GIVE_UP`. A hung node is taken out of its job,
  which is a new epoch (or the loss of its last worker) instead.

Reports from hosts arrive at least once and possibly out of order, so the table keeps the phase where a late report
cannot move it (a report from before a node was given up leaves the job failed). Anything not in the table is
refused with `InvalidJobTransitionError` (409): it would mean the control plane lost track of the job.

How a new epoch reaches the job's nodes, and the trainer resumes from its checkpoint, is the node launcher's to
describe (`provider_agents.node_launcher`); the node's own states are `provider_agents.node_lifecycle`'s.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

from sqlalchemy import ColumnElement, case, literal

from api.models import Job
from api.services.errors import ConflictError
from harmonaize.desired_state import RestartMode
from harmonaize.jobs import JobPhase

__all__ = [
    "TRANSITIONS", "InvalidJobTransitionError", "JobEvent", "advance", "epoch_event", "next_phase", "phase_after",
]


class JobEvent(enum.StrEnum):
    NEW_EPOCH = "new_epoch"
    """The job's node set or plan changed and it keeps workers placed: its nodes (re)start in a new epoch."""
    RELEASED_ALL = "released_all"
    """An agreed change (or the provider's admin) left the job no worker placed now; reserved ones may start later."""
    LOST_ALL = "lost_all"
    """Failures (a host down, a hung node) took the job's last placed worker."""
    PROGRESS = "progress"
    """A progress report from the job's current epoch."""
    FINISH = "finish"
    """The final report of the current epoch: the training run ended on its own."""
    GIVE_UP = "give_up"
    """A node of the current epoch kept failing and its launcher stopped restarting it."""


_P = JobPhase
_E = JobEvent

TRANSITIONS: Final[Mapping[tuple[JobPhase, JobEvent], JobPhase]] = {
    # Workers placed (at creation, by an agreement, or reserved ones whose start came): their nodes start.
    (_P.PENDING, _E.NEW_EPOCH): _P.PLACED,
    # Capacity reserved for a later start (or a reservation changed): still nothing runs.
    (_P.PENDING, _E.RELEASED_ALL): _P.PENDING,
    # Only reserved workers were lost (nothing ran, nothing failed): the tenant negotiates again.
    (_P.PENDING, _E.LOST_ALL): _P.PENDING,
    # A report about an epoch in which nothing was placed (no node of the provider's wrote it): changes nothing.
    (_P.PENDING, _E.PROGRESS): _P.PENDING,
    # As above, for a final report.
    (_P.PENDING, _E.FINISH): _P.PENDING,
    # The first report of the epoch: the nodes rendezvoused and train.
    (_P.PLACED, _E.PROGRESS): _P.RUNNING,
    # Reshaped before its first report: the nodes start again, in the new epoch.
    (_P.PLACED, _E.NEW_EPOCH): _P.PLACED,
    # Scaled to none (or deferred) before it ran.
    (_P.PLACED, _E.RELEASED_ALL): _P.PENDING,
    # Every node failed before the job ran.
    (_P.PLACED, _E.LOST_ALL): _P.FAILED,
    # A run short enough to end before any other report reached the control plane.
    (_P.PLACED, _E.FINISH): _P.FINISHED,
    # A node could not start (import, rendezvous or resume kept failing): its peers wait for it in vain.
    (_P.PLACED, _E.GIVE_UP): _P.FAILED,
    # Steps go on.
    (_P.RUNNING, _E.PROGRESS): _P.RUNNING,
    # An agreement, a host down or a hung node moved the epoch: the nodes restart and resume from the checkpoint.
    (_P.RUNNING, _E.NEW_EPOCH): _P.RESTARTING,
    # Scaled to none (or deferred) by an agreement: its nodes checkpoint and stop.
    (_P.RUNNING, _E.RELEASED_ALL): _P.PENDING,
    # Failures took its last worker: nothing runs, the tenant decides (a replacement, or give up).
    (_P.RUNNING, _E.LOST_ALL): _P.FAILED,
    # The training run ended (its last step, or the script closed it).
    (_P.RUNNING, _E.FINISH): _P.FINISHED,
    # A node out of restarts: the job stands still in this epoch until the epoch moves on.
    (_P.RUNNING, _E.GIVE_UP): _P.FAILED,
    # The trainer resumed in the new epoch and reports from it.
    (_P.RESTARTING, _E.PROGRESS): _P.RUNNING,
    # The epoch moved again before the restart reported (e.g. a second host down).
    (_P.RESTARTING, _E.NEW_EPOCH): _P.RESTARTING,
    # Scaled to none while restarting.
    (_P.RESTARTING, _E.RELEASED_ALL): _P.PENDING,
    # The survivors failed too.
    (_P.RESTARTING, _E.LOST_ALL): _P.FAILED,
    # Resumed at its last step and ended at once.
    (_P.RESTARTING, _E.FINISH): _P.FINISHED,
    # A node cannot come back in the new epoch.
    (_P.RESTARTING, _E.GIVE_UP): _P.FAILED,
    # The final report again (the runtime writes it at its last boundary and when it closes), or a later one.
    (_P.FINISHED, _E.FINISH): _P.FINISHED,
    # An earlier report of the same step, relayed late: the run is still over.
    (_P.FINISHED, _E.PROGRESS): _P.FINISHED,
    # The job keeps its placement after its run; a new epoch starts its nodes again from the last checkpoint (they
    # report finished again if nothing is left to run).
    (_P.FINISHED, _E.NEW_EPOCH): _P.RESTARTING,
    # The tenant releases a finished job's workers.
    (_P.FINISHED, _E.RELEASED_ALL): _P.FINISHED,
    # Its hosts failed after the run was over.
    (_P.FINISHED, _E.LOST_ALL): _P.FINISHED,
    # A node failed after the run ended (e.g. at its teardown): the run is over all the same.
    (_P.FINISHED, _E.GIVE_UP): _P.FINISHED,
    # The tenant's replacement, a smaller size or a host outage moved the epoch on: the nodes restart and resume.
    (_P.FAILED, _E.NEW_EPOCH): _P.RESTARTING,
    # The tenant scaled the failed job to none.
    (_P.FAILED, _E.RELEASED_ALL): _P.PENDING,
    # What was left of it failed as well.
    (_P.FAILED, _E.LOST_ALL): _P.FAILED,
    # A report from before the node was given up, relayed late: the job still stands still.
    (_P.FAILED, _E.PROGRESS): _P.FAILED,
    # The run had ended before the failure mattered (the two reports crossed).
    (_P.FAILED, _E.FINISH): _P.FINISHED,
    # Another node of the same epoch given up.
    (_P.FAILED, _E.GIVE_UP): _P.FAILED,
}


class InvalidJobTransitionError(ConflictError):
    """The event is not allowed in the job's current phase; nothing changed."""

    def __init__(self, phase: JobPhase, event: JobEvent) -> None:
        super().__init__(f"job is {phase.value}: cannot {event.value}")
        self.phase = phase
        self.event = event


def next_phase(phase: JobPhase, event: JobEvent) -> JobPhase:
    """Where `event` leads from `phase`, or InvalidJobTransitionError."""
    try:
        return TRANSITIONS[(phase, event)]
    except KeyError:
        raise InvalidJobTransitionError(phase, event) from None


def advance(job: Job, event: JobEvent) -> JobPhase:
    """Move `job` to the phase `event` leads to (no flush: the caller's transaction), or raise without changing it."""
    job.phase = next_phase(job.phase, event)
    return job.phase


def phase_after(event: JobEvent) -> ColumnElement[JobPhase]:
    """The phase `event` leads to, as SQL over the job row's stored phase: an UPDATE can move it without the row
    being read first (a new epoch's, which the ledger writes with the rest of the row).

    Only for an event every phase has a transition for (a new epoch's three), since SQL cannot refuse one.
    """
    column = Job.__table__.c.phase
    targets = {phase: TRANSITIONS.get((phase, event)) for phase in JobPhase}
    missing = [phase.value for phase, target in targets.items() if target is None]
    if missing:
        raise ValueError(f"{event.value} has no transition from {missing}: it cannot be applied in SQL")
    return case(
        *[(column == phase, literal(target, column.type)) for phase, target in targets.items()], else_=column
    )


def epoch_event(*, workers_placed: bool, restart: RestartMode) -> JobEvent:
    """The event a new placement epoch is: workers remain, or none, by an agreed change (graceful) or a failure."""
    if workers_placed:
        return JobEvent.NEW_EPOCH
    return JobEvent.LOST_ALL if restart is RestartMode.IMMEDIATE else JobEvent.RELEASED_ALL
