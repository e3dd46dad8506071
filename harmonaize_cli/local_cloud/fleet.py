"""The local cloud's simulated fleet: hosts registered with the control plane, one agent process per host, and the
provider's central loops (`fleet-monitor`: outages, rendezvous stores, micro loop).

Agents run as separate processes, exactly as on real hosts, so killing one (or freezing it) is a host failure the
rest of the system has to notice, and its torchrun nodes are its children. All of them read the same scenario file,
with `start:` pinned to one instant, so the simulated hosts live through the scenario in step.
"""

from __future__ import annotations

import importlib.resources
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import yaml

from harmonaize_cli.local_cloud.testbed import LocalTestbed
from provider_agents.markers import host_prefix
from provider_agents.processes import signal_marked

__all__ = ["DEFAULT_SCENARIO", "LocalFleet", "fleet_of", "pin_scenario", "register_hosts", "scenario_hosts"]

TESTBED_TICK_S = 0.25
"""Testbed agents sample their links four times per congestion window (1 s), so a queue that drains between a job's
steps is seen to drain, and a congestion is reported within about a second of its start."""
DEFAULT_SCENARIO = Path(str(importlib.resources.files("provider_agents") / "scenarios" / "quiet.yaml"))
"""A quiet fleet: the hosts and the carbon trace, no scripted episode.

The episodes come with `scenario run` or `--scenario`.
"""


def scenario_hosts(scenario: Path) -> dict[str, tuple[str, int]]:
    """{host: (locality group, gpus)} from a scenario file's `hosts:` section."""
    loaded = yaml.safe_load(scenario.read_text()) or {}
    hosts = loaded.get("hosts") or {}
    return {
        str(host): (str(spec.get("locality_group", "default")), int(spec.get("gpus", 8)))
        for host, spec in hosts.items()
    }


def fleet_of(count: int, *, groups: int = 2, gpus: int = 4) -> dict[str, tuple[str, int]]:
    """`count` hosts h1..hN spread over `groups` locality groups g1..gK, in contiguous blocks."""
    if count < 1:
        raise ValueError("the fleet needs at least one host")
    groups = max(1, min(groups, count))
    return {f"h{i + 1}": (f"g{i * groups // count + 1}", gpus) for i in range(count)}


def pin_scenario(
    scenario: Path,
    out: Path,
    *,
    start: datetime,
    speedup: float | None = None,
    hosts: dict[str, tuple[str, int]] | None = None,
) -> Path:
    """Copy `scenario` to `out` with `start:` pinned, so every agent counts offsets from the same instant (and, given
    `hosts`, with that fleet instead of the file's)."""
    loaded: dict[str, Any] = yaml.safe_load(scenario.read_text()) or {}
    loaded["start"] = start.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if hosts is not None:
        hosts_in_file: dict[str, dict[str, Any]] = loaded.get("hosts") or {}
        first_host: dict[str, Any] = next(iter(hosts_in_file.values()), {})
        region = first_host.get("region")
        loaded["hosts"] = {
            host: {"locality_group": group, "gpus": gpus, **({"region": region} if region else {})}
            for host, (group, gpus) in hosts.items()
        }
    if speedup is not None:
        for spec in (loaded.get("carbon") or {}).values():
            if isinstance(spec, dict) and "trace" in spec:
                spec["speedup"] = speedup
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(loaded, sort_keys=False))
    return out


async def register_hosts(api_url: str, admin_token: str, hosts: dict[str, tuple[str, int]]) -> None:
    """Register every host with the control plane (an existing one is kept as it is)."""
    async with httpx.AsyncClient(
        base_url=api_url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=30
    ) as client:
        for host, (group, gpus) in hosts.items():
            reply = await client.post("/v1/hosts", json={"id": host, "gpus": gpus, "locality_group": group})
            if reply.status_code not in (201, 409):
                raise RuntimeError(f"registering host {host} failed: {reply.status_code} {reply.text}")


@dataclass
class LocalFleet:
    """The agent and fleet-monitor processes of the local cloud."""

    data_dir: Path
    env: dict[str, str]
    scenario: Path
    hosts: dict[str, tuple[str, int]]
    cloud: str
    """The cloud id its agents derive (`markers.cloud_id`): host kills reach only this cloud's node processes."""
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    testbed: LocalTestbed | None = None
    """On the testbed, each agent runs inside its host's namespace and the stores listen on the services address."""

    def _spawn(self, name: str, *args: str, host: str | None = None) -> subprocess.Popen[bytes]:
        logs = self.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "provider_agents.cli", *args]
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        if self.testbed is not None and host is not None:
            command = self.testbed.agent_command(host, command)
            env.update(self.testbed.agent_env)
        with open(logs / f"{name}.log", "ab") as log:
            return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self) -> None:
        bind = ["--rendezvous-bind", self.testbed.services_address] if self.testbed is not None else []
        self.processes["fleet-monitor"] = self._spawn("fleet-monitor", "fleet-monitor", *bind)
        for host in self.hosts:
            self.start_agent(host)

    def start_agent(self, host: str) -> None:
        group, gpus = self.hosts[host]
        self.processes[host] = self._spawn(
            f"agent-{host}",
            "agent", "--host-id", host, "--locality-group", group, "--gpus", str(gpus),
            "--scenario", str(self.scenario), "--tick",
            "0.5" if self.testbed is None else str(TESTBED_TICK_S),
            host=host,
        )

    def agent_running(self, host: str) -> bool:
        proc = self.processes.get(host)
        return proc is not None and proc.poll() is None

    def log_file(self, name: str) -> Path:
        return self.data_dir / "logs" / f"{name}.log"

    def kill_host(self, host: str) -> None:
        """The machine dies: its agent and every process of its nodes, at once (what the demo's failure is)."""
        agent = self.processes[host]
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        signal_marked(host_prefix(self.cloud, host), signal.SIGKILL, prefix=True)

    def stop(self, *, timeout_s: float = 40.0) -> None:
        """SIGTERM everything (agents stop their nodes, which checkpoint), then kill what is left."""
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = datetime.now(UTC) + timedelta(seconds=timeout_s)
        for proc in self.processes.values():
            remaining = max(0.1, (deadline - datetime.now(UTC)).total_seconds())
            try:
                proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for host in self.hosts:
            signal_marked(host_prefix(self.cloud, host), signal.SIGKILL, prefix=True)
