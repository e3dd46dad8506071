"""Node markers are scoped to one cloud: the id every process of a cloud derives alike and two clouds on one machine
do not share, and signals by host prefix that reach exactly one host of one cloud (real processes, real signals)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harmonaize.job_runtime import ENV_NODE_MARKER
from provider_agents.markers import cloud_id, host_prefix, node_marker
from provider_agents.processes import alive, marked_processes, signal_marked, stopped
from tests.support import eventually

SECRET = b"markers-test-secret"


def test_the_cloud_id_is_the_same_for_one_cloud_and_differs_between_clouds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    monkeypatch.chdir(tmp_path)
    ours = cloud_id(SECRET, tmp_path / "a")
    assert cloud_id(SECRET, Path("a")) == cloud_id(SECRET, tmp_path / "link") == ours, "one data dir, one id"
    assert cloud_id(SECRET, tmp_path / "b") != ours, "another data dir with the same secret is another cloud"
    assert cloud_id(b"another-secret", tmp_path / "a") != ours, "another secret is another cloud"
    assert ours.isalnum() and ours.islower()
    with pytest.raises(ValueError, match="HZ_PROVIDER_SECRET"):
        cloud_id(b"", tmp_path / "a")


def test_markers_refuse_parts_that_could_widen_a_prefix() -> None:
    assert node_marker("c1", "h1", "acme.train.e4") == "c1.h1.acme.train.e4"
    assert host_prefix("c1", "h1") == "c1.h1."
    for cloud, host in (("", "h1"), ("c1", ""), ("c1.h1", "x"), ("c1", "h1.acme")):
        with pytest.raises(ValueError, match="invalid (cloud|host) id"):
            host_prefix(cloud, host)
    with pytest.raises(ValueError, match="every node of every cloud"):
        signal_marked("", signal.SIGKILL, prefix=True)


@pytest.fixture
def spawn() -> Iterator[Callable[[str], int]]:
    """Start a sleeping process carrying a marker; every one is killed at teardown."""
    started: list[subprocess.Popen[bytes]] = []

    def start(marker: str) -> int:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)"],
            env={**os.environ, ENV_NODE_MARKER: marker}, start_new_session=True,
        )
        started.append(proc)
        # until the child has exec'd, /proc/<pid>/environ is still this process's environment, without the marker
        deadline = time.monotonic() + 10
        while proc.pid not in marked_processes(marker):
            assert time.monotonic() < deadline, f"process {proc.pid} never showed marker {marker}"
            time.sleep(0.005)
        return proc.pid

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


async def test_a_host_signal_reaches_that_host_of_that_cloud_only(tmp_path: Path, spawn: Callable[[str], int]) -> None:
    ours, theirs = cloud_id(SECRET, tmp_path / "ours"), cloud_id(SECRET, tmp_path / "theirs")
    pids = {
        (cloud, host): spawn(node_marker(cloud, host, "acme.train.e1"))
        for cloud in (ours, theirs) for host in ("h1", "h10")
    }
    warm = spawn(node_marker(ours, "h1", "warm.1.1"))
    for (cloud, host), pid in pids.items():
        assert marked_processes(host_prefix(cloud, host), prefix=True) == sorted(
            [pid, warm] if (cloud, host) == (ours, "h1") else [pid]
        ), (cloud, host)
    killed = signal_marked(host_prefix(ours, "h1"), signal.SIGKILL, prefix=True)
    assert sorted(killed) == sorted([pids[(ours, "h1")], warm])
    await eventually(lambda: not alive(pids[(ours, "h1")]) and not alive(warm), what="our h1's processes gone")
    survivors = [pid for key, pid in pids.items() if key != (ours, "h1")]
    assert all(alive(pid) for pid in survivors), "h10 of our cloud or a host of theirs was signalled"
    assert marked_processes(node_marker(theirs, "h1", "acme.train.e1")) == [pids[(theirs, "h1")]]


async def test_exact_markers_of_two_clouds_with_one_job_name_are_told_apart(
    tmp_path: Path, spawn: Callable[[str], int]
) -> None:
    ours, theirs = cloud_id(SECRET, tmp_path / "ours"), cloud_id(SECRET, tmp_path / "theirs")
    mine, other = spawn(node_marker(ours, "h1", "acme.train.e1")), spawn(node_marker(theirs, "h1", "acme.train.e1"))
    assert signal_marked(node_marker(ours, "h1", "acme.train.e1"), signal.SIGTERM) == [mine]
    await eventually(lambda: not alive(mine), what="our node gone")
    assert alive(other)


async def test_a_stopped_process_is_seen_stopped_until_continued(spawn: Callable[[str], int]) -> None:
    pid = spawn("stopped-test.h1.acme.train.e1")
    assert not stopped(pid)
    os.kill(pid, signal.SIGSTOP)
    await eventually(lambda: stopped(pid), what="the process seen stopped")
    os.kill(pid, signal.SIGCONT)
    await eventually(lambda: not stopped(pid), what="the process seen running again")
    assert not stopped(2**22 + 12345), "no such process: not stopped"
