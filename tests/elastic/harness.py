"""A real provider around real training jobs: nats-server, the API with its outbox relay, the provider's central
loops (`fleet-monitor`: outages, rendezvous stores, micro loop) and one agent process per simulated host, each
launching torchrun nodes. A "host" is its agent process plus every process carrying its node marker, so a test can
kill or freeze a whole host the way a machine dies or hangs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from api.app import create_app
from api.migrate import upgrade_async
from api.serving import serve_api
from broker_config.provider_bus import NatsProviderBus
from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from harmonaize.job_runtime import NodeLiveness, liveness_path, read_model
from harmonaize.settings import Settings
from provider_agents.markers import cloud_id, host_prefix
from provider_agents.processes import marked_processes, signal_marked

ROOT = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "elastic-admin-token-0123456789abcdef"
TENANT = "acme"
HOSTS = {"h1": "g1", "h2": "g1", "h3": "g2", "h4": "g2"}


async def wait_for(
    probe: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.1
) -> Any:
    """Poll an async or sync probe until it returns something truthy; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


@dataclass
class ElasticCloud:
    data_dir: Path
    api_url: str
    nats_url: str
    admin: httpx.AsyncClient
    tenant: httpx.AsyncClient
    provider_secret: bytes
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    others: list[subprocess.Popen[bytes]] = field(default_factory=list)
    scenario: Path | None = None

    @property
    def cloud(self) -> str:
        """The id its agents derive from the secret and data dir: every marker of this cloud begins with it."""
        return cloud_id(self.provider_secret, self.data_dir)

    def host_prefix(self, host: str) -> str:
        """The marker prefix of `host`'s processes in this cloud (never another test's or a demo's `host`)."""
        return host_prefix(self.cloud, host)

    def env(self) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("HZ_")}
        return {
            **base,
            "HZ_PROVIDER_SECRET": self.provider_secret.decode(),
            "HZ_NATS_URL": self.nats_url,
            "HZ_ADMIN_TOKEN": ADMIN_TOKEN,
            "HZ_API_URL": self.api_url,
            "HZ_DATA_DIR": str(self.data_dir),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
        }

    def _spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.data_dir / f"{name}.log", "ab")
        return subprocess.Popen(
            [sys.executable, "-m", "provider_agents.cli", *args],
            cwd=ROOT, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def start_monitor(self) -> None:
        self.others.append(self._spawn("fleet-monitor", "fleet-monitor", "--log-level", "INFO"))

    def start_agent(self, host: str, *, grace_s: float = 20.0) -> subprocess.Popen[bytes]:
        args = ["agent", "--host-id", host, "--locality-group", HOSTS[host], "--gpus", "1", "--tick", "0.2"]
        if self.scenario is not None:
            args += ["--scenario", str(self.scenario)]
        args += ["--grace", str(grace_s), "--checkpoint-root", str(self.data_dir / "checkpoints")]
        self.agents[host] = self._spawn(f"agent-{host}", *args)
        return self.agents[host]

    def host_processes(self, host: str) -> list[int]:
        """The agent and every node process of `host`."""
        agent = self.agents.get(host)
        pids = marked_processes(self.host_prefix(host), prefix=True)
        return ([agent.pid] if agent is not None and agent.poll() is None else []) + pids

    def kill_host(self, host: str) -> None:
        """The machine dies: the agent and every process of its nodes get SIGKILL at once."""
        agent = self.agents[host]
        os.kill(agent.pid, signal.SIGKILL)
        signal_marked(self.host_prefix(host), signal.SIGKILL, prefix=True)
        agent.wait()

    def freeze_host(self, host: str) -> list[int]:
        """The machine hangs: every process stops, sockets stay open (peers block inside collectives)."""
        pids = self.host_processes(host)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    async def create_job(self, job: str, **body: Any) -> dict[str, Any]:
        reply = await self.tenant.post("/v1/jobs", json={"id": job, **body})
        assert reply.status_code == 201, reply.text
        return dict(reply.json())

    async def status(self, job: str) -> dict[str, Any]:
        reply = await self.tenant.get(f"/v1/jobs/{job}/status")
        assert reply.status_code == 200, reply.text
        return dict(reply.json())

    async def progress(self, job: str) -> dict[str, Any] | None:
        return (await self.status(job))["progress"]

    async def timeline(self, job: str) -> list[dict[str, Any]]:
        reply = await self.tenant.get(f"/v1/jobs/{job}/timeline")
        assert reply.status_code == 200, reply.text
        return list(reply.json())

    async def running_at(
        self, job: str, *, world: int, epoch_at_least: int = 0, steps_after: int = 0
    ) -> dict[str, Any]:
        """Progress once the job runs at `world` workers in an epoch >= `epoch_at_least`, `steps_after` steps past the
        step that epoch began at."""

        async def probe() -> dict[str, Any] | None:
            progress = await self.progress(job)
            if progress is None or progress["world_size"] != world or progress["epoch"] < epoch_at_least:
                return None
            start = progress.get("epoch_step")  # the step the epoch began at (in place or resumed)
            if start is None:
                start = progress["resumed_from_step"] or 0
            return progress if progress["step"] >= start + steps_after else None

        return dict(await wait_for(probe, timeout=90, what=f"{job} running at world size {world}", interval=0.2))

    async def negotiate(self, job: str, body: dict[str, Any], *, option: int = 0) -> dict[str, Any]:
        return await self.accept(await self.open_offer(job, body), option=option)

    async def open_offer(self, job: str, body: dict[str, Any]) -> dict[str, Any]:
        opened = await self.tenant.post(
            "/v1/negotiations", json={"job": job, **body}, headers={"Idempotency-Key": os.urandom(8).hex()}
        )
        assert opened.status_code == 201, opened.text
        negotiation = opened.json()
        assert negotiation["state"] == "offered", negotiation
        return dict(negotiation)

    async def accept(self, negotiation: dict[str, Any], *, option: int = 0) -> dict[str, Any]:
        accepted = await self.tenant.post(f"/v1/negotiations/{negotiation['id']}/accept", json={"option": option})
        assert accepted.status_code == 200, accepted.text
        return dict(accepted.json())

    def hosts_running(self, job: str) -> list[str]:
        """Hosts whose launcher keeps a node record of `job` (placed or standing by), sorted."""
        return sorted(p.parts[-4] for p in self.data_dir.glob(f"hosts/*/jobs/acme.{job}/node.json"))

    def stop_processes(self) -> None:
        """Kill the training nodes first (a graceful stop would checkpoint, which a test's teardown does not need,
        and a frozen host's peers would wait out the grace period), then stop agents and loops."""
        for host in HOSTS:
            signal_marked(self.host_prefix(host), signal.SIGCONT, prefix=True)
            signal_marked(self.host_prefix(host), signal.SIGKILL, prefix=True)
        for proc in [*self.agents.values(), *self.others]:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                proc.send_signal(signal.SIGTERM)
        for proc in [*self.agents.values(), *self.others]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for host in HOSTS:
            signal_marked(self.host_prefix(host), signal.SIGCONT, prefix=True)
            signal_marked(self.host_prefix(host), signal.SIGKILL, prefix=True)

    def logs(self) -> str:
        """Every process log and node log, for a failing test's report."""
        parts = []
        for path in sorted(self.data_dir.rglob("*.log")):
            text = path.read_text(errors="replace")
            parts.append(f"==== {path.relative_to(self.data_dir)}\n{text[-4000:]}")
        return "\n".join(parts)


async def worker_pids(cloud: ElasticCloud, job: str, hosts: list[str]) -> dict[str, int]:
    """host -> pid of its worker (local rank 0), from the liveness file its launcher reads."""

    def probe() -> dict[str, int] | None:
        pids = {}
        for host in hosts:
            beat = read_model(liveness_path(cloud.data_dir / "hosts" / host / "jobs" / f"acme.{job}", 0), NodeLiveness)
            if beat is None:
                return None
            pids[host] = beat.pid
        return pids

    return dict(await wait_for(probe, timeout=60, what=f"workers of {job} beating on {hosts}"))


CloudFactory = Callable[..., Awaitable[ElasticCloud]]
"""The `make_cloud` fixture: `cloud = await make_cloud(hosts=("h1", "h2"), scenario=path)` (elastic_cloud's options)."""


@asynccontextmanager
async def elastic_cloud(
    data_dir: Path,
    *,
    nats_server: NatsServer,
    tenant_broker: NatsTenantBroker,
    provider_secret: bytes,
    hosts: tuple[str, ...] = ("h1", "h2", "h3"),
    scenario: Path | None = None,
) -> AsyncIterator[ElasticCloud]:
    settings = Settings(
        _env_file=None,
        data_dir=data_dir,
        admin_token=ADMIN_TOKEN,
        provider_secret=provider_secret.decode(),
        nats_url=nats_server.url,
    )
    await upgrade_async(settings)
    bus = NatsProviderBus([nats_server.url], provider_secret=provider_secret)
    app = create_app(settings, broker=tenant_broker, bus=bus)
    serving = await serve_api(app, host="127.0.0.1", port=0)
    api_url = f"http://127.0.0.1:{serving.port}"
    cloud: ElasticCloud | None = None
    try:
        async with httpx.AsyncClient(
            base_url=api_url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
        ) as admin:
            created = await admin.post("/v1/tenants", json={"id": TENANT, "display_name": "Acme"})
            assert created.status_code == 201, created.text
            for host in hosts:
                reply = await admin.post("/v1/hosts", json={"id": host, "gpus": 1, "locality_group": HOSTS[host]})
                assert reply.status_code == 201, reply.text
            token = created.json()["api_token"]
            async with httpx.AsyncClient(
                base_url=api_url, headers={"Authorization": f"Bearer {token}"}, timeout=30
            ) as tenant:
                cloud = ElasticCloud(
                    data_dir=data_dir,
                    api_url=api_url,
                    nats_url=nats_server.url,
                    admin=admin,
                    tenant=tenant,
                    provider_secret=provider_secret,
                    scenario=scenario,
                )
                cloud.start_monitor()
                for host in hosts:
                    cloud.start_agent(host)
                try:
                    yield cloud
                except BaseException:
                    print(cloud.logs())
                    raise
                finally:
                    # in a thread: the API in this loop keeps answering the agents while they stop (an agent
                    # reports the node the stop killed before it exits)
                    await asyncio.to_thread(cloud.stop_processes)
    finally:
        await serving.stop()
        await bus.close()


def mlp_job(*, delay_ms: float = 30.0, checkpoint_min: int = 1, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """A job body running the example MLP until stopped, with ranges the micro loop can act in."""
    return {
        "min_workers": 1,
        "max_workers": 4,
        "entrypoint": ["-m", "workloads.examples.mlp", "--step-delay-ms", str(delay_ms), "--checkpoint-interval", "20",
                       *extra],
        "checkpoint_interval_steps": {"min": checkpoint_min, "max": 50},
        "gradient_compression": {"allowed": ["none", "fp16", "powersgd"], "powersgd_max_rank": 4},
        "batch_size": {"min": 8, "max": 64},
    }
