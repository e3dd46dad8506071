"""The node launcher for DDP jobs in place, with the stand-in for torchrun: one standalone node whose workers form
the job's group on the provider's store; a new epoch that keeps the node is announced in its membership file
(urgent when a peer failed) instead of restarting it; a node no longer placed gets a leave order and its exit is
waited for."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from harmonaize.desired_state import RestartMode
from harmonaize.job_runtime import CONTROL_MEMBERSHIP_FILE, Membership, WorkerSpec, read_model
from provider_agents.processes import alive
from tests.agents.test_node_launcher import Rig, _assignment, _converge, _job
from tests.support import eventually


@pytest.fixture
def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Rig:
    return Rig(tmp_path, monkeypatch, in_place=True)


def membership(rig: Rig) -> Membership | None:
    return read_model(rig.config.work_dir / "jobs" / "acme.train" / CONTROL_MEMBERSHIP_FILE, Membership)


async def test_epoch_changes_are_announced_to_the_running_node(rig: Rig) -> None:
    launcher = rig.launcher()
    await _converge(launcher, _assignment(_job(epoch=1, nodes=2)))
    await eventually(lambda: len(rig.starts()) == 1, what="the node started")
    [start] = rig.starts()
    assert "--standalone" in start["args"] and "--max-restarts=0" in start["args"]
    assert not any(arg.startswith("--rdzv-id") for arg in start["args"]), "no torchrun rendezvous across hosts"
    spec = read_model(Path(str(start["spec"])), WorkerSpec)
    assert spec is not None and spec.store_endpoint == "127.0.0.1:29999"
    assert membership(rig) == Membership(epoch=1, nodes=2, workers=1, reason="agreement")

    await _converge(launcher, _assignment(_job(epoch=2, nodes=3), generation=2))
    assert len(rig.starts()) == 1 and alive(start["pid"]), "the node keeps running"
    assert membership(rig) == Membership(epoch=2, nodes=3, workers=1, reason="agreement")

    await _converge(launcher, _assignment(_job(epoch=3, nodes=2, restart=RestartMode.IMMEDIATE), generation=3))
    assert len(rig.starts()) == 1 and alive(start["pid"])
    assert membership(rig) == Membership(epoch=3, nodes=2, workers=1, urgent=True, reason="a peer failed")
    await launcher.shutdown(stop_nodes=True)


async def test_a_plan_change_still_restarts_the_node(rig: Rig) -> None:
    launcher = rig.launcher()
    await _converge(launcher, _assignment(_job(epoch=1, nodes=2)))
    await eventually(lambda: len(rig.starts()) == 1, what="the node started")
    await _converge(launcher, _assignment(_job(epoch=2, nodes=2, plan="hsdp"), generation=2))
    await eventually(lambda: len(rig.starts()) == 2, what="the node restarted for HSDP")
    first, second = rig.starts()
    assert not alive(first["pid"])
    assert any(arg.startswith("--rdzv-id=acme.train.e2") for arg in second["args"]), "HSDP is not in place"
    await launcher.shutdown(stop_nodes=True)


async def test_a_node_no_longer_placed_gets_a_leave_order_and_exits_on_its_own(rig: Rig) -> None:
    launcher = rig.launcher()
    await _converge(launcher, _assignment(_job(epoch=4, nodes=2)))
    await eventually(lambda: len(rig.starts()) == 1, what="the node started")
    [start] = rig.starts()
    leaving = asyncio.get_running_loop().time()
    await _converge(launcher, _assignment(generation=2))
    order = membership(rig)
    assert order is not None and (order.epoch, order.member) == (5, False)
    assert not alive(start["pid"])
    assert asyncio.get_running_loop().time() - leaving < rig.config.grace_s, "it left on the order, not when killed"
    assert launcher.running_nodes() == {}
