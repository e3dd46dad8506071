"""A job's node fails on a host that is itself fine (its agent keeps heartbeating, so no host outage is reported).

A hung node: every process of the job's node on one host of a 2-host job is stopped (SIGSTOP: the stuck rank, the
host fine); the survivors block in a collective. The host's launcher sees the node's processes stopped, declares it
frozen, kills it and reports it; the control plane takes the node out of the job with a new epoch, the survivor
abandons its collective and goes on in place at the smaller size, and the tenant receives a `node_hung` failure
event. (A frozen node that is not stopped by a signal, only silent, is judged by its beat: tests/agents.)

A node out of restarts: its every worker exits 1 at once; once the launcher gives up, the job's status, the tenant's
events and `harmonaize jobs show` say so.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from nats.js.api import ConsumerConfig, DeliverPolicy

from broker_config.provisioner import NatsTenantBroker
from harmonaize.events import Failure, FailureKind, parse_event_as
from harmonaize.pseudonyms import host_pseudonym
from provider_agents.hang_detector import HangBounds
from provider_agents.node_watch import WATCH_INTERVAL_S
from provider_agents.processes import marked_processes
from tests.elastic.harness import CloudFactory, ElasticCloud, mlp_job, wait_for, worker_pids

pytestmark = pytest.mark.timeout(300)

DECLARED_WITHIN_S = HangBounds().stopped_s + 2 * WATCH_INTERVAL_S + 2.0
"""SIGSTOP -> hang declared: the stopped bound (0.3 s), up to two watch passes late, plus 2 s for a loaded 2-core
machine."""
RECOVERY_BUDGET_S = 30.0
"""SIGSTOP -> the survivor's first step at the new size: the declaration, then the same restart as after a host
failure (tests/elastic/test_elastic_failures.py allows 25 s from a 3 s detection)."""


def node_state(cloud: ElasticCloud, host: str, job: str) -> dict[str, Any]:
    return dict(json.loads((cloud.data_dir / "hosts" / host / "jobs" / f"acme.{job}" / "node.json").read_text()))


def freeze_node(cloud: ElasticCloud, host: str, job: str) -> tuple[str, list[int]]:
    """Stop the job's node on `host` (torchrun agent and workers), not the host's agent: (node marker, pids)."""
    state = node_state(cloud, host, job)
    pids = marked_processes(state["marker"])
    if state.get("agent_marker"):
        pids += marked_processes(state["agent_marker"])
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return state["marker"], pids


def host_of_rank0(cloud: ElasticCloud, job: str) -> str:
    for path in cloud.data_dir.glob(f"hosts/*/jobs/acme.{job}/progress.json"):
        return path.parts[-4]
    raise AssertionError("no host has the job's progress file")


async def failure_events(broker: NatsTenantBroker, job: str) -> list[Failure]:
    """The failure events on the tenant's stream about `job` (read by the provider, every one stored)."""
    provider = await broker.provider_connection()
    try:
        js = provider.jetstream()
        subject = f"hz.t.acme.events.failure.{job}"
        info = await js.stream_info("HZ_T_acme", subjects_filter=subject)
        stored = (info.state.subjects or {}).get(subject, 0)
        if not stored:
            return []
        config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        sub = await js.pull_subscribe(subject, stream="HZ_T_acme", config=config)
        messages = await sub.fetch(stored, timeout=5)
        await sub.unsubscribe()
        return [parse_event_as(message.data, Failure).data for message in messages]
    finally:
        await provider.close()


async def test_a_frozen_node_on_a_healthy_host_is_declared_hung_and_the_job_goes_on_without_it(
    make_cloud: CloudFactory, tenant_broker: NatsTenantBroker
) -> None:
    cloud: ElasticCloud = await make_cloud(hosts=("h1", "h2"))
    await cloud.create_job("train", initial_workers=2, **mlp_job())

    async def checkpointed() -> dict[str, Any] | None:
        progress = await cloud.progress("train")
        ok = progress and progress["world_size"] == 2 and progress["last_checkpoint_step"] is not None
        return progress if ok else None

    before = await wait_for(checkpointed, timeout=90, what="a checkpoint at world size 2", interval=0.2)
    victim = "h2" if host_of_rank0(cloud, "train") != "h2" else "h1"
    survivor = "h1" if victim == "h2" else "h2"
    pid = (await worker_pids(cloud, "train", [survivor]))[survivor]
    stopped_at = datetime.now(UTC)
    started = time.monotonic()
    marker, frozen = freeze_node(cloud, victim, "train")
    assert len(frozen) >= 2, f"the node's torchrun and its worker: {frozen}"
    assert cloud.agents[victim].poll() is None, "the host's agent keeps running (and heartbeating)"

    async def hung_event() -> Failure | None:
        events = [e for e in await failure_events(tenant_broker, "train") if e.kind is FailureKind.NODE_HUNG]
        return events[0] if events else None

    after = await cloud.running_at("train", world=1, epoch_at_least=before["epoch"] + 1, steps_after=1)
    recovered_s = time.monotonic() - started
    event = await wait_for(hung_event, timeout=30, what="the tenant's node_hung event", interval=0.2)
    declared_s = (event.detected_at - stopped_at).total_seconds()
    print(f"SIGSTOP -> hang declared {declared_s:.2f} s, -> first step at world 1: {recovered_s:.2f} s")
    assert HangBounds().stopped_s <= declared_s <= DECLARED_WITHIN_S, declared_s
    assert recovered_s < RECOVERY_BUDGET_S, recovered_s
    assert after["resumed_from_step"] is None, "in place: the survivor abandoned its collective, kept its state"
    assert (await worker_pids(cloud, "train", [survivor]))[survivor] == pid, "the survivor was not restarted"
    assert (event.host, event.reason) == (host_pseudonym(cloud.provider_secret, "acme", victim), "frozen")

    await wait_for(lambda: not marked_processes(marker), timeout=10, what="the frozen node's processes killed")
    status = await cloud.status("train")
    assert [(f["kind"], f["reason"], f["left_job"], f["epoch"]) for f in status["node_failures"]] == [
        ("node_hung", "frozen", True, before["epoch"])
    ]
    assert status["desired_workers"] == 1
    hosts = {h["id"]: h for h in (await cloud.admin.get("/v1/hosts")).json()}
    assert hosts[victim]["down_at"] is None and hosts[victim]["allocated_gpus"] == 0, "the host stays up, GPUs free"
    allocations = (await cloud.admin.get("/v1/allocations", params={"tenant_id": "acme", "job_id": "train"})).json()
    assert {a["host_id"] for a in allocations} == {survivor}


async def test_a_node_the_launcher_gave_up_on_shows_in_the_status_the_events_and_jobs_show(
    make_cloud: CloudFactory, tenant_broker: NatsTenantBroker
) -> None:
    cloud: ElasticCloud = await make_cloud(hosts=("h1",))
    await cloud.create_job(
        "broken", initial_workers=1, min_workers=1, max_workers=1, entrypoint=["--no-python", "false"]
    )

    async def given_up() -> list[dict[str, Any]]:
        return list((await cloud.status("broken"))["node_failures"])

    [failure] = await wait_for(given_up, timeout=120, what="the given-up node in the job's status", interval=0.5)
    assert (failure["kind"], failure["reason"], failure["left_job"], failure["epoch"]) == (
        "node_failed", "out_of_restarts", False, 1,
    )
    [event] = await wait_for(lambda: failure_events(tenant_broker, "broken"), timeout=30, what="the tenant's event")
    assert (event.kind, event.reason, event.host) == (
        FailureKind.NODE_FAILED, "out_of_restarts", host_pseudonym(cloud.provider_secret, "acme", "h1"),
    )
    token = cloud.tenant.headers["Authorization"].removeprefix("Bearer ")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HZ_")},
           "HZ_API_URL": cloud.api_url, "HZ_TENANT_TOKEN": token, "HZ_TENANT": "acme"}
    shown = await asyncio.create_subprocess_exec(  # not subprocess.run: the API serves from this test's loop
        sys.executable, "-m", "harmonaize_cli", "jobs", "show", "broken", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(shown.communicate(), 60)
    assert shown.returncode == 0, err.decode()
    assert "node failure: node_failed (out_of_restarts)" in out.decode(), out.decode()
    assert "the job stands still until its epoch moves on" in out.decode()
