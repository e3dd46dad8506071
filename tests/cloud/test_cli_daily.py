"""The daily commands against a running `harmonaize up`, as a shell user runs them: the tenant's jobs, negotiations
and live events, and a scenario injected into the running simulated hosts."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.cloud.test_up import HARMONAIZE, RunningCloud, read_env_file, start_up

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def small_cloud(tmp_path: Path) -> Iterator[RunningCloud]:
    running = start_up(tmp_path / "hz", "--hosts", "2")
    yield running
    if running.proc.poll() is None:
        running.proc.send_signal(signal.SIGINT)
        running.proc.wait(60)


def _run(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HARMONAIZE, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _env(*files: Path) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("HZ_")}
    for path in files:
        base.update(read_env_file(path))
    return base


def test_jobs_negotiations_events_and_scenario_commands(small_cloud: RunningCloud, tmp_path: Path) -> None:
    tenant = _env(small_cloud.data_dir / "tenant-demo.env")
    admin = _env(small_cloud.data_dir / "admin.env")
    headers = {"Authorization": f"Bearer {tenant['HZ_TENANT_TOKEN']}"}
    with httpx.Client(base_url=tenant["HZ_API_URL"], headers=headers, timeout=30) as api:
        created = api.post("/v1/jobs", json={
            "id": "train", "min_workers": 1, "max_workers": 2, "gpus_per_worker": 4, "initial_workers": 2,
            "entrypoint": ["-m", "workloads.examples.mlp", "--step-delay-ms", "50"],
        })
        assert created.status_code == 201, created.text
        opened = api.post("/v1/negotiations", json={"job": "train", "kind": "scale", "terms": {"desired_workers": 1}},
                          headers={"Idempotency-Key": "cli-1"})
        assert opened.status_code == 201, opened.text
        negotiation = opened.json()["id"]

    listed = _run(tenant, "jobs", "list")
    assert listed.returncode == 0 and "train" in listed.stdout
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        shown = _run(tenant, "jobs", "show", "train")
        assert shown.returncode == 0, shown.stderr
        if "step " in shown.stdout and "world 2" in shown.stdout:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"the job never reported progress:\n{shown.stdout}")

    negotiations = _run(tenant, "negotiations", "list", "--job", "train")
    assert negotiations.returncode == 0 and negotiation in negotiations.stdout
    detail = _run(tenant, "negotiations", "show", negotiation)
    assert detail.returncode == 0 and "tenant   request" in detail.stdout and "provider" in detail.stdout
    missing = _run(tenant, "negotiations", "show", "00000000-0000-7000-8000-000000000000")
    assert missing.returncode == 1 and "not found" in missing.stderr and missing.stderr.count("\n") == 1

    tail = subprocess.Popen(
        [*HARMONAIZE, "events", "tail", "--kind", "congestion", "--job", "train", "--count", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=tenant,
    )
    time.sleep(1.0)  # the tail must be subscribed before the episode starts; it waits for its event below
    scenario = tmp_path / "congest.yaml"
    scenario.write_text(
        "version: 1\ncongestion:\n  - {groups: [g1, g2], link: spine-1, start: 0s, duration: 60s, slowdown: 3}\n"
    )
    injected = _run(admin, "scenario", "run", str(scenario))
    assert injected.returncode == 0, injected.stderr
    assert "into 2 host(s): h1, h2" in injected.stdout
    out, err = tail.communicate(timeout=60)
    assert tail.returncode == 0, err
    assert "congestion" in out and "train" in out

    bad_scenario = tmp_path / "bad.yaml"
    bad_scenario.write_text("version: 1\ncongestion:\n  - {groups: [g1], start: 0s, slowdown: 0.5}\n")
    refused = _run(admin, "scenario", "run", str(bad_scenario))
    assert refused.returncode == 2 and "slowdown" in refused.stderr


def test_tenant_commands_name_missing_credentials(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HZ_")}
    result = subprocess.run([*HARMONAIZE, "jobs", "list"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2 and "HZ_TENANT_TOKEN" in result.stderr
    result = subprocess.run([*HARMONAIZE, "events", "tail", "--kind", "nonsense"], capture_output=True, text=True,
                            timeout=60, env={**env, "HZ_TENANT": "demo", "HZ_TENANT_NATS_SEED": "SUAX"})
    assert result.returncode == 2 and "nonsense" in result.stderr
