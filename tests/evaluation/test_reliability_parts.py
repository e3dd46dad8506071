"""The O5 reliability scenario's parts that need no cloud: the step-log accounting (on log lines captured from real
runs), the seeded event sequence, and the plain torchrun harness killing a node and resuming from its checkpoint."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest

from harmonaize_cli.evaluation.results import COOPERATIVE, STATUS_QUO, ScenarioResult
from harmonaize_cli.evaluation.runtime.job_log import (
    LogWatcher,
    StepLine,
    clock_time,
    ettr,
    first_reaching,
    first_step_after,
    median_step_s,
    parse_step_line,
    recovery_step,
    steps_lost,
)
from harmonaize_cli.evaluation.runtime.reliability import plot_reliability
from harmonaize_cli.evaluation.runtime.reliability_events import (
    CHANNELS,
    DRAWN_CHANNELS,
    LEAD_SCALE,
    EventOutcome,
    RoundRun,
    event_rounds,
)
from harmonaize_cli.evaluation.runtime.torchrun_job import TorchrunJob, reap, run_marker_prefix
from provider_agents.processes import marked_processes

# Rank 0 of a 3-node plain torchrun job (bench: --step-delay-ms 100 --checkpoint-interval 100): the node of another
# rank was killed after step 150; torchrun restarted every worker, which resumed from the checkpoint of step 100.
RESTART_LOG = """\
23:39:58.006 workloads.examples INFO step=98 loss=0.040309 world=3 plan=ddp
23:39:58.125 workloads.examples INFO step=99 loss=0.038241 world=3 plan=ddp
23:39:58.427 workloads.examples INFO step=100 loss=0.039762 world=3 plan=ddp
23:39:58.548 workloads.examples INFO step=101 loss=0.039972 world=3 plan=ddp
23:40:04.159 workloads.examples INFO step=148 loss=0.040158 world=3 plan=ddp
23:40:04.272 workloads.examples INFO step=149 loss=0.037723 world=3 plan=ddp
23:40:04.404 workloads.examples INFO step=150 loss=0.035975 world=3 plan=ddp
I1201 23:40:06.862000 8648 torch/distributed/elastic/agent/server/api.py:942] [default] Worker group FAILED. 3/3 \
attempts left; will restart worker group
23:40:39.163 workloads INFO [rank 0/3] resumed from step-00000100 (world 3, ddp) in 0.25 s
23:40:39.179 workloads INFO [rank 0/3] ready at step 100: world 3, plan ddp, batch 32 x 1, checkpoint every 100 \
(start took 4.80 s)
23:40:39.194 workloads.examples INFO step=101 loss=0.039972 world=3 plan=ddp
23:40:39.318 workloads.examples INFO step=102 loss=0.043803 world=3 plan=ddp
23:40:39.439 workloads.examples INFO step=103 loss=0.039751 world=3 plan=ddp
"""
RESTART_KILLED_AT = "23:40:04.500"

# The same torchrun job in the reliability scenario: a node killed at 00:12:35.966, while rank 0 was logging step 378
# (that step's collectives had completed); the restarted workers resumed from the checkpoint of step 300.
IN_FLIGHT_LOG = """\
00:12:35.742 workloads.examples INFO step=376 loss=0.035216 world=3 plan=ddp
00:12:35.852 workloads.examples INFO step=377 loss=0.035229 world=3 plan=ddp
00:12:35.970 workloads.examples INFO step=378 loss=0.034434 world=3 plan=ddp
I1202 00:12:37.688000 18176 torch/distributed/elastic/agent/server/api.py:942] [default] Worker group FAILED. 2/3 \
attempts left; will restart worker group
00:12:57.452 workloads.examples INFO step=301 loss=0.034587 world=3 plan=ddp
00:12:57.569 workloads.examples INFO step=302 loss=0.034594 world=3 plan=ddp
"""
IN_FLIGHT_KILLED_AT = "00:12:35.966"

# An in-place job of the local cloud (the cooperative arm, 3 hosts, --step-delay-ms 100): host h3 was killed after
# step 137; rank 0 (h1) had its collective interrupted and re-formed with the other survivor, going on at world 2.
IN_PLACE_LOG = """\
23:55:00.764 workloads.examples INFO step=136 loss=0.038530 world=3 plan=ddp
23:55:00.874 workloads.examples INFO step=137 loss=0.041602 world=3 plan=ddp
23:55:00.978 workloads WARNING [rank 0/3] step 137 interrupted: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/\
tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:55728. This is typically caused by a remote worker crashing.
23:55:01.804 workloads.elastic.session WARNING epoch 2 announced urgently (a peer failed): abandoning the collective \
in flight
23:55:01.910 workloads INFO [rank 0/2] epoch 1 -> 2 in place (a peer failed): world 3 -> 2 at step 137, 0.105 s
23:55:01.920 workloads.examples INFO step=138 loss=0.040798 world=2 plan=ddp
23:55:02.033 workloads.examples INFO step=139 loss=0.039070 world=2 plan=ddp
"""
IN_PLACE_KILLED_AT = "23:55:00.900"

# The same job later, moved off h1 before a predicted failure: a joiner on h4 took the state from a live peer, h2
# became rank 0. The leaving rank 0 (h1) logs step 339 once more after the new rank 0 did: the same step, not a redo.
MOVE_LOGS = {
    "h1/node-e1.log": """\
23:55:25.284 workloads.examples INFO step=337 loss=0.034786 world=3 plan=ddp
23:55:25.401 workloads.examples INFO step=338 loss=0.034917 world=3 plan=ddp
23:55:25.514 workloads INFO [rank 0/3] leaving the job at step 339: epoch 4 goes on without this node
23:55:25.551 workloads.examples INFO step=339 loss=0.036595 world=3 plan=ddp
""",
    "h2/node-e1.log": """\
23:55:25.534 workloads INFO [rank 0/3] state at step 339 copied from rank 0 in 0.016 s (1 joiner(s), 2 holder(s))
23:55:25.534 workloads INFO [rank 0/3] epoch 3 -> 4 in place (agreement): world 3 -> 3 at step 339, 0.020 s
23:55:25.537 workloads.examples INFO step=339 loss=0.036595 world=3 plan=ddp
23:55:25.671 workloads.examples INFO step=340 loss=0.038375 world=3 plan=ddp
23:55:25.783 workloads.examples INFO step=341 loss=0.034224 world=3 plan=ddp
""",
    "h4/node-e4.log": """\
23:55:24.415 workloads INFO [rank 0/1] plan: ddp
23:55:25.487 workloads.elastic.session INFO standing by for an open offer until 2026-12-01T23:56:17+00:00: model \
built, waiting for the accept
23:55:25.531 workloads INFO [rank 2/3] joined at step 339 from a live peer (world 3)
""",
}


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _ts(text: str, ref: float) -> float:
    return clock_time(text, ref)


def _ref(text: str) -> float:
    """A wall-clock reference on today's date near `text` (the logs carry no date)."""
    return clock_time(text, time.time())


def test_a_restart_from_the_checkpoint_loses_the_steps_since_it() -> None:
    ref = _ref("23:40:00.000")
    steps = [line for raw in RESTART_LOG.splitlines() if (line := parse_step_line(raw, "node-a.log", ref))]
    assert [line.step for line in steps] == [98, 99, 100, 101, 148, 149, 150, 101, 102, 103]
    assert all(line.world == 3 for line in steps)
    killed = _ts(RESTART_KILLED_AT, ref)
    assert steps_lost(steps, killed) == 50  # resumed from 100 after 150
    assert steps_lost(steps, -math.inf, killed) == 0  # nothing went back before the failure
    first = first_step_after(steps, killed)
    assert first is not None and first.step == 101
    assert first.ts - killed == pytest.approx(34.694, abs=0.002)
    assert first_reaching(steps, 102, after=killed) == steps[-2]
    assert first_reaching(steps, 102) == steps[4]  # step 148, before the failure


def test_the_step_finishing_when_the_host_died_is_not_the_recovery() -> None:
    ref = _ref("00:12:30.000")
    steps = [line for raw in IN_FLIGHT_LOG.splitlines() if (line := parse_step_line(raw, "node-n1.log", ref))]
    killed = _ts(IN_FLIGHT_KILLED_AT, ref)
    assert first_step_after(steps, killed) == steps[2]  # step 378, logged 4 ms after the kill
    recovered = recovery_step(steps, killed)
    assert recovered is not None and recovered.step == 301
    assert recovered.ts - killed == pytest.approx(21.486, abs=0.002)
    assert steps_lost(steps, killed) == 78


def test_an_in_place_reformation_loses_nothing() -> None:
    ref = _ref("23:55:00.000")
    steps = [line for raw in IN_PLACE_LOG.splitlines() if (line := parse_step_line(raw, "h1/node-e1.log", ref))]
    killed = _ts(IN_PLACE_KILLED_AT, ref)
    assert steps_lost(steps, killed) == 0
    first = recovery_step(steps, killed)
    assert first is not None and (first.step, first.world) == (138, 2)
    assert first.ts - killed == pytest.approx(1.020, abs=0.002)


def test_steps_lost_adds_restarts_and_counts_only_its_window() -> None:
    def line(ts: float, step: int) -> StepLine:
        return StepLine(ts=ts, step=step, world=3, loss=0.1, source="x")

    # 10..12, restart from 10 (2 lost), 11..13, a late node joins: restart from 10 again (3 lost), 11
    steps = [line(t, s) for t, s in enumerate([10, 11, 12, 11, 12, 13, 11, 12])]
    assert steps_lost(steps, -1) == 2 + 3
    assert steps_lost(steps, 2.5, 5.5) == 2  # only the first restart is in (2.5, 5.5]
    assert steps_lost(steps, 5.5) == 3


def test_median_step_time_and_ettr() -> None:
    steps = [StepLine(ts=0.1 * i, step=i, world=3, loss=0.0, source="x") for i in range(11)]
    steps += [StepLine(ts=3.0 + 0.1 * i, step=6 + i, world=3, loss=0.0, source="x") for i in range(10)]
    healthy = median_step_s(steps)
    assert healthy == pytest.approx(0.1)
    # 15 steps kept (0 -> 15) x 0.1 s over 3.9 s of wall time
    assert ettr(start=steps[0], end=steps[-1], healthy_step_s=0.1) == pytest.approx(1.5 / 3.9)


def test_the_loss_at_the_target_is_the_mean_of_the_last_losses_up_to_it() -> None:
    run = RoundRun(arm="x", repeat=0, seed=0, index=0, target_step=40)
    run.steps = [StepLine(ts=float(i), step=i, world=3, loss=1.0, source="x") for i in range(1, 31)]
    run.steps += [StepLine(ts=30.0 + i, step=10 + i, world=3, loss=0.5, source="x") for i in range(1, 41)]
    assert run.loss_at_target is None, "not accounted yet: no end"
    run.end = first_reaching(run.steps, run.target_step)  # what `account` sets
    assert run.end is not None and run.end.step == 40 and run.end.ts == 60.0
    # the last LOSS_WINDOW lines up to step 40 (the restart's steps 21..40), not the steps logged after it
    assert run.loss_at_target == pytest.approx(0.5)
    run.end = first_reaching(run.steps, 15)
    assert run.end is not None and run.end.step == 15
    assert run.loss_at_target == pytest.approx(1.0), "before the restart: the first run's losses"


def test_clock_time_picks_the_nearest_day() -> None:
    # just after midnight, a line logged just before it belongs to the previous day
    import datetime as dt

    now = dt.datetime.now().astimezone().replace(hour=0, minute=0, second=5, microsecond=0).timestamp()
    assert clock_time("23:59:59.500", now) == pytest.approx(now - 5.5, abs=1e-3)
    assert clock_time("00:00:06.250", now) == pytest.approx(now + 1.25, abs=1e-3)


def test_the_watcher_reads_appended_lines_across_logs_in_time_order(tmp_path: Path) -> None:
    ref = _ref("23:55:00.000")
    lines = IN_PLACE_LOG.splitlines(keepends=True)
    first = _write(tmp_path / "hosts" / "h1" / "node-e1.log", "".join(lines[:1]) + lines[1][:20])
    watcher = LogWatcher(tmp_path, ("hosts/*/node-e*.log",))
    watcher.poll(ref)
    assert [line.step for line in watcher.steps] == [136]  # the half-written line waits for its end
    with open(first, "a") as log:
        log.write("".join([lines[1][20:], *lines[2:]]))
    _write(tmp_path / "hosts" / "h1" / "other.log", "23:55:09.000 workloads.examples INFO step=999 loss=1 world=1\n")
    watcher.poll(ref)
    assert [(line.step, line.world) for line in watcher.steps] == [(136, 3), (137, 3), (138, 2), (139, 2)]
    last = watcher.last()
    assert last is not None and last.source == "hosts/h1/node-e1.log"


def test_a_move_in_place_loses_nothing_though_two_nodes_log_its_step(tmp_path: Path) -> None:
    ref = _ref("23:55:25.000")
    watcher = LogWatcher(tmp_path, ("*/node-e*.log",))
    _write(tmp_path / "h2" / "node-e1.log", MOVE_LOGS["h2/node-e1.log"])  # the new rank 0's log first: older lines
    watcher.poll(ref)
    assert not watcher.standby_after(0)
    for name in ("h1/node-e1.log", "h4/node-e4.log"):
        _write(tmp_path / name, MOVE_LOGS[name])
    watcher.poll(ref)
    assert [(line.step, line.source) for line in watcher.steps] == [
        (337, "h1/node-e1.log"), (338, "h1/node-e1.log"), (339, "h2/node-e1.log"), (340, "h2/node-e1.log"),
        (341, "h2/node-e1.log")]
    assert steps_lost(watcher.steps, -math.inf) == 0
    assert watcher.standby_after(ref) and not watcher.standby_after(ref + 1)
    # without the leaving node's notice the repeated line would read as a step redone
    raw = [line for name in ("h1/node-e1.log", "h2/node-e1.log")
           for text in MOVE_LOGS[name].splitlines() if (line := parse_step_line(text, name, ref))]
    assert steps_lost(sorted(raw, key=lambda line: line.ts), -math.inf) == 1


# -- the event sequence --------------------------------------------------------------------------------------------


def test_the_event_sequence_is_a_function_of_the_seed() -> None:
    assert event_rounds(7, quick=True) == event_rounds(7, quick=True)
    assert event_rounds(7, quick=False, rounds=2) == event_rounds(7, quick=False, rounds=2)
    assert len({event_rounds(seed, quick=True) for seed in range(8)}) == 8
    for seed in range(20):
        [quick] = event_rounds(seed, quick=True)
        assert sorted(event.kind for event in quick.events) == ["announced", "unplanned"]
        [full] = event_rounds(seed, quick=False)
        assert sorted(event.kind for event in full.events) == ["announced", "unplanned", "unplanned"]
        for rnd in (quick, full, *event_rounds(seed, quick=False, rounds=2)):
            steps = [event.at_step for event in rnd.events]
            assert steps == sorted(steps) and steps[0] >= 40 and rnd.target_step > steps[-1]
            assert all(0 <= event.victim < 1 for event in rnd.events)


def test_notices_use_the_clouds_lead_times_scaled() -> None:
    real = {channel.key: channel.real_lead_s for channel in CHANNELS}
    assert real == {"azure_preempt": 30, "gcp_preemption": 30, "gcp_maintenance": 60, "aws_spot": 120,
                    "azure_freeze_reboot": 900}
    assert LEAD_SCALE == 0.1
    seen = set()
    for seed in range(len(DRAWN_CHANNELS)):
        [announced] = [e for e in event_rounds(seed, quick=True)[0].events if e.kind == "announced"]
        assert announced.channel is not None
        assert announced.real_lead_s == real[announced.channel]
        assert announced.lead_s == pytest.approx(announced.real_lead_s * LEAD_SCALE)
        seen.add(announced.channel)
        [scaled] = [e for e in event_rounds(seed, quick=True, scale=0.05)[0].events if e.kind == "announced"]
        assert scaled.lead_s == pytest.approx(announced.real_lead_s * 0.05)
    assert seen == {channel.key for channel in DRAWN_CHANNELS}  # consecutive seeds cover every drawn channel
    rounds = event_rounds(3, quick=False, rounds=2)
    assert len({event.channel for rnd in rounds for event in rnd.events if event.channel}) == 2
    with pytest.raises(ValueError):
        event_rounds(0, quick=True, scale=0)


def test_the_plot_draws_each_arms_steps_with_its_events(tmp_path: Path) -> None:
    result = ScenarioResult(key="o5_reliability", title="t", how="h", arms={STATUS_QUO: "", COOPERATIVE: ""})
    assert plot_reliability(result, tmp_path) == []
    runs = []
    for arm, resume in ((STATUS_QUO, 100), (COOPERATIVE, 150)):
        run = RoundRun(arm=arm, repeat=0, seed=0, index=0, target_step=170)
        run.steps = [StepLine(ts=0.1 * i, step=i, world=3, loss=0.0, source="x") for i in range(1, 151)]
        run.steps += [StepLine(ts=20 + 0.1 * i, step=resume + i, world=3, loss=0.0, source="x") for i in range(1, 80)]
        run.events.append(EventOutcome(kind="unplanned", channel=None, lead_s=0.0, at_step=150, victim="h2",
                                       notice_ts=None, fail_ts=15.05, fired_at_step=150, recovered_ts=20.1))
        run.account()
        runs.append(run)
    assert runs[0].events[0].steps_lost == 50 and runs[1].events[0].steps_lost == 0
    assert runs[1].ettr is not None and runs[0].ettr is not None and runs[1].ettr > runs[0].ettr
    result.series = {"runs": [run.as_series() for run in runs]}
    assert plot_reliability(result, tmp_path) == ["o5_reliability.png"]
    assert (tmp_path / "o5_reliability.png").stat().st_size > 10_000


# -- plain torchrun: a node killed, the job resumes from its checkpoint ----------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_a_torchrun_job_resumes_from_its_checkpoint_after_a_node_is_killed(tmp_path: Path) -> None:
    prefix = run_marker_prefix("hztest")
    job = TorchrunJob(
        tmp_path, name="pair", nnodes="1:2", marker_prefix=prefix,
        entrypoint=["-m", "workloads.examples.mlp", "--step-delay-ms", "50", "--log-every", "1",
                    "--checkpoint-interval", "20"],
    )
    watcher = job.watcher
    try:
        await job.start_store_host("a")
        job.start_node("b")
        assert marked_processes(job.marker("a")) and job.running() == ["a", "b"]
        deadline = time.monotonic() + 90
        while (last := watcher.last()) is None or last.step < 30 or last.world != 2:
            assert time.monotonic() < deadline, f"the job did not reach step 30 at world 2 ({last})"
            await asyncio.sleep(0.05)
            watcher.poll()
        killed = job.kill("b")
        assert not marked_processes(job.marker("b")) and job.running() == ["a"]
        job.start_node("c")
        while (first := recovery_step(watcher.steps, killed)) is None:
            assert time.monotonic() < deadline + 60, "no step after the kill"
            await asyncio.sleep(0.1)
            watcher.poll()
        before = max(line.step for line in watcher.steps if line.ts < first.ts)
        checkpoint = before // 20 * 20
        assert first.step == checkpoint + 1
        assert steps_lost(watcher.steps, killed) == before - checkpoint
        logs = "".join(path.read_text() for path in tmp_path.glob("node-*.log"))
        assert f"resumed from step-{checkpoint:08d}" in logs
        runs = list((tmp_path / "torchelastic").iterdir())
        assert len(runs) == 3, f"each node's torchrun logs in the job's directory, not the temp dir: {runs}"
    finally:
        job.stop()
        reap(prefix)
    assert not marked_processes(prefix, prefix=True)
