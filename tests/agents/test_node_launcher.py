"""The node launcher's decisions, with a stand-in for torchrun (fast): one node per epoch, sized exactly; graceful or
immediate restarts; orphaned workers never survive a stop; a restarted launcher adopts healthy nodes; directives and
progress cross the file boundary with the job."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shlex
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from harmonaize.desired_state import AssignedJob, HostAssignment, RestartMode
from harmonaize.job_runtime import (
    CONTROL_PROGRESS_FILE,
    Directives,
    JobProgress,
    WorkerSpec,
    read_model,
    write_model_atomically,
)
from provider_agents.markers import cloud_id, host_prefix
from provider_agents.node_launcher import TORCHRUN_LOG_DIR, LauncherConfig, NodeLauncher
from provider_agents.processes import alive, marked_processes, signal_marked
from tests.support import eventually

FAKE = Path(__file__).with_name("fake_torchrun.py")
SECRET = b"launcher-test-secret"


def _job(epoch: int = 1, *, nodes: int = 2, workers: int = 1, restart: RestartMode = RestartMode.GRACEFUL,
         directives: Directives | None = None, plan: str = "ddp") -> AssignedJob:
    return AssignedJob(
        tenant="acme", job="train", workers=workers, gpus=workers, parallel_plan=plan,
        entrypoint=("-m", "workloads.examples.mlp"), epoch=epoch, nodes=nodes, restart=restart,
        directives=directives or Directives(),
    )


def _assignment(*jobs: AssignedJob, generation: int = 1) -> HostAssignment:
    return HostAssignment(host="h1", locality_group="g1", generation=generation, jobs=jobs,
                          updated_at=datetime.now(UTC))


class Rig:
    def __init__(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, stop_s: float = 0.2, in_place: bool = False
    ) -> None:
        """`in_place` False: the restart path (every epoch a new torchrun node), which FSDP and HSDP jobs take and
        which these tests pin down; `test_node_launcher_in_place` covers DDP jobs in place."""
        self.record = tmp_path / "starts.jsonl"
        monkeypatch.setenv("HZ_FAKE_RECORD", str(self.record))
        monkeypatch.setenv("HZ_FAKE_STOP_S", str(stop_s))
        self.config = LauncherConfig(
            host="h1", work_dir=tmp_path / "work", checkpoint_root=tmp_path / "ckpt", python=sys.executable,
            grace_s=5.0, warm=False, cloud=cloud_id(SECRET, tmp_path), in_place=in_place,
        )
        self.progress: list[JobProgress] = []
        self.endpoint: str | None = "127.0.0.1:29999"

    def launcher(self, *, cloud: str | None = None) -> NodeLauncher:
        """A launcher on the rig's work dir; `cloud`: one of another cloud (its default is this rig's)."""
        self.config = LauncherConfig(**{**self.config.__dict__, "python": str(self._fake_python())})
        if cloud is not None:
            self.config = LauncherConfig(**{**self.config.__dict__, "cloud": cloud})
        return NodeLauncher(self.config, secret=SECRET, endpoints=self._endpoint, on_progress=self._progress)

    def _fake_python(self) -> Path:
        """An executable that runs the stand-in under this interpreter: the launcher execs `python -m ...`, and a
        shebang would tie the repo to one machine's interpreter path."""
        wrapper = self.record.parent / "fake-python"
        if not wrapper.exists():
            wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} "$@"\n')
            wrapper.chmod(0o755)
        return wrapper

    async def _endpoint(self, tenant: str, job: str) -> str | None:
        return self.endpoint

    async def _progress(self, progress: JobProgress) -> None:
        self.progress.append(progress)

    def starts(self) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines()]


@pytest.fixture
def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Rig:
    return Rig(tmp_path, monkeypatch)


async def _converge(launcher: NodeLauncher, assignment: HostAssignment | None) -> None:
    await launcher.converge(assignment)
    await launcher.settle()


_TRANSITION = re.compile(r"^host h1: acme/train epoch (\d+): (\w+) -> (\w+) ")


def node_states(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str, str]]:
    """(epoch, from, to) of every state change of the acme/train node the launcher logged, in order (the test must
    have set the launcher's logger to INFO first)."""
    return [
        (int(match[1]), match[2], match[3])
        for record in caplog.records
        if record.name == "provider_agents.node_launcher" and (match := _TRANSITION.match(record.getMessage()))
    ]


async def test_one_exactly_sized_node_per_epoch_with_its_spec(rig: Rig) -> None:
    launcher = rig.launcher()
    await _converge(launcher, _assignment(_job(epoch=3, nodes=2, workers=1)))
    await eventually(lambda: len(rig.starts()) == 1, what="the node started")
    [start] = rig.starts()
    args = start["args"]
    assert "--nnodes=2:2" in args and "--nproc-per-node=1" in args
    assert "--rdzv-id=acme.train.e3" in args and "--rdzv-endpoint=127.0.0.1:29999" in args
    assert any(arg.startswith("--rdzv-conf=is_host=0") and "keep_alive_max_attempt=3" in arg for arg in args)
    assert args[-2:] == ["-m", "workloads.examples.mlp"]
    spec = read_model(Path(str(start["spec"])), WorkerSpec)
    assert spec is not None and (spec.tenant, spec.job, spec.epoch) == ("acme", "train", 3)
    assert f"--log-dir={spec.control_dir / TORCHRUN_LOG_DIR}" in args, "torchrun's logs in the job's own directory"
    assert spec.locality_group and spec.locality_group != "g1", "the job sees a pseudonym, not the provider's name"
    await _converge(launcher, _assignment(_job(epoch=3, nodes=2, workers=1), generation=2))
    assert len(rig.starts()) == 1, "the same epoch again starts nothing"
    await launcher.shutdown(stop_nodes=True)


async def test_a_new_epoch_stops_gracefully_then_starts_and_leaves_no_orphans(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="provider_agents.node_launcher")
    launcher = rig.launcher()
    await _converge(launcher, _assignment(_job(epoch=1)))
    await eventually(lambda: len(rig.starts()) == 1, what="epoch 1 started")
    first = rig.starts()[0]
    await eventually(lambda: len(marked_processes(str(first["marker"]))) == 2, what="torchrun and its worker")
    await _converge(launcher, _assignment(_job(epoch=2, nodes=3)))
    assert not alive(int(first["pid"])) and marked_processes(str(first["marker"])) == [], "no orphan survives"
    await eventually(lambda: len(rig.starts()) == 2, what="epoch 2 started")
    second = rig.starts()[1]
    assert "--nnodes=3:3" in second["args"] and "--rdzv-id=acme.train.e2" in second["args"]
    await launcher.shutdown(stop_nodes=True)
    assert node_states(caplog) == [  # no watch runs here, so no beat is seen: the nodes stay `starting`
        (1, "placed", "starting"), (1, "starting", "stopping"), (1, "stopping", "stopped"),
        (2, "stopped", "starting"), (2, "starting", "stopping"), (2, "stopping", "stopped"),
    ]
    assert "stopping (stop: graceful restart into epoch 2)" in caplog.text


async def test_an_immediate_restart_does_not_wait_for_the_grace_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = Rig(tmp_path, monkeypatch, stop_s=30.0)  # a job that would take 30 s to stop gracefully
    launcher = rig.launcher()
    await _converge(launcher, _assignment(_job(epoch=1)))
    await eventually(lambda: len(rig.starts()) == 1, what="epoch 1 started")
    loop = asyncio.get_running_loop()
    started = loop.time()
    await _converge(launcher, _assignment(_job(epoch=2, nodes=1, restart=RestartMode.IMMEDIATE)))
    assert loop.time() - started < 3.0
    await eventually(lambda: len(rig.starts()) == 2, what="epoch 2 started")
    await launcher.shutdown(stop_nodes=False)
    for start in rig.starts():
        signal_marked(str(start["marker"]), signal.SIGKILL)


async def test_a_restarted_launcher_adopts_the_running_node(rig: Rig) -> None:
    first = rig.launcher()
    await _converge(first, _assignment(_job(epoch=1)))
    await eventually(lambda: len(rig.starts()) == 1, what="the node started")
    pid = int(rig.starts()[0]["pid"])
    await first.shutdown(stop_nodes=False)  # the agent goes away, its node keeps running
    second = rig.launcher()
    assert second.adopted == 1
    await _converge(second, _assignment(_job(epoch=1)))
    assert len(rig.starts()) == 1 and alive(pid), "adopted, not restarted"
    await _converge(second, _assignment())
    await eventually(lambda: not alive(pid), what="the adopted node stopped when no longer wanted")
    await second.shutdown(stop_nodes=True)


async def test_a_launcher_of_another_cloud_neither_adopts_nor_stops_the_node(rig: Rig, tmp_path: Path) -> None:
    """Same host, tenant, job and epoch, same work dir: only the cloud differs. Its launcher refuses the node state
    (a node of ours is not its to adopt), and starting and stopping its own node of that name leaves ours running."""
    ours = rig.launcher()
    await _converge(ours, _assignment(_job(epoch=1)))
    await eventually(lambda: len(rig.starts()) == 1, what="our node started")
    pid, marker = int(rig.starts()[0]["pid"]), str(rig.starts()[0]["marker"])
    await eventually(lambda: len(marked_processes(marker)) == 2, what="our torchrun and its worker")
    await ours.shutdown(stop_nodes=False)
    theirs = rig.launcher(cloud=cloud_id(SECRET, tmp_path / "elsewhere"))
    try:
        assert theirs.adopted == 0, "a node of another cloud was adopted"
        await _converge(theirs, _assignment(_job(epoch=1)))
        await eventually(lambda: len(rig.starts()) == 2, what="their own node started")
        assert str(rig.starts()[1]["marker"]) != marker
        await _converge(theirs, _assignment())
        await theirs.shutdown(stop_nodes=True)
        assert alive(pid) and len(marked_processes(marker)) == 2, "their stop reached our node"
    finally:
        signal_marked(marker, signal.SIGKILL)


async def test_unknown_desired_state_touches_nothing_and_no_endpoint_waits(rig: Rig) -> None:
    launcher = rig.launcher()
    await _converge(launcher, _assignment(_job(epoch=1)))
    await eventually(lambda: len(rig.starts()) == 1, what="the node started")
    pid = int(rig.starts()[0]["pid"])
    await _converge(launcher, None)
    assert alive(pid), "a desired state not loaded yet is not 'nothing wanted'"
    rig.endpoint = None
    await _converge(launcher, _assignment(_job(epoch=2)))
    assert len(rig.starts()) == 1, "no rendezvous store yet: nothing is started"
    await launcher.shutdown(stop_nodes=True)


async def test_directives_are_handed_over_and_progress_relayed_once_per_change(rig: Rig) -> None:
    launcher = rig.launcher()
    directives = Directives(version=2, checkpoint_requests=1, reason="predicted failure")
    await _converge(launcher, _assignment(_job(epoch=1, directives=directives)))
    control = launcher.control_dir("acme", "train")
    assert read_model(control / "directives.json", Directives) == directives
    progress = JobProgress(tenant="acme", job="train", epoch=1, step=7, world_size=2, parallel_plan="ddp",
                           checkpoint_interval_steps=10, batch_size=32, updated_at=datetime.now(UTC))
    write_model_atomically(control / CONTROL_PROGRESS_FILE, progress)
    assignment = _assignment(_job(epoch=1, directives=directives))
    assert await launcher.relay_progress(assignment) == 1
    assert await launcher.relay_progress(assignment) == 0, "an unchanged file is not sent again"
    assert rig.progress == [progress]
    await launcher.shutdown(stop_nodes=True)


async def test_a_finished_node_is_not_restarted_and_a_failing_one_gives_up(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HZ_FAKE_EXIT", "0")
    launcher = rig.launcher()
    await _converge(launcher, _assignment(_job(epoch=1)))
    await eventually(lambda: not launcher.running_nodes(), what="the job finished")
    for _ in range(3):
        await _converge(launcher, _assignment(_job(epoch=1)))
    assert len(rig.starts()) == 1
    monkeypatch.setenv("HZ_FAKE_EXIT", "3")
    await _converge(launcher, _assignment(_job(epoch=2)))
    for _ in range(20):
        await _converge(launcher, _assignment(_job(epoch=2)))
        await asyncio.sleep(0.05)
    assert 1 + 1 + launcher.config.max_restarts >= len(rig.starts()) >= 3
    await launcher.shutdown(stop_nodes=True)


async def test_a_warm_torchrun_becomes_the_next_node_with_its_arguments_and_marker(tmp_path: Path) -> None:
    """The real `torch.distributed.run`, warmed ahead, takes the node's arguments and environment from stdin: a
    one-node job rendezvouses on a provider-style store and its worker sees the node's marker and spec."""
    from provider_agents.rendezvous_host import _start_store

    store = _start_store("127.0.0.1")
    out = tmp_path / "worker.txt"
    cloud = cloud_id(SECRET, tmp_path)
    config = LauncherConfig(host="h1", work_dir=tmp_path / "work", checkpoint_root=tmp_path / "ckpt",
                            python=sys.executable, grace_s=5.0, cloud=cloud)

    async def endpoint(tenant: str, job: str) -> str | None:
        return f"127.0.0.1:{store.port}"

    launcher = NodeLauncher(config, secret=SECRET, endpoints=endpoint)
    launcher.prewarm()
    await eventually(lambda: launcher._warm is not None and launcher._warm.ready, timeout=30, what="a warm agent")
    warm_pid = launcher._warm.process.pid  # type: ignore[union-attr]
    job = _job(epoch=4, nodes=1).model_copy(
        update={"entrypoint": ("--no-python", "sh", "-c", f'echo "$HZ_NODE_ID $RANK $HZ_RUN_SPEC" > {out}')}
    )
    await _converge(launcher, _assignment(job))
    assert launcher.warm_starts == 1
    node = launcher._nodes[("acme", "train")]
    assert node.pid == warm_pid and node.agent_marker is not None
    await eventually(lambda: out.exists() and bool(out.read_text().strip()), timeout=60, what="the worker ran")
    marker, rank, spec = out.read_text().split()
    assert (marker, rank) == (f"{cloud}.h1.acme.train.e4", "0") and spec.endswith("spec-e4.json")
    assert node.agent_marker.startswith(host_prefix(cloud, "h1")), "the warm agent carries this cloud's marker too"
    await eventually(lambda: not node.running(), timeout=30, what="the one-step job finished")
    assert node.process is not None and node.process.returncode == 0
    await launcher.shutdown(stop_nodes=True)
