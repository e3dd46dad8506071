"""The node launcher's watch, with the stand-in torchrun: a node whose worker stops beating is killed, reported once
and not restarted in its epoch; a beating one is left alone; a node out of restarts is reported too, and a report the
control plane did not take is sent again."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from pathlib import Path

import pytest

from harmonaize.job_runtime import NodeLiveness, NodePhase, liveness_path, write_model_atomically
from harmonaize.node_failures import NodeFailureReason, NodeFailureReport
from provider_agents.hang_detector import HangBounds
from provider_agents.node_launcher import NodeLauncher
from provider_agents.processes import marked_processes
from tests.agents.test_node_launcher import SECRET, Rig, _assignment, _converge, _job, node_states
from tests.support import eventually

BOUNDS = HangBounds(frozen_floor_s=1.0, stalled_floor_s=2.0)


class Reports:
    """The control plane's side: takes reports, or fails the next `fail` of them (unreachable)."""

    def __init__(self) -> None:
        self.taken: list[NodeFailureReport] = []
        self.fail = 0

    async def __call__(self, report: NodeFailureReport) -> None:
        if self.fail:
            self.fail -= 1
            raise ConnectionError("control plane away")
        self.taken.append(report)


def watched(rig: Rig, reports: Reports) -> NodeLauncher:
    rig.launcher()  # points the rig's config at the stand-in torchrun
    config = dataclasses.replace(rig.config, hang_bounds=BOUNDS)
    return NodeLauncher(config, secret=SECRET, endpoints=rig._endpoint, on_failure=reports)


async def started_worker(launcher: NodeLauncher) -> tuple[str, int]:
    """(marker, pid of the node's worker) once the stand-in started its worker."""
    await eventually(lambda: len(launcher.running_nodes()) == 1, what="the node started")
    node = launcher._nodes[("acme", "train")]
    await eventually(lambda: len(marked_processes(node.marker)) == 2, what="the stand-in's worker")
    [worker] = [pid for pid in marked_processes(node.marker) if pid != node.pid]
    return node.marker, worker


def write_beat(
    launcher: NodeLauncher, pid: int, *, beats: int, phase: NodePhase, step: int = 12, epoch: int = 1
) -> None:
    record = NodeLiveness(
        tenant="acme", job="train", epoch=epoch, local_rank=0, pid=pid, beats=beats, step=step, phase=phase,
        transitions=3,
    )
    write_model_atomically(liveness_path(launcher.control_dir("acme", "train"), 0), record)


@pytest.fixture
def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Rig:
    return Rig(tmp_path, monkeypatch)


async def test_a_frozen_node_is_killed_reported_once_and_not_restarted_in_its_epoch(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="provider_agents.node_launcher")
    reports = Reports()
    launcher = watched(rig, reports)
    await _converge(launcher, _assignment(_job(epoch=1)))
    marker, worker = await started_worker(launcher)
    write_beat(launcher, worker, beats=1, phase=NodePhase.AGREEMENT)

    async def declared() -> bool:
        await launcher.watch()
        return bool(reports.taken)

    took = await eventually(declared, timeout=10, interval=0.1, what="the frozen node reported")
    assert took >= BOUNDS.frozen_floor_s
    [report] = reports.taken
    assert (report.tenant, report.job, report.host, report.epoch, report.reason, report.step) == (
        "acme", "train", "h1", 1, NodeFailureReason.FROZEN, 12,
    )
    assert "local rank 0" in report.detail and "no beat" in report.detail
    await launcher.settle()
    assert marked_processes(marker) == [], "the hung node's processes are gone"
    for _ in range(5):
        await _converge(launcher, _assignment(_job(epoch=1)))
        await launcher.watch()
    assert len(rig.starts()) == 1 and len(reports.taken) == 1, "not restarted, not reported again"

    await _converge(launcher, _assignment(_job(epoch=2)))
    await eventually(lambda: len(rig.starts()) == 2, what="the next epoch's node")
    assert not liveness_path(launcher.control_dir("acme", "train"), 0).exists(), "a new node starts with no beats"
    await launcher.shutdown(stop_nodes=True)
    assert node_states(caplog) == [  # killed, the hung node stays `hung` until the next epoch replaces it
        (1, "placed", "starting"), (1, "starting", "running"), (1, "running", "hung"),
        (1, "hung", "stopping"), (1, "stopping", "stopped"), (2, "stopped", "starting"),
        (2, "starting", "stopping"), (2, "stopping", "stopped"),
    ]


async def test_a_beating_node_is_left_alone_and_stale_or_foreign_beats_are_ignored(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="provider_agents.node_launcher")
    reports = Reports()
    launcher = watched(rig, reports)
    await _converge(launcher, _assignment(_job(epoch=1)))
    _, worker = await started_worker(launcher)
    for beat in range(1, 31):  # 3 s, three times the frozen bound, waiting in a collective but beating
        write_beat(launcher, worker, beats=beat, phase=NodePhase.STEP)
        await launcher.watch()
        await asyncio.sleep(0.1)
    assert reports.taken == [] and launcher.running_nodes()
    control = launcher.control_dir("acme", "train")
    for _ in range(15):  # silent files: one of another epoch, one of a live process without the node's marker
        write_model_atomically(liveness_path(control, 0), NodeLiveness(
            tenant="acme", job="train", epoch=0, local_rank=0, pid=worker, beats=1, step=1, phase=NodePhase.STEP,
            transitions=0,
        ))
        write_model_atomically(liveness_path(control, 1), NodeLiveness(
            tenant="acme", job="train", epoch=1, local_rank=1, pid=os.getpid(), beats=1, step=1, phase=NodePhase.STEP,
            transitions=0,
        ))
        await launcher.watch()
        await asyncio.sleep(0.1)
    assert reports.taken == [] and launcher.running_nodes()
    await launcher.shutdown(stop_nodes=True)
    assert node_states(caplog) == [
        (1, "placed", "starting"), (1, "starting", "running"), (1, "running", "stopping"), (1, "stopping", "stopped"),
    ]


async def test_a_node_out_of_restarts_is_reported_and_resent_until_taken(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="provider_agents.node_launcher")
    monkeypatch.setenv("HZ_FAKE_EXIT", "3")
    reports = Reports()
    reports.fail = 2
    launcher = watched(rig, reports)

    async def gave_up() -> bool:
        await _converge(launcher, _assignment(_job(epoch=1)))
        await launcher.watch()
        return bool(reports.taken)

    await eventually(gave_up, timeout=30, interval=0.05, what="the given-up node reported")
    assert reports.fail == 0, "the two failed sends were retried"
    [report] = reports.taken
    assert (report.epoch, report.reason, report.step) == (1, NodeFailureReason.OUT_OF_RESTARTS, None)
    assert "exit code 3" in report.detail
    assert len(rig.starts()) == 1 + launcher.config.max_restarts
    await launcher.watch()
    assert len(reports.taken) == 1
    await launcher.shutdown(stop_nodes=True)
    restarts = [(1, "starting", "restarting"), (1, "restarting", "starting")] * launcher.config.max_restarts
    assert node_states(caplog) == [
        (1, "placed", "starting"), *restarts, (1, "starting", "given_up"),
        (1, "given_up", "stopping"), (1, "stopping", "stopped"),
    ]
