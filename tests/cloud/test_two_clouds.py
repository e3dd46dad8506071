"""Two local clouds on one machine with the same host name (`h1`), each training a job of the same tenant and job
name: killing the second cloud's host and stopping it with Ctrl-C leaves every process of the first's job running.

The first is a real `harmonaize up` process. The second runs in this process (`run_local_cloud`, what `up` runs), so
the test can kill its host through its `LocalFleet` and then stop it with SIGINT, the way Ctrl-C does. Each cloud's
node is read from its own node state (`node.json`: pid and markers), so the checks do not depend on the markers'
format.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from harmonaize.settings import Settings
from harmonaize_cli.local_cloud.fleet import LocalFleet, fleet_of
from harmonaize_cli.local_cloud.launcher import LocalCloudInfo, run_local_cloud
from provider_agents.processes import alive, marked_processes
from tests.cloud.test_up import read_env_file, start_up
from tests.support import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

JOB = {
    "id": "train", "min_workers": 1, "max_workers": 1, "gpus_per_worker": 4, "initial_workers": 1,
    "entrypoint": ["-m", "workloads.examples.mlp", "--step-delay-ms", "100"],
}


def node_state(data_dir: Path) -> dict[str, Any] | None:
    """The node launcher's record of h1's node of demo/train in this cloud (None before it started one)."""
    try:
        return dict(json.loads((data_dir / "hosts" / "h1" / "jobs" / "demo.train" / "node.json").read_text()))
    except (FileNotFoundError, ValueError):
        return None


def node_processes(state: dict[str, Any]) -> set[int]:
    """The node's torchrun agent and every process carrying its markers (its workers)."""
    pids = {int(state["pid"])} if alive(int(state["pid"])) else set()
    for marker in (state["marker"], state.get("agent_marker")):
        if marker:
            pids |= set(marked_processes(marker))
    return pids


class Tenant:
    """The demo tenant of one cloud, over REST."""

    def __init__(self, data_dir: Path) -> None:
        env = read_env_file(data_dir / "tenant-demo.env")
        self.data_dir = data_dir
        self.client = httpx.AsyncClient(
            base_url=env["HZ_API_URL"], headers={"Authorization": f"Bearer {env['HZ_TENANT_TOKEN']}"}, timeout=30
        )

    async def progress(self) -> dict[str, Any] | None:
        reply = await self.client.get("/v1/jobs/train/status")
        assert reply.status_code == 200, reply.text
        return reply.json()["progress"]

    async def steps_at_least(self, step: int) -> bool:
        progress = await self.progress()
        return progress is not None and progress["step"] >= step

    async def train(self) -> tuple[dict[str, Any], set[int]]:
        """Submit the job; once it steps, its node state and every process of its node (torchrun and worker)."""
        created = await self.client.post("/v1/jobs", json=JOB)
        assert created.status_code == 201, created.text
        await eventually(lambda: self.steps_at_least(3), timeout=150, interval=0.3, what=f"{self.data_dir}: steps")
        state = node_state(self.data_dir)
        assert state is not None
        await eventually(lambda: len(node_processes(state)) >= 2, timeout=30, what="the node's torchrun and worker")
        return state, node_processes(state)


async def test_one_cloud_killing_and_stopping_its_hosts_leaves_the_other_clouds_job_running(tmp_path: Path) -> None:
    first = start_up(tmp_path / "first", "--hosts", "1")
    ours = Tenant(first.data_dir)
    try:
        state, pids = await ours.train()
        theirs: dict[str, Any] = {}

        async def second_cloud(info: LocalCloudInfo, fleet: LocalFleet | None) -> None:
            assert fleet is not None
            tenant = Tenant(info.data_dir)
            try:
                theirs["state"], theirs["pids"] = await tenant.train()
            finally:
                await tenant.client.aclose()
            fleet.kill_host("h1")
            await eventually(lambda: not any(alive(pid) for pid in theirs["pids"]), timeout=10,
                             what="the second cloud's node killed with its host")
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: the cloud stops its fleet
            await asyncio.Event().wait()

        second = Settings(_env_file=None, data_dir=tmp_path / "second", api_port=0)
        await asyncio.wait_for(run_local_cloud(second, hosts=fleet_of(1), story=second_cloud), timeout=240)

        assert theirs.get("pids"), "the second cloud never ran its job"
        assert node_processes(theirs["state"]) == set(), "the second cloud left processes of its node behind"
        assert node_state(first.data_dir) == state, "the first cloud's node was restarted"
        assert node_processes(state) == pids, "the second cloud's kills reached the first cloud's node"
        before = await ours.progress()
        assert before is not None
        await eventually(lambda: ours.steps_at_least(before["step"] + 10), timeout=60, interval=0.3,
                         what="the first cloud's job stepping on")
        after = await ours.progress()
        assert after is not None and (after["epoch"], after["world_size"]) == (before["epoch"], 1)
        assert node_processes(state) == pids
    finally:
        await ours.client.aclose()
        first.proc.send_signal(signal.SIGINT)
        first.proc.wait(60)
