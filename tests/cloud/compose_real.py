"""docker-compose.yml run for real by a Docker engine: the engine, and one private compose project per test.

The engine: on the machines this project's CI uses, a machine-local tool beside the repository
(`../shared/tools/compose-here`, outside the project) installs a Docker engine and Compose v2, starts the engine,
builds local stand-ins for the official images (the public registry is unreachable there) and writes a Compose
override that builds our image from them. Where that tool is absent (a user's clone) or no engine can be had, the
tests skip and say why; under `CI=1`, where the tool exists, they fail instead. An engine the tool starts for the test
is stopped afterwards; one that already ran is left alone.

A project (`ComposeProject`): a unique project name (`hz-<random>`), so it never touches another run or a user's own
`harmonaize` project; its own env file (`--env-file`, fresh secrets, free host ports) in the test's temporary
directory; the process environment cleaned of every variable the compose file reads, so nothing from the caller's
shell leaks in. `down()` removes its containers, networks and volumes; `leftovers()` lists whatever still carries its
project label.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from broker_config.server import free_port
from tests.cloud.compose_env import COMPOSE_FILE, env_example

ROOT = COMPOSE_FILE.parent
ENGINE_TOOL = ROOT.parent / "shared" / "tools" / "compose-here"
"""The machine-local tool that gives a Docker engine where the public registry is out of reach (CI's machines)."""
PREPARE_TIMEOUT_S = 1200.0
"""A cold machine: Debian packages, a debootstrapped base, the stand-in images (about 2-6 minutes, more under load)."""
IMAGE_LABEL = "org.opencontainers.image.title=harmonaize"
"""The label our Dockerfile gives its image."""
CLUSTER_SETTINGS = ("COMPOSE_PROFILES", "NATS_CONFIG", "NATS_REPLICAS")
"""The .env.example lines (commented out there) that switch on the `cluster` profile."""


def _unavailable(reason: str) -> None:
    """Skip with the reason; under CI=1 (where the engine tool exists) fail instead."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must be able to run docker-compose.yml for real")
    pytest.skip(reason)


def engine_reachable() -> bool:
    try:
        done = subprocess.run(["docker", "info"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@dataclass(frozen=True)
class Engine:
    override: Path
    """The machine-local Compose override (our image built from the local stand-ins)."""
    started: bool
    """The engine was started for these tests (and is stopped after them)."""

    def stop(self) -> None:
        if self.started:
            subprocess.run([str(ENGINE_TOOL / "stop.sh")], capture_output=True, timeout=120, check=False)


def prepare_engine() -> Engine:
    """The engine and the override, or a skip (a fail under CI=1) that says why none can be had here."""
    prepare = ENGINE_TOOL / "prepare.sh"
    if not prepare.is_file():
        pytest.skip(
            f"no Docker engine can be had here: these tests run docker-compose.yml through the machine-local tool at "
            f"{ENGINE_TOOL} (it builds local stand-ins for the official images), which this machine does not have"
        )
    if os.geteuid() != 0 and not engine_reachable():
        _unavailable("no Docker engine can be had here: none runs, and starting one needs root")
    running_before = engine_reachable()
    try:
        done = subprocess.run(
            [str(prepare), str(ROOT)], capture_output=True, text=True, timeout=PREPARE_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        _unavailable(f"no Docker engine could be had: {prepare} ran past {PREPARE_TIMEOUT_S:.0f} s ({exc.stderr!r})")
        raise
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].startswith("OVERRIDE="):
        _unavailable(
            f"no Docker engine could be had: {prepare} exited {done.returncode}\n{done.stdout[-2000:]}"
            f"\n{done.stderr[-3000:]}"
        )
    override = Path(lines[-1].removeprefix("OVERRIDE="))
    started = not running_before and engine_reachable()
    return Engine(override=override, started=started)


def _clean_environment() -> dict[str, str]:
    """The caller's environment without anything docker-compose.yml (or Compose itself) would read from it."""
    active, commented = env_example()
    ours = set(active) | set(commented)
    return {
        k: v
        for k, v in os.environ.items()
        if k not in ours and not k.startswith(("HZ_", "COMPOSE_", "NATS_")) and k != "POSTGRES_PASSWORD"
    }


def _secret() -> str:
    """Letters and digits only (.env.example: the values go into URLs as they are)."""
    return secrets.token_hex(16)


@dataclass
class ComposeProject:
    """One compose project of docker-compose.yml (plus the engine's override), private to one test."""

    engine: Engine
    scratch: Path
    cluster: bool = False
    name: str = field(default_factory=lambda: f"hz-{secrets.token_hex(4)}")
    env: dict[str, str] = field(init=False)
    env_file: Path = field(init=False)

    def __post_init__(self) -> None:
        active, commented = env_example()
        self.env = {
            **active,
            "HZ_ADMIN_TOKEN": _secret(),
            "HZ_PROVIDER_SECRET": _secret(),
            "POSTGRES_PASSWORD": _secret(),
        }
        ports = {"API_PORT": free_port(), "NATS_PORT": free_port(), "NATS_MONITOR_PORT": free_port()}
        assert len(set(ports.values())) == len(ports), ports
        assert set(ports) <= set(commented), ".env.example documents the host ports"
        self.env.update({k: str(v) for k, v in ports.items()})
        if self.cluster:
            self.env.update({k: commented[k] for k in CLUSTER_SETTINGS})
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.env_file = self.scratch / f"{self.name}.env"
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in self.env.items()))
        self.env_file.chmod(0o600)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.env['API_PORT']}"

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.env['NATS_PORT']}"

    def argv(self, *args: str) -> list[str]:
        return [
            "docker", "compose", "--project-directory", str(ROOT), "-f", str(COMPOSE_FILE),
            "-f", str(self.engine.override), "--env-file", str(self.env_file), "-p", self.name, *args,
        ]

    def compose(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            self.argv(*args), capture_output=True, text=True, timeout=timeout, env=_clean_environment(), check=False
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"docker compose {' '.join(args)} exited {done.returncode}\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
            )
        return done

    def build(self, *, timeout: float = 1200) -> None:
        """Build our image (cached layers where nothing changed): broker-init's build, the one every service of ours
        runs. Builds of it that a rebuild left untagged, and no container uses, are removed (each holds a copy of the
        project's installed dependencies)."""
        self.compose("build", "broker-init", timeout=timeout)
        subprocess.run(
            ["docker", "image", "prune", "--force", "--filter", "dangling=true", "--filter", f"label={IMAGE_LABEL}"],
            capture_output=True, text=True, timeout=120, check=False,
        )

    def up(self, *, timeout: float = 600) -> None:
        """Start everything from the image `build()` made; returns once every service is healthy (or done)."""
        self.compose("up", "--detach", "--no-build", "--wait", "--wait-timeout", str(int(timeout) - 30),
                     timeout=timeout)

    def down(self) -> subprocess.CompletedProcess[str]:
        return self.compose("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout=300, check=False)

    def leftovers(self) -> dict[str, list[str]]:
        """Whatever of this project the engine still has (containers, volumes, networks carrying its label)."""
        label = f"label=com.docker.compose.project={self.name}"
        found: dict[str, list[str]] = {}
        listings = {"containers": ["ps", "-a"], "volumes": ["volume", "ls"], "networks": ["network", "ls"]}
        for kind, listing in listings.items():
            done = subprocess.run(
                ["docker", *listing, "--quiet", "--filter", label], capture_output=True, text=True, timeout=60,
                check=True,
            )
            names = done.stdout.split()
            if names:
                found[kind] = names
        return found

    def container(self, service: str) -> str:
        """The id of the service's container (stopped ones too)."""
        ids = self.compose("ps", "--all", "--quiet", service).stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def services(self) -> list[dict[str, Any]]:
        """`docker compose ps --all` as records (Service, State, ExitCode, ...)."""
        out = self.compose("ps", "--all", "--format", "json").stdout.strip()
        if out.startswith("["):
            records: list[dict[str, Any]] = json.loads(out)
            return records
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def inspect(self, service: str) -> dict[str, Any]:
        done = subprocess.run(
            ["docker", "inspect", self.container(service)], capture_output=True, text=True, timeout=60, check=True
        )
        record: dict[str, Any] = json.loads(done.stdout)[0]
        return record

    def processes(self, service: str) -> list[str]:
        """The command lines running in the service's container (`docker top`: no ps needed in the image)."""
        done = subprocess.run(
            ["docker", "top", self.container(service), "-o", "pid,args"],  # docker top needs the pid column
            capture_output=True, text=True, timeout=60, check=True,
        )
        return [line.split(None, 1)[-1] for line in done.stdout.splitlines()[1:]]

    def copy_out(self, service: str, path: str, to: Path) -> Path:
        subprocess.run(
            ["docker", "cp", f"{self.container(service)}:{path}", str(to)],
            capture_output=True, text=True, timeout=60, check=True,
        )
        return to

    def kill(self, service: str) -> None:
        subprocess.run(["docker", "kill", self.container(service)], capture_output=True, text=True, timeout=60,
                       check=True)

    def logs(self, *, tail: int = 60) -> str:
        return self.compose("logs", "--no-color", "--timestamps", "--tail", str(tail), timeout=120, check=False).stdout
