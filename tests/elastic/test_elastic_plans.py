"""The rest of the flows on running jobs: repartition by agreement, the provider's micro loop acting within the
tenant's ranges (and the job refusing what it cannot apply), and an agent restart that leaves healthy workers alone."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from provider_agents.processes import alive
from tests.elastic.harness import CloudFactory, ElasticCloud, mlp_job, wait_for

pytestmark = pytest.mark.timeout(300)


async def test_repartition_ddp_to_hsdp_resumes_from_resharded_state(make_cloud: CloudFactory) -> None:
    cloud: ElasticCloud = await make_cloud(hosts=("h1", "h2", "h3", "h4"))
    await cloud.create_job("train", initial_workers=4, **mlp_job(delay_ms=50))
    before = await cloud.running_at("train", world=4, steps_after=5)
    assert before["parallel_plan"] == "ddp"
    await cloud.negotiate("train", {"kind": "repartition", "terms": {"parallel_plan": "hsdp"}})

    async def hsdp() -> dict[str, Any] | None:
        progress = await cloud.progress("train")
        if not progress or progress["parallel_plan"] != "hsdp" or progress["epoch"] <= before["epoch"]:
            return None
        return progress if progress["step"] > (progress["resumed_from_step"] or 0) else None

    after = await wait_for(hsdp, timeout=120, what="the job running as HSDP", interval=0.2)
    assert after["world_size"] == 4
    assert after["resumed_from_step"] >= before["step"]
    assert "shard groups" in after["plan_note"], after["plan_note"]  # two groups of two, one per locality group
    plans = [entry["parallel_plan"] for entry in await cloud.timeline("train")]
    assert plans == ["ddp", "hsdp"]


async def test_congestion_makes_the_micro_loop_compress_within_the_ranges(
    make_cloud: CloudFactory, tmp_path: Path
) -> None:
    scenario = tmp_path / "congested.yaml"
    scenario.write_text(
        "version: 1\nseed: 1\n"
        "hosts:\n  h1: {locality_group: g1, gpus: 1}\n  h2: {locality_group: g1, gpus: 1}\n"
        "congestion:\n  - {groups: [g1], link: leaf-3:eth1, start: 0s, duration: 3600s, slowdown: 1.5}\n"
    )
    cloud: ElasticCloud = await make_cloud(hosts=("h1", "h2"), scenario=scenario)
    await cloud.create_job("train", initial_workers=2, **mlp_job())

    async def compressed() -> dict[str, Any] | None:
        progress = await cloud.progress("train")
        return progress if progress and progress["compression"] == "fp16" else None

    progress = await wait_for(compressed, timeout=90, what="fp16 compression applied by the job", interval=0.2)
    assert progress["world_size"] == 2
    directives = (await cloud.tenant.get("/v1/jobs/train/directives")).json()
    applied = [d for d in directives if d["state"] == "applied"]
    assert applied and applied[0]["settings"]["compression"] == "fp16"
    assert "congestion" in applied[0]["reason"]


async def test_a_directive_the_job_cannot_apply_is_refused_and_the_tenant_sees_why(cloud: ElasticCloud) -> None:
    await cloud.create_job("train", initial_workers=2, parallel_plan="fsdp", **mlp_job())
    await cloud.running_at("train", world=2, steps_after=3)
    issued = await cloud.admin.put(
        "/v1/provider/jobs/acme/train/directives", json={"compression": "fp16", "reason": "test: congestion"}
    )
    assert issued.status_code == 200, issued.text
    version = issued.json()["version"]

    async def refused() -> dict[str, Any] | None:
        listed = (await cloud.tenant.get("/v1/jobs/train/directives")).json()
        return next((d for d in listed if d["version"] == version and d["state"] == "refused"), None)

    record = await wait_for(refused, timeout=60, what="the job's refusal of fp16 under FSDP")
    assert record["refusals"] and any("fsdp" in reason.lower() or "ddp" in reason.lower()
                                      for reason in record["refusals"])
    out_of_range = await cloud.admin.put(
        "/v1/provider/jobs/acme/train/directives", json={"compression": "powersgd", "powersgd_rank": 64}
    )
    assert out_of_range.status_code == 422
    assert "powersgd_rank" in out_of_range.json()["reason"]


async def test_an_agent_restart_adopts_its_running_node_instead_of_restarting_it(cloud: ElasticCloud) -> None:
    await cloud.create_job("train", initial_workers=2, **mlp_job())
    before = await cloud.running_at("train", world=2, steps_after=5)
    state_file = next(cloud.data_dir.glob("hosts/h1/jobs/acme.train/node.json"))
    node_pid = json.loads(state_file.read_text())["pid"]
    agent = cloud.agents["h1"]
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    assert alive(node_pid), "the node outlives its agent"
    cloud.start_agent("h1")
    log_file = cloud.data_dir / "agent-h1.log"
    # The job trains on without its agent, so reaching later steps says nothing about the new agent: wait for it.
    await wait_for(lambda: "adopted running node" in log_file.read_text(), timeout=60,
                   what="the restarted agent adopting the node")
    later = await cloud.running_at("train", world=2, steps_after=before["step"] + 20)
    assert later["epoch"] == before["epoch"], "no new epoch: nothing was restarted"
    assert alive(node_pid)
    assert json.loads(state_file.read_text())["pid"] == node_pid
    assert log_file.read_text().count("started acme/train") == 1
