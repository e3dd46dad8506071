"""A job's node on one host, as its node launcher sees it: the states and an explicit transition table.

The launcher keeps one record per job placed on its host, and moves it only through `next_state`; anything not in
the table is refused with `InvalidNodeTransitionError`, since a launcher that lost track of a node would start a
second one or restart one the control plane is already replacing. A node fails in two ways, both reported to the
control plane (`NodeFailureReport`): `HUNG` (killed at once) and `GIVEN_UP` (out of restarts). Both, and `FINISHED`,
are settled: nothing restarts the node until the job's next epoch.

    placed     --start-->   starting  --beating-->  running
    placed     --adopt-->   running                            (an agent restart keeps what still runs)
    starting | running  --exit_ok-->  finished
    starting | running  --crash-->    restarting  --start-->  starting   (same epoch, up to max_restarts)
    starting | running  --give_up-->  given_up
    running    --hang-->    hung                               (killed at once, reported)
    any but placed  --stop-->  stopping  --stopped-->  stopped  --start-->  starting   (the next epoch)

`STOPPING` and `STOPPED` only outlast one launcher task when a stop or the next start failed; their self-edges let the
next pass try again.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

__all__ = ["TRANSITIONS", "InvalidNodeTransitionError", "NodeEvent", "NodeState", "next_state"]


class NodeState(enum.StrEnum):
    PLACED = "placed"
    """The host's desired state places the job here and no node of it runs yet (a record's state before its first
    start or adoption; never lasts past the call that creates the record)."""
    STARTING = "starting"
    """torchrun spawned for the node's epoch; no worker seen beating yet (imports, rendezvous, resume)."""
    RUNNING = "running"
    """Its workers beat (liveness files), or it was adopted running: the hang detector judges it."""
    RESTARTING = "restarting"
    """Exited with an error and restarts are left: the same epoch's node starts again after a short backoff."""
    HUNG = "hung"
    """Found hung (frozen or stalled), killed and reported; its peers need a new epoch, not a restart."""
    GIVEN_UP = "given_up"
    """Exited with an error once more than `max_restarts` allow; reported."""
    FINISHED = "finished"
    """Exited 0 in its epoch: the job is done (or stopped cleanly on its own)."""
    STOPPING = "stopping"
    """Leaving its epoch on the launcher's order: graceful (SIGTERM, then `grace_s`) or immediate (SIGKILL)."""
    STOPPED = "stopped"
    """Every process of it is gone; the next epoch's node, if any, starts next."""

    @property
    def settled(self) -> bool:
        """Nothing to do in this epoch: the node is not restarted until the epoch moves on."""
        return self in _SETTLED


_SETTLED: Final = frozenset({NodeState.FINISHED, NodeState.GIVEN_UP, NodeState.HUNG})


class NodeEvent(enum.StrEnum):
    START = "start"
    """A torchrun process was spawned for the node's spec."""
    ADOPT = "adopt"
    """A restarted agent found the node's process still carrying its marker."""
    BEATING = "beating"
    """The node's workers were first seen beating."""
    EXIT_OK = "exit_ok"
    """The process exited 0."""
    CRASH = "crash"
    """The process exited with an error (or vanished) and restarts are left."""
    GIVE_UP = "give_up"
    """The process exited with an error and no restart is left."""
    HANG = "hang"
    """The hang detector's verdict."""
    STOP = "stop"
    """The launcher stops the node: a new spec (epoch), no longer placed here, or the agent stopping its nodes."""
    STOPPED = "stopped"
    """Every process of the node is gone."""


_S = NodeState
_E = NodeEvent

TRANSITIONS: Final[Mapping[tuple[NodeState, NodeEvent], NodeState]] = {
    # The job's first node on this host (or the agent restarted and found none of it to adopt).
    (_S.PLACED, _E.START): _S.STARTING,
    # A restarted agent keeps the previous agent's node instead of restarting a healthy job.
    (_S.PLACED, _E.ADOPT): _S.RUNNING,
    # Workers that beat have rendezvoused and run the script: from now on a silence means a hang.
    (_S.STARTING, _E.BEATING): _S.RUNNING,
    # A short job can finish before the watch sees a beat.
    (_S.STARTING, _E.EXIT_OK): _S.FINISHED,
    # An error on the way up (import, rendezvous, resume) counts like any other: restart within max_restarts.
    (_S.STARTING, _E.CRASH): _S.RESTARTING,
    # Out of restarts before ever beating: a node that cannot start is reported like one that keeps failing.
    (_S.STARTING, _E.GIVE_UP): _S.GIVEN_UP,
    # A new epoch (or no placement here) arrived while the node was still starting.
    (_S.STARTING, _E.STOP): _S.STOPPING,
    # The job ended in this epoch: nothing to restart.
    (_S.RUNNING, _E.EXIT_OK): _S.FINISHED,
    # A failing node is restarted into the same epoch's rendezvous; the trainer resumes from its checkpoint.
    (_S.RUNNING, _E.CRASH): _S.RESTARTING,
    # It keeps failing: stop burning restarts and tell the control plane, which shows it in the job's status.
    (_S.RUNNING, _E.GIVE_UP): _S.GIVEN_UP,
    # Its peers are stuck in a collective with it: kill it at once and report it; only a new epoch helps.
    (_S.RUNNING, _E.HANG): _S.HUNG,
    # The usual way out: a new epoch (graceful: checkpoint and exit; immediate: a peer died) or no placement here.
    (_S.RUNNING, _E.STOP): _S.STOPPING,
    # The backoff is over: the same epoch's node again, one failure more.
    (_S.RESTARTING, _E.START): _S.STARTING,
    # The restart could not spawn anything: the next pass tries again (the failure count is unchanged).
    (_S.RESTARTING, _E.CRASH): _S.RESTARTING,
    # A new epoch or no placement here arrived while the restart could not spawn: stop its leftovers.
    (_S.RESTARTING, _E.STOP): _S.STOPPING,
    # The control plane's answer to the report is a new epoch; the hung node's processes were killed already.
    (_S.HUNG, _E.STOP): _S.STOPPING,
    # The next epoch (or no placement here) replaces a node given up in its own epoch.
    (_S.GIVEN_UP, _E.STOP): _S.STOPPING,
    # The next epoch (e.g. after a rescale) starts the job again from its checkpoint.
    (_S.FINISHED, _E.STOP): _S.STOPPING,
    # Every process of the node is gone (after the grace period, whatever was left was killed).
    (_S.STOPPING, _E.STOPPED): _S.STOPPED,
    # A stop cut short by an error: the next pass stops the node again.
    (_S.STOPPING, _E.STOP): _S.STOPPING,
    # The next epoch's node, into a fresh rendezvous sized for the new node set.
    (_S.STOPPED, _E.START): _S.STARTING,
    # The next node could not be started: the next pass stops again (nothing of it runs) and starts, or drops it.
    (_S.STOPPED, _E.STOP): _S.STOPPING,
}


class InvalidNodeTransitionError(RuntimeError):
    """The event is not allowed in the node's current state; the record did not change."""

    def __init__(self, state: NodeState, event: NodeEvent) -> None:
        super().__init__(f"node is {state.value}: cannot {event.value}")
        self.state = state
        self.event = event


def next_state(state: NodeState, event: NodeEvent) -> NodeState:
    """Where `event` leads from `state`, or InvalidNodeTransitionError."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidNodeTransitionError(state, event) from None
