"""The hang detector's rules on a scripted clock: frozen (no beat) in any phase, stalled (no step back from the
script's own code), both against bounds from the job's step time; waiting phases never count as stalled."""

from __future__ import annotations

from typing import Any

import pytest

from harmonaize.job_runtime import NodeLiveness, NodePhase
from harmonaize.node_failures import NodeFailureReason
from provider_agents.hang_detector import HangBounds, HangDetector
from tests.support import ManualClock


def record(**fields: Any) -> NodeLiveness:
    values: dict[str, Any] = {
        "tenant": "acme", "job": "train", "epoch": 3, "local_rank": 0, "pid": 4242, "beats": 1, "step": 10,
        "phase": NodePhase.SCRIPT, "transitions": 5, "step_time_s": None,
    }
    return NodeLiveness(**{**values, **fields})


def run(detector: HangDetector, clock: ManualClock, seconds: float, make: Any, *, every: float = 0.5) -> list[Any]:
    """Observe every `every` s for `seconds`; `make(i)` gives the records of read `i`. Returns the verdicts seen."""
    verdicts = []
    for i in range(round(seconds / every)):
        clock.now += every
        verdict = detector.observe(make(i))
        if verdict is not None:
            verdicts.append((clock.now, verdict))
    return verdicts


def test_bounds_are_a_floor_or_a_multiple_of_the_step_time() -> None:
    bounds = HangBounds()
    assert (bounds.frozen_after(None), bounds.stalled_after(None)) == (5.0, 60.0)
    assert (bounds.frozen_after(0.1), bounds.stalled_after(0.1)) == (5.0, 60.0)
    assert (bounds.frozen_after(4.0), bounds.stalled_after(4.0)) == (12.0, 80.0)


@pytest.mark.parametrize("phase", list(NodePhase))
def test_a_silent_worker_is_frozen_once_its_beat_is_older_than_the_bound_in_any_phase(phase: NodePhase) -> None:
    clock = ManualClock(1000)
    detector = HangDetector(clock=clock)
    assert detector.observe([record(phase=phase, beats=7)]) is None
    started = clock.now
    verdicts = run(detector, clock, 8.0, lambda i: [record(phase=phase, beats=7)])
    first_at, verdict = verdicts[0]
    assert first_at - started == pytest.approx(5.5), "declared at the first read past 5 s"
    assert (verdict.reason, verdict.phase, verdict.step, verdict.bound_s) == (NodeFailureReason.FROZEN, phase, 10, 5.0)
    assert "no beat for 5.5 s (bound 5.0 s)" in verdict.describe()


def test_the_frozen_bound_grows_with_a_slow_jobs_step_time() -> None:
    clock = ManualClock(1000)
    detector = HangDetector(clock=clock)
    slow = {"beats": 3, "step_time_s": 4.0, "phase": NodePhase.STEP}
    detector.observe([record(**slow)])
    verdicts = run(detector, clock, 14.0, lambda i: [record(**slow)])
    assert verdicts[0][0] - 1000.0 == pytest.approx(12.5) and verdicts[0][1].bound_s == 12.0


@pytest.mark.parametrize(
    "phase", [NodePhase.STARTING, NodePhase.STEP, NodePhase.AGREEMENT, NodePhase.CHECKPOINT, NodePhase.STOPPING]
)
def test_a_beating_worker_that_waits_is_never_stalled(phase: NodePhase) -> None:
    """A worker blocked on a frozen peer (in a collective, a checkpoint, a rendezvous) keeps beating: not hung."""
    clock = ManualClock(1000)
    detector = HangDetector(clock=clock)
    assert run(detector, clock, 600.0, lambda i: [record(phase=phase, beats=i + 1)]) == []


def test_a_worker_stuck_in_its_own_code_is_stalled_after_the_bound() -> None:
    clock = ManualClock(1000)
    detector = HangDetector(clock=clock)
    verdicts = run(detector, clock, 70.0, lambda i: [record(beats=i + 1, step_time_s=0.2)])
    first_at, verdict = verdicts[0]
    assert first_at - 1000.0 == pytest.approx(61.0), "the first read sets the mark, 60 s later it is stalled"
    assert (verdict.reason, verdict.bound_s, verdict.step) == (NodeFailureReason.STALLED, 60.0, 10)

    slow = HangDetector(clock=clock)
    started = clock.now
    verdicts = run(slow, clock, 100.0, lambda i: [record(beats=i + 1, step_time_s=4.5)])
    assert verdicts[0][0] - started == pytest.approx(91.0) and verdicts[0][1].bound_s == 90.0


def test_steps_and_phase_changes_keep_a_worker_from_stalling() -> None:
    clock = ManualClock(1000)
    detector = HangDetector(clock=clock)
    stepping = run(detector, clock, 300.0, lambda i: [record(beats=i + 1, step=10 + i // 100)])
    assert stepping == [], "a step every 50 s is slow, not stalled"
    moving = run(detector, clock, 300.0, lambda i: [record(beats=i + 1, step=20, transitions=i // 100)])
    assert moving == [], "back in the script after a step's phases: the mark moved"


def test_a_restarted_worker_is_timed_afresh_and_a_gone_one_forgotten() -> None:
    clock = ManualClock(1000)
    detector = HangDetector(clock=clock)
    run(detector, clock, 4.0, lambda i: [record(beats=1)])
    assert detector.observe([record(beats=1, pid=5000)]) is None, "a new pid (torchrun restarted the worker)"
    assert run(detector, clock, 4.5, lambda i: [record(beats=1, pid=5000)]) == []
    assert detector.observe([]) is None
    assert run(detector, clock, 4.5, lambda i: [record(beats=1, pid=5000)]) == [], "forgotten while gone"


def test_a_paused_reader_sees_fresh_beats_not_a_silence() -> None:
    """The agent itself stalled for 30 s (its own clock jumped): the beats moved meanwhile, so nobody is frozen."""
    clock = ManualClock(1000)
    detector = HangDetector(clock=clock)
    detector.observe([record(beats=1, phase=NodePhase.STEP)])
    clock.now += 30.0
    assert detector.observe([record(beats=61, phase=NodePhase.STEP)]) is None


def test_one_frozen_worker_among_beating_ones_is_named() -> None:
    clock = ManualClock(1000)
    detector = HangDetector(clock=clock)

    def node(i: int) -> list[NodeLiveness]:
        return [
            record(local_rank=0, pid=100, beats=i + 1, phase=NodePhase.AGREEMENT),
            record(local_rank=1, pid=101, beats=1, phase=NodePhase.STEP),
            record(local_rank=2, pid=102, beats=i + 1, phase=NodePhase.AGREEMENT),
        ]

    _, verdict = run(detector, clock, 6.0, node)[0]
    assert (verdict.local_rank, verdict.pid, verdict.reason) == (1, 101, NodeFailureReason.FROZEN)
    assert verdict.describe().startswith("local rank 1 (pid 101) frozen")


def test_a_worker_seen_stopped_is_frozen_after_the_short_bound_and_a_continue_resets_it() -> None:
    clock = ManualClock(1000)
    detector = HangDetector(clock=clock)
    beating = iter(range(100, 1000))
    assert detector.observe([record(beats=next(beating))], stopped={4242}) is None  # first sight: timing starts
    clock.now += 0.2
    assert detector.observe([record(beats=next(beating))], stopped={4242}) is None, "stopped, not yet for 0.3 s"
    clock.now += 0.1
    assert detector.observe([record(beats=next(beating))], stopped=set()) is None, "continued: the stop is over"
    clock.now += 0.1
    assert detector.observe([record(beats=next(beating))], stopped={4242}) is None, "stopped again: timed afresh"
    clock.now += 0.25
    assert detector.observe([record(beats=next(beating))], stopped={4242}) is None
    clock.now += 0.25
    verdict = detector.observe([record(beats=next(beating))], stopped={4242})
    assert verdict is not None and (verdict.reason, verdict.stopped) == (NodeFailureReason.FROZEN, True)
    assert "stopped for 0.5 s (bound 0.3 s)" in verdict.describe(), "although its beat counter kept moving"


def test_a_beating_worker_whose_step_stands_still_is_waiting_after_the_peer_wait_bound_but_not_hung() -> None:
    """Waiting is no verdict (the fleet monitor weighs it against a silent host of the job), only a short signal:
    max(0.5 s, 5 step times) without a step while the worker still beats; a step or a silence ends it."""
    clock = ManualClock(1000)
    detector = HangDetector(clock=clock)
    assert HangBounds().waiting_after(None) == 0.5 and HangBounds().waiting_after(0.2) == 1.0
    stepping = [detector.observe([record(beats=i, step=i, step_time_s=0.05, phase=NodePhase.STEP)]) for i in range(5)]
    assert stepping == [None] * 5 and not detector.waiting()
    blocked = run(detector, clock, 0.4, lambda i: [record(beats=10 + i, step=4, step_time_s=0.05,
                                                          phase=NodePhase.STEP)], every=0.1)
    assert blocked == [] and not detector.waiting(), "0.4 s without a step: within the bound"
    clock.now += 0.2
    detector.observe([record(beats=20, step=4, step_time_s=0.05, phase=NodePhase.STEP)])
    assert detector.waiting()
    detector.observe([record(beats=21, step=5, step_time_s=0.05, phase=NodePhase.STEP)])
    assert not detector.waiting(), "a step ends the wait"
    clock.now += 2.0  # no read for 2 s: no fresh beat, so not waiting (a silent worker is the frozen rule's)
    assert not detector.waiting()
