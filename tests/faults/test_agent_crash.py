"""Host agents crash (SIGKILL) and restart while a real training job runs: no worker is launched twice and no
healthy worker is restarted; training goes on in the same placement epoch.

The whole provider of tests/elastic/harness.py (API, broker, central loops, one agent process per host, torchrun
nodes). tests/elastic/test_elastic_plans.py shows one agent restart adopting its node (same node pid, same epoch).
Here both hosts' agents crash, h1's twice in a row (the second time right after it adopted its node), and what is
compared is every process of the job on every host, by pid: the torchrun agents and their workers must be exactly the
processes that ran before the crashes, each host's agent log must show one launch in total, and the job's progress
must keep counting up from where it was (no resume from a checkpoint, which a restarted worker would do).

Each agent is restarted at once, as a supervisor would, and adopts its node within about a second: inside the fleet
monitor's heartbeat window (3 s). An agent away longer than that is indistinguishable from a dead host, and moving
the job off it is then the intended behaviour (tests/elastic/test_elastic_failures.py).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from provider_agents.processes import alive, marked_processes
from tests.elastic.harness import ElasticCloud, elastic_cloud, mlp_job, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HOSTS = ("h1", "h2")


def job_processes(cloud: ElasticCloud, host: str) -> set[int]:
    """Pids of the job's processes on `host`: its torchrun agent (the node's pid) and every process carrying the job's
    node marker (its workers), which begins with this cloud's id, so no other test's or demo's `host` is counted. The
    spare warm torchrun process a launcher keeps ready belongs to no job (an agent that restarts starts a new one)."""
    pids = {node_pid(cloud, host)} if alive(node_pid(cloud, host)) else set()
    return pids | set(marked_processes(cloud.host_prefix(host) + "acme.train.", prefix=True))


def node_pid(cloud: ElasticCloud, host: str) -> int:
    return int(json.loads((cloud.data_dir / f"hosts/{host}/jobs/acme.train/node.json").read_text())["pid"])


def agent_log(cloud: ElasticCloud, host: str) -> str:
    return (cloud.data_dir / f"agent-{host}.log").read_text(errors="replace")


async def crash_and_restart(cloud: ElasticCloud, host: str) -> float:
    """SIGKILL the agent, start a new one at once (as a supervisor would), wait until it adopted its node; how long
    the host was without an agent. It must come back within the fleet monitor's heartbeat window (3 s), or the
    provider rightly declares the host down and moves the job off it."""
    adopted = agent_log(cloud, host).count("adopted running node")
    agent = cloud.agents[host]
    killed = time.monotonic()
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    cloud.start_agent(host)
    await wait_for(lambda: agent_log(cloud, host).count("adopted running node") > adopted, timeout=30,
                   what=f"the restarted agent of {host} adopting its node")
    return time.monotonic() - killed


async def test_agents_crash_and_restart_without_a_duplicate_launch_or_a_restarted_worker(
    tmp_path: Path, nats_server: NatsServer, tenant_broker: NatsTenantBroker, provider_secret: bytes
) -> None:
    async with elastic_cloud(tmp_path / "cloud", nats_server=nats_server, tenant_broker=tenant_broker,
                             provider_secret=provider_secret, hosts=HOSTS) as cloud:
        await cloud.create_job("train", initial_workers=2, **mlp_job())
        before = await cloud.running_at("train", world=2, steps_after=5)
        processes = {host: job_processes(cloud, host) for host in HOSTS}
        nodes = {host: node_pid(cloud, host) for host in HOSTS}
        assert all(len(pids) >= 2 for pids in processes.values()), f"torchrun and a worker per host: {processes}"
        assert all(nodes[host] in processes[host] for host in HOSTS)

        downtimes = []
        for host in ("h1", "h1", "h2"):  # h1 twice: the second crash comes right after it adopted its node
            downtimes.append(await crash_and_restart(cloud, host))

        later = await cloud.running_at("train", world=2, steps_after=before["step"] + 20)
        after = {host: job_processes(cloud, host) for host in HOSTS}
        nodes_after = {host: node_pid(cloud, host) for host in HOSTS}
        logs = {host: agent_log(cloud, host) for host in HOSTS}
        monitor_log = (cloud.data_dir / "fleet-monitor.log").read_text(errors="replace")

    print(f"\nagents back and adopting after {', '.join(f'{d:.1f} s' for d in downtimes)}; "
          f"before the crashes: step {before['step']}, epoch {before['epoch']}, processes {processes}; "
          f"after: step {later['step']}, epoch {later['epoch']}, processes {after}; launches "
          f"{ {h: logs[h].count('started acme/train') for h in HOSTS} }, adoptions "
          f"{ {h: logs[h].count('adopted running node') for h in HOSTS} }")
    down = "host h1 missed" in monitor_log or "host h2 missed" in monitor_log
    assert after == processes, (
        "the same torchrun agents and workers, no more and no fewer, on every host"
        + (" (an agent took longer than the heartbeat window to come back: see the fleet monitor)" if down else ""))
    assert nodes_after == nodes
    assert later["epoch"] == before["epoch"], "no new placement epoch: nothing was relaunched"
    assert later["resumed_from_step"] == before["resumed_from_step"], "no worker resumed from a checkpoint"
    for host in HOSTS:
        assert logs[host].count("started acme/train") == 1, f"{host}: the node was launched once, before the crashes"
    assert logs["h1"].count("adopted running node") == 2 and logs["h2"].count("adopted running node") == 1
