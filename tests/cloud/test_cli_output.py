"""What the daily commands print, run as a shell user runs them (`python -m harmonaize_cli` in a subprocess) against
the lightest real counterpart: `jobs show` against the real API (uvicorn on a free port, migrated SQLite, the
in-memory broker port), `scenario run` against a real nats-server where the test answers as a simulated host."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from nats.aio.msg import Msg

from api.app import create_app
from api.migrate import upgrade_async
from api.serving import serve_api
from broker_config.server import NatsServer
from harmonaize.settings import Settings
from harmonaize_cli.daily import figure
from provider_agents.runtime import connect_provider
from provider_agents.telemetry.scenario import SCENARIO_INJECT_SUBJECT
from tests.api.api_memory_broker import InMemoryBroker
from tests.api.api_testkit import ADMIN, ADMIN_TOKEN, PROVIDER_SECRET, create_job, create_tenant
from tests.cloud.test_up import HARMONAIZE

pytestmark = pytest.mark.timeout(120)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


async def harmonaize(env: dict[str, str], *args: str, timeout: float = 60) -> Result:
    """Run the CLI without blocking the loop that serves the API in this process."""
    proc = await asyncio.create_subprocess_exec(
        *HARMONAIZE, *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


def clean_env(**variables: str) -> dict[str, str]:
    """This process's environment without the developer's HZ_ variables, plus `variables`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("HZ_")}, **variables}


@pytest.fixture
async def tenant_env(tmp_path: Path) -> AsyncIterator[dict[str, str]]:
    """The real API with tenant acme and its job `train`, which reported one progress line; acme's CLI environment."""
    settings = Settings(_env_file=None, data_dir=tmp_path / "hz", admin_token=ADMIN_TOKEN,
                        provider_secret=PROVIDER_SECRET)
    settings.data_dir.mkdir(parents=True)
    await upgrade_async(settings)
    serving = await serve_api(create_app(settings, broker=InMemoryBroker()), host="127.0.0.1", port=0)
    try:
        api_url = f"http://127.0.0.1:{serving.port}"
        async with httpx.AsyncClient(base_url=api_url, timeout=30) as client:
            acme = await create_tenant(client, "acme")
            await create_job(client, acme, "train")
            progress = await client.post("/v1/provider/progress", headers=ADMIN, json={
                "tenant": "acme", "job": "train", "epoch": 0, "step": 10, "world_size": 1, "parallel_plan": "ddp",
                "loss": 0.123456789, "samples_per_s": 1117.4160867616915, "checkpoint_interval_steps": 200,
                "batch_size": 32, "updated_at": "2026-03-01T12:00:00Z",
            })
            assert progress.status_code == 202, progress.text
        yield clean_env(HZ_API_URL=api_url, HZ_TENANT="acme", HZ_TENANT_TOKEN=acme.token)
    finally:
        await serving.stop()


async def test_jobs_show_rounds_samples_per_second(tenant_env: dict[str, str]) -> None:
    shown = await harmonaize(tenant_env, "jobs", "show", "train")
    assert shown.returncode == 0, shown.stderr
    assert "samples/s 1117.4 " in shown.stdout and "1117.41" not in shown.stdout, shown.stdout
    assert "loss 0.12346 " in shown.stdout, shown.stdout
    assert ", epoch 0, pending\n" in shown.stdout, "the job's phase: it has no worker placed"
    raw = await harmonaize(tenant_env, "jobs", "show", "train", "--json")
    assert json.loads(raw.stdout)["status"]["progress"]["samples_per_s"] == 1117.4160867616915, "JSON stays exact"


async def test_a_missing_job_or_negotiation_is_named(tenant_env: dict[str, str]) -> None:
    missing = await harmonaize(tenant_env, "jobs", "show", "my-job")
    assert missing.returncode == 1
    assert missing.stderr == "harmonaize: job 'my-job' not found\n"
    negotiation = "00000000-0000-7000-8000-000000000000"
    missing = await harmonaize(tenant_env, "negotiations", "show", negotiation)
    assert missing.returncode == 1
    assert missing.stderr == f"harmonaize: negotiation '{negotiation}' not found\n"
    bad = await harmonaize(tenant_env, "jobs", "show", "Not/A-Job")
    assert bad.returncode == 2 and "invalid job id 'Not/A-Job'" in bad.stderr and bad.stderr.count("\n") == 1


async def test_scenario_run_exits_quietly(nats_server: NatsServer, provider_secret: bytes, tmp_path: Path) -> None:
    """A normal run prints its one line on stdout and nothing on stderr (closing its connection is no lost one)."""
    host = await connect_provider(nats_server.url, provider_secret, name="test-simulated-host")
    injected: list[dict[str, object]] = []

    async def answer(msg: Msg) -> None:
        injected.append(json.loads(msg.data))
        await host.publish(msg.reply, json.dumps({"host": "h1", "applied": True}).encode())

    await host.subscribe(SCENARIO_INJECT_SUBJECT, cb=answer)
    await host.flush()
    scenario = tmp_path / "congest.yaml"
    scenario.write_text("version: 1\ncongestion:\n  - {groups: [g1, g2], link: spine-1, start: 0s, duration: 60s, "
                        "slowdown: 3}\n")
    try:
        env = clean_env(HZ_NATS_URL=nats_server.url, HZ_PROVIDER_SECRET=provider_secret.decode())
        result = await harmonaize(env, "scenario", "run", str(scenario), "--wait", "0.5")
    finally:
        await host.close()
    assert result.returncode == 0, result.stderr
    assert result.stdout == "injected congest.yaml into 1 host(s): h1\n"
    assert result.stderr == ""
    assert len(injected) == 1 and injected[0]["scenario"]["congestion"][0]["slowdown"] == 3  # type: ignore[index]

    unanswered = await harmonaize(env, "scenario", "run", str(scenario), "--wait", "0.5")  # the host is gone
    assert unanswered.returncode == 1 and unanswered.stdout == ""
    assert unanswered.stderr == "harmonaize: no simulated host answered: is the local cloud running (harmonaize up)?\n"


@pytest.mark.parametrize(("value", "text"), [
    (1117.4160867616915, "1117.4"), (87.6543, "87.65"), (5.0, "5.000"), (0.031237, "0.03124"), (0.0, "0.0"),
    (123456.78, "123456.8"), (None, "-"),
])
def test_rates_are_printed_to_four_significant_digits(value: float | None, text: str) -> None:
    assert figure(value) == text
