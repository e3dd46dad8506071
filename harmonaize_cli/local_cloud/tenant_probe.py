"""The demo tenant of a running local cloud as a measuring instrument: submit a job, read its progress, time its
training rate over a window, wait for one of its events, release it; and the provider's hand to inject scenario
episodes. Used by trials that compare what a job does with and without cooperation (`congestion_trial`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from harmonaize.events import split_event_type
from harmonaize.subjects import tenant_events_filter
from provider_agents.runtime import connect_provider
from provider_agents.telemetry.scenario import SCENARIO_INJECT_SUBJECT, Scenario, ScenarioInjection

__all__ = ["Rate", "TenantProbe", "inject_scenario"]

DEMO_TENANT = "demo"


@dataclass(frozen=True)
class Rate:
    """Samples per second over a window, from the job's own progress reports (steps and their report times)."""

    samples_per_s: float
    steps: int
    seconds: float


def _env(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            key, value = line[len("export "):].split("=", 1)
            values[key] = json.loads(value)
    return values


class TenantProbe:
    """The demo tenant (its env file in the cloud's data dir) and the admin, over REST and NATS."""

    def __init__(self, data_dir: Path) -> None:
        tenant, admin = _env(data_dir / f"tenant-{DEMO_TENANT}.env"), _env(data_dir / "admin.env")
        self.data_dir = data_dir
        self.tenant_env = tenant
        self.api_url, self.nats_url = tenant["HZ_API_URL"], tenant["HZ_NATS_URL"]
        self.seed = tenant["HZ_TENANT_NATS_SEED"]
        self.secret = admin["HZ_PROVIDER_SECRET"].encode()
        self.tenant = httpx.AsyncClient(
            base_url=self.api_url, headers={"Authorization": f"Bearer {tenant['HZ_TENANT_TOKEN']}"}, timeout=30
        )
        self.admin = httpx.AsyncClient(
            base_url=self.api_url, headers={"Authorization": f"Bearer {admin['HZ_ADMIN_TOKEN']}"}, timeout=30
        )
        self._nc: Client | None = None
        self.events: list[tuple[float, dict[str, Any]]] = []
        """(monotonic arrival, CloudEvent) of every event of the tenant since `listen`."""

    async def listen(self) -> None:
        """Record every event of the tenant from now on (core subscription: what a live controller sees)."""
        self._nc = await nats.connect(self.nats_url, nkeys_seed_str=self.seed, name="hz-tenant-probe")

        async def on_event(msg: Msg) -> None:
            self.events.append((time.monotonic(), json.loads(msg.data)))

        await self._nc.subscribe(tenant_events_filter(DEMO_TENANT), cb=on_event)

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()
        await self.tenant.aclose()
        await self.admin.aclose()

    async def submit(self, job: dict[str, Any]) -> None:
        reply = await self.tenant.post("/v1/jobs", json=job)
        if reply.status_code != 201:
            raise RuntimeError(f"submitting {job['id']} failed: {reply.status_code} {reply.text}")

    async def job_status(self, job: str) -> dict[str, Any]:
        """`GET /v1/jobs/{job}/status`: phase, desired workers, epoch and the latest progress (or None)."""
        reply = await self.tenant.get(f"/v1/jobs/{job}/status")
        reply.raise_for_status()
        status: dict[str, Any] = reply.json()
        return status

    async def progress(self, job: str) -> dict[str, Any] | None:
        progress: dict[str, Any] | None = (await self.job_status(job))["progress"]
        return progress

    async def wait_progress(
        self, job: str, check: Callable[[dict[str, Any]], bool], *, timeout: float, what: str
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            progress = await self.progress(job)
            if progress is not None and check(progress):
                return progress
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout:g} s (last progress: {progress})")
            await asyncio.sleep(0.2)

    async def rate(self, job: str, window_s: float) -> Rate:
        """The job's samples/s over about `window_s`, between two progress reports of the same epoch."""
        first = await self.wait_progress(job, lambda p: True, timeout=30, what=f"{job}: a progress report")
        await asyncio.sleep(window_s)  # the window is the measurement itself, not a wait for a condition
        last = await self.wait_progress(
            job, lambda p: p["updated_at"] != first["updated_at"], timeout=30, what=f"{job}: a newer report"
        )
        if last["epoch"] != first["epoch"]:
            raise RuntimeError(f"{job} changed epoch during the window ({first['epoch']} -> {last['epoch']})")
        seconds = (_at(last["updated_at"]) - _at(first["updated_at"])).total_seconds()
        steps = last["step"] - first["step"]
        per_step = last["batch_size"] * last["gradient_accumulation"] * last["world_size"]
        return Rate(samples_per_s=steps * per_step / seconds, steps=steps, seconds=seconds)

    def first_event(self, kind: str, job: str, check: Callable[[dict[str, Any]], bool], *,
                    after: float) -> float | None:
        """When (monotonic) the first event of `kind` for `job` satisfying `check` arrived after `after`."""
        found = self.first_match(kind, job, check, after=after)
        return None if found is None else found[0]

    def first_match(self, kind: str, job: str, check: Callable[[dict[str, Any]], bool], *,
                    after: float) -> tuple[float, dict[str, Any]] | None:
        """The first event of `kind` for `job` satisfying `check` that arrived after `after`: (arrival, its data)."""
        for arrived, event in self.events:
            split = split_event_type(str(event.get("type", "")))
            if arrived < after or split is None or split[0] != kind or event.get("subject") != job:
                continue
            if check(event["data"]):
                return arrived, event["data"]
        return None

    def start_controller(self, script: Path, job: str, *, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`harmonaize controller run script` for `job`, as the tenant, logging to the cloud's logs dir; `env` adds
        the script's own settings (thresholds)."""
        logs = self.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, **self.tenant_env, **(env or {}), "HZ_JOB": job, "PYTHONUNBUFFERED": "1"}
        with open(logs / f"controller-{job}.log", "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "harmonaize_cli", "controller", "run", str(script),
                 "--state-dir", str(self.data_dir / "controllers" / job)],
                env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    @staticmethod
    async def stop_controller(process: subprocess.Popen[bytes], *, timeout: float = 20.0) -> None:
        """SIGTERM (the runner finishes handlers in flight), then SIGKILL after `timeout`."""
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(process.wait, timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            await asyncio.to_thread(process.wait)

    async def release(self, job: str) -> None:
        """Release every worker of the job (its end, as the provider sees it)."""
        reply = await self.admin.get("/v1/allocations", params={"tenant_id": DEMO_TENANT, "job_id": job})
        reply.raise_for_status()
        for allocation in reply.json():
            released = await self.admin.delete(f"/v1/allocations/{allocation['id']}")
            if released.status_code not in (200, 409):
                released.raise_for_status()


async def inject_scenario(nats_url: str, secret: bytes, scenario: Scenario, *, at: datetime | None = None) -> int:
    """Send `scenario` to every host and the testbed (what `harmonaize scenario run` does); how many applied it."""
    nc = await connect_provider(nats_url, secret, name="hz-probe-inject")
    try:
        inbox = nc.new_inbox()
        replies: list[dict[str, Any]] = []

        async def on_reply(msg: Msg) -> None:
            replies.append(json.loads(msg.data))

        await nc.subscribe(inbox, cb=on_reply)
        injection = ScenarioInjection(scenario=scenario, at=at or datetime.now(UTC))
        await nc.publish(SCENARIO_INJECT_SUBJECT, injection.model_dump_json().encode(), reply=inbox)
        await nc.flush()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # replies from an unknown number of hosts: collect for a short window
            await asyncio.sleep(0.05)
        return sum(1 for reply in replies if reply.get("applied"))
    finally:
        await nc.close()


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))
