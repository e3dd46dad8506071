"""The node lifecycle's transition table: every edge is accepted, everything else refused, every state reachable
from `placed`, and every edge carries a comment saying why."""

from __future__ import annotations

import inspect
import itertools

import pytest

from provider_agents import node_lifecycle
from provider_agents.node_lifecycle import TRANSITIONS, InvalidNodeTransitionError, NodeEvent, NodeState, next_state


@pytest.mark.parametrize(("state", "event", "to"), [(s, e, t) for (s, e), t in TRANSITIONS.items()])
def test_every_edge_of_the_table_is_accepted(state: NodeState, event: NodeEvent, to: NodeState) -> None:
    assert next_state(state, event) is to


INVALID = [(s, e) for s, e in itertools.product(NodeState, NodeEvent) if (s, e) not in TRANSITIONS]


@pytest.mark.parametrize(("state", "event"), INVALID)
def test_everything_else_is_refused_naming_the_state(state: NodeState, event: NodeEvent) -> None:
    with pytest.raises(InvalidNodeTransitionError, match=f"node is {state.value}: cannot {event.value}") as caught:
        next_state(state, event)
    assert (caught.value.state, caught.value.event) == (state, event)


def test_refusals_that_matter() -> None:
    """A few the launcher must never take: restarting a settled node in its epoch, judging a stopped one, starting a
    second process over a running one, adopting twice."""
    for state, event in [
        (NodeState.HUNG, NodeEvent.START), (NodeState.GIVEN_UP, NodeEvent.START), (NodeState.FINISHED, NodeEvent.START),
        (NodeState.HUNG, NodeEvent.CRASH), (NodeState.STOPPED, NodeEvent.HANG), (NodeState.STARTING, NodeEvent.START),
        (NodeState.RUNNING, NodeEvent.START), (NodeState.RUNNING, NodeEvent.ADOPT), (NodeState.PLACED, NodeEvent.STOP),
    ]:
        assert (state, event) in INVALID


def test_every_state_is_reachable_from_placed_and_only_placed_has_no_way_in() -> None:
    reached, frontier = {NodeState.PLACED}, [NodeState.PLACED]
    while frontier:
        state = frontier.pop()
        for (source, _), target in TRANSITIONS.items():
            if source is state and target not in reached:
                reached.add(target)
                frontier.append(target)
    assert reached == set(NodeState)
    assert {target for target in TRANSITIONS.values()} == set(NodeState) - {NodeState.PLACED}


def test_settled_states_are_the_ones_a_new_epoch_alone_leaves() -> None:
    """Settled: nothing restarts the node in its epoch, so its only way out is a stop."""
    settled = {state for state in NodeState if state.settled}
    assert settled == {NodeState.FINISHED, NodeState.GIVEN_UP, NodeState.HUNG}
    for state in settled:
        assert {event for (source, event) in TRANSITIONS if source is state} == {NodeEvent.STOP}


def test_every_edge_carries_a_comment() -> None:
    lines = inspect.getsource(node_lifecycle).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("TRANSITIONS"))
    end = next(i for i in range(start, len(lines)) if lines[i] == "}")
    edges = [i for i in range(start, end) if lines[i].strip().startswith("(_S.")]
    assert len(edges) == len(TRANSITIONS)
    for i in edges:
        assert lines[i - 1].strip().startswith("# "), f"no comment above {lines[i].strip()}"
