"""`harmonaize up` as a user runs it: a real process tree, credentials a tenant can use, clear one-line failures."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest

from broker_config.render import TENANT_JS_PREFIX
from tests.support import eventually

HARMONAIZE = [sys.executable, "-m", "harmonaize_cli"]


def read_env_file(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        values[key] = shlex.split(value)[0]
    return values


class RunningCloud:
    def __init__(self, proc: subprocess.Popen[str], lines: list[str], data_dir: Path) -> None:
        self.proc, self.lines, self.data_dir = proc, lines, data_dir


def start_up(data_dir: Path, *args: str, env: dict[str, str] | None = None) -> RunningCloud:
    proc = subprocess.Popen(
        [*HARMONAIZE, "up", "--data-dir", str(data_dir), "--api-port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    lines: list[str] = []
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if line.strip().startswith("data dir"):
            return RunningCloud(proc, lines, data_dir)
    proc.kill()
    raise AssertionError("harmonaize up did not come up:\n" + "\n".join(lines))


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[RunningCloud]:
    running = start_up(tmp_path / "hz")
    yield running
    if running.proc.poll() is None:
        running.proc.send_signal(signal.SIGINT)
        running.proc.wait(30)


async def test_up_serves_api_and_broker_with_working_demo_tenant_credentials(cloud: RunningCloud) -> None:
    env = read_env_file(cloud.data_dir / "tenant-demo.env")
    async with httpx.AsyncClient(base_url=env["HZ_API_URL"]) as client:
        assert (await client.get("/v1/healthz")).status_code == 200
        me = await client.get("/v1/tenant", headers={"Authorization": f"Bearer {env['HZ_TENANT_TOKEN']}"})
        assert me.status_code == 200 and me.json()["id"] == "demo"
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(env["HZ_NATS_URL"], nkeys_seed_str=env["HZ_TENANT_NATS_SEED"], error_cb=on_error)
    await nc.subscribe("hz.p.>")
    await nc.flush()
    await eventually(lambda: any("permissions violation" in e for e in errors), what="provider subjects refused")
    info = await nc.jetstream(prefix=TENANT_JS_PREFIX).stream_info("HZ_T_demo")
    assert info.config.subjects == ["hz.t.demo.>"]
    await nc.close()


def test_second_up_on_the_same_data_dir_says_so_in_one_line(cloud: RunningCloud) -> None:
    second = subprocess.run(
        [*HARMONAIZE, "up", "--data-dir", str(cloud.data_dir), "--api-port", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert second.returncode == 1
    assert second.stderr.strip().count("\n") == 0
    assert "already running" in second.stderr and str(cloud.data_dir) in second.stderr


def test_taken_ports_and_bad_config_give_one_clear_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flag in ("--nats-port", "--api-port"):
            args = [*HARMONAIZE, "up", "--data-dir", str(tmp_path / flag), flag, str(port)]
            if flag == "--nats-port":
                args += ["--api-port", "0"]
            result = subprocess.run(args, capture_output=True, text=True, timeout=60)
            assert result.returncode == 1, result.stderr
            assert result.stderr.strip().count("\n") == 0, result.stderr
            assert f"port {port}" in result.stderr and "already in use" in result.stderr
    bad = subprocess.run(
        [*HARMONAIZE, "up", "--data-dir", str(tmp_path / "bad")],
        capture_output=True, text=True, timeout=60, env={**os.environ, "HZ_API_PORT": "eighty"},
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "HZ_API_PORT" in bad.stderr, bad.stderr


def test_plain_up_is_a_quiet_cloud(cloud: RunningCloud, tmp_path: Path) -> None:
    """Without --demo or --scenario the hosts replay no episode (no failure, prediction, congestion or maintenance):
    the scenario the agents were given says so; scenarios come when asked."""
    from provider_agents.telemetry.scenario import load_scenario

    given = load_scenario(cloud.data_dir / "scenario.yaml")
    assert set(given.hosts) == {"h1", "h2", "h3", "h4"}
    episodes = {
        "failures": given.failures, "predicted_failures": given.predicted_failures,
        "congestion": given.congestion, "maintenance": given.maintenance,
    }
    assert not any(episodes.values()), episodes
