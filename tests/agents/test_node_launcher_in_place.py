"""The node launcher for DDP jobs in place, with the stand-in for torchrun: one standalone node whose workers form
the job's group on the provider's store; a new epoch that keeps the node is announced in its membership file
(urgent when a peer failed) instead of restarting it; a node no longer placed gets a leave order and its exit is
waited for."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from harmonaize.desired_state import AssignedJob, HostAssignment, RestartMode
from harmonaize.job_runtime import CONTROL_MEMBERSHIP_FILE, Membership, WorkerSpec, read_model, write_model_atomically
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


def _standing_by(job: AssignedJob, *, for_s: float = 60.0, generation: int = 1) -> HostAssignment:
    """`job` as a warm joiner of an offer open for `for_s` more seconds: under `standby`, not placed."""
    until = datetime.now(UTC) + timedelta(seconds=for_s)
    return HostAssignment(host="h1", locality_group="g1", generation=generation, jobs=(),
                          standby=(job.model_copy(update={"standby_until": until}),), updated_at=datetime.now(UTC))


async def test_a_warm_joiner_starts_without_membership_and_the_accept_makes_it_a_member(rig: Rig) -> None:
    control = rig.config.work_dir / "jobs" / "acme.train"
    control.mkdir(parents=True)
    stale = Membership(epoch=1, nodes=1, workers=1, member=False, reason="scale-down")
    write_model_atomically(control / CONTROL_MEMBERSHIP_FILE, stale)  # left by an earlier stint of the job here
    launcher = rig.launcher()
    await _converge(launcher, _standing_by(_job(epoch=3, nodes=3)))
    await eventually(lambda: len(rig.starts()) == 1, what="the standby node started")
    [start] = rig.starts()
    spec = read_model(Path(str(start["spec"])), WorkerSpec)
    assert spec is not None and spec.standby_until is not None and spec.store_endpoint == "127.0.0.1:29999"
    assert membership(rig) is None, "a standby waits for the accept: no membership, not even an old one"

    await _converge(launcher, _standing_by(_job(epoch=4, nodes=3), generation=2))  # the job moved meanwhile
    assert len(rig.starts()) == 1 and alive(start["pid"]) and membership(rig) is None

    await _converge(launcher, _assignment(_job(epoch=4, nodes=3), generation=3))  # accepted: placed here
    assert len(rig.starts()) == 1 and alive(start["pid"]), "the accept does not start another node"
    assert membership(rig) == Membership(epoch=4, nodes=3, workers=1, reason="agreement")
    await launcher.shutdown(stop_nodes=True)


async def test_a_warm_joiner_stops_when_its_offer_closes_or_expires(rig: Rig) -> None:
    launcher = rig.launcher()
    await _converge(launcher, _standing_by(_job(epoch=3, nodes=3)))
    await eventually(lambda: len(rig.starts()) == 1, what="the standby node started")
    await _converge(launcher, _assignment(generation=2))  # rejected, countered or cancelled: no longer listed
    [first] = rig.starts()
    assert not alive(first["pid"]) and launcher.running_nodes() == {}
    assert membership(rig) is None, "no leave order: it never joined"

    expiring = _standing_by(_job(epoch=3, nodes=3), for_s=1.0, generation=3)
    await _converge(launcher, expiring)
    await eventually(lambda: len(rig.starts()) == 2, what="the next offer's standby started")
    second = rig.starts()[1]

    async def expired() -> bool:
        await _converge(launcher, expiring)  # the same assignment: the launcher's own clock ends the standby
        return not alive(second["pid"])

    await eventually(expired, what="the standby stopped at its offer's expiry", timeout=10.0)
    assert len(rig.starts()) == 2
