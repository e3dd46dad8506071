"""`harmonaize api ...` and `harmonaize broker ...`: the control plane and the broker config as services of their own.

`harmonaize up` runs the whole local cloud in one process tree. The containerized path (`docker-compose.yml`) runs each
part in a container of its own, from one image, so each part needs a command that starts it alone:

* `harmonaize api serve [--migrate]` serves the control-plane API from `Settings` (HZ_DATABASE_URL, HZ_NATS_URL,
  HZ_ADMIN_TOKEN, HZ_PROVIDER_SECRET, HZ_API_HOST/PORT, HZ_BROKER_CONFIG_FILE) with the outbox relay publishing
  through a `NatsProviderBus` and tenants provisioned by a `NatsTenantBroker`. `--migrate` first does what `harmonaize
  db upgrade` does, so one container both migrates and serves. `--replicas N` serves N API processes behind the one
  address (migrating once first; `harmonaize_cli/api_replicas.py`). The broker is reloaded **through the system
  account** by default (`broker_config/reload.py`): the API container shares the rendered config with the broker
  through a volume, but not a pid namespace, so SIGHUP by pid cannot work there. `--broker-reload pid-file` keeps the
  signal for a broker on the same host.
* `harmonaize broker render-config` writes the broker's config before the broker starts (compose's one-shot
  `broker-init`): nats-server cannot start without it, and the API waits for a healthy broker. It needs only the
  provider secret: an accounts file without tenants is enough to start, and the API reconciles it with the tenant
  registry when it starts. An accounts file already on the volume is kept while it holds the current secret's
  provider keys, so tenants can connect across restarts before the API is back. `--cluster-node` also writes one
  config per node (`cluster-<node>.conf`), all including the same accounts file, with routes among them.
* `harmonaize api bootstrap` makes a fresh control plane usable for the demo, idempotently: registers a scenario's
  hosts, creates a tenant once and writes its credentials to `<dir>/.env` (mode 0600; the API shows them only
  once), and optionally submits a job as that tenant. A `.env` because `Settings` reads one from the working
  directory, so a controller started there (compose: `working_dir`) needs no wrapper script.

Messages follow the CLI's rule: one line on stderr, exit 2 for bad input or configuration, 1 at run time. `harmonaize`
imports this module on every invocation, so it imports only typer at module level; settings, the event loop, FastAPI,
SQLAlchemy, nats and uvicorn are imported inside the commands.
"""

from __future__ import annotations

import enum
import os
import shlex
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from harmonaize.cli_errors import fail, settings_or_fail

if TYPE_CHECKING:
    from harmonaize.settings import Settings

__all__ = ["app", "api_app", "broker_app", "DEMO_TENANT_ENV_FILE"]

app = typer.Typer()
api_app = typer.Typer(help="The control-plane API as a service of its own (containers).", no_args_is_help=True)
broker_app = typer.Typer(help="The broker's configuration (nats-server).", no_args_is_help=True)
app.add_typer(api_app, name="api")
app.add_typer(broker_app, name="broker")

DEMO_TENANT_ENV_FILE = ".env"
MAIN_CONFIG_FILE = "nats.conf"


class ReloadMode(enum.StrEnum):
    system_account = "system-account"
    pid_file = "pid-file"


def _secret(settings: Settings) -> bytes:
    if settings.provider_secret is None or not settings.provider_secret.get_secret_value():
        fail("HZ_PROVIDER_SECRET is not set (the provider's root secret; its NATS keys are derived from it)", code=2)
    return settings.provider_secret.get_secret_value().encode()


def _host_port(value: str, option: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        fail(f"{option} {value!r}: expected HOST:PORT, e.g. 0.0.0.0:4222", code=2)
    return host, int(port)


@api_app.command("serve")
def api_serve(
    migrate: Annotated[bool, typer.Option(help="Migrate the database to the newest schema first.")] = False,
    broker_reload: Annotated[
        ReloadMode, typer.Option(help="How the broker is told to reload tenant accounts.")
    ] = ReloadMode.system_account,
    stream_replicas: Annotated[
        int | None,
        typer.Option(help="Replicas of each tenant's event stream and of the provider's buckets (3 on a 3-node "
                     "broker). Default: HZ_BROKER_REPLICAS.", min=1, max=5),
    ] = None,
    carbon_speedup: Annotated[
        float, typer.Option(help="Replay the carbon trace this much faster than real time (forecasts).", min=1.0)
    ] = 1.0,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    json_logs: Annotated[
        bool, typer.Option(help="Log JSON lines with request, tenant, job, negotiation and event ids (services).")
    ] = True,
    replicas: Annotated[
        int, typer.Option(help="API processes behind the one address, each restarted if it dies (PostgreSQL).",
                          min=1, max=64)
    ] = 1,
    listen_fd: Annotated[
        int | None, typer.Option(hidden=True, help="A replica: accept on this inherited socket.")
    ] = None,
) -> None:
    """Serve the control-plane API until SIGTERM/SIGINT (settings from HZ_* variables)."""
    from harmonaize import event_loop

    if json_logs:
        from api.log_context import configure_json_logging

        configure_json_logging(log_level.upper())
    settings = settings_or_fail()
    secret = _secret(settings)
    if stream_replicas is None:
        stream_replicas = settings.broker_replicas
    if replicas > 1:
        _serve_replicas(settings, replicas, migrate=migrate, args=[
            "--broker-reload", broker_reload.value, "--stream-replicas", str(stream_replicas),
            "--carbon-speedup", repr(carbon_speedup), "--log-level", log_level,
            "--json-logs" if json_logs else "--no-json-logs",
        ])
        return
    try:
        started = event_loop.run(
            _serve(
                settings,
                secret,
                migrate=migrate,
                reload=broker_reload,
                replicas=stream_replicas,
                carbon_speedup=carbon_speedup,
                log_level=log_level.lower(),
                listen_fd=listen_fd,
            ),
            choice=settings.event_loop,
        )
    except KeyboardInterrupt:
        return
    if not started:
        fail("the API did not start (see the messages above)")


async def _serve(
    settings: Settings,
    secret: bytes,
    *,
    migrate: bool,
    reload: ReloadMode,
    replicas: int,
    carbon_speedup: float,
    log_level: str,
    listen_fd: int | None = None,
) -> bool:
    from api.app import ConfigurationError
    from api.options import NegotiationOptions
    from api.serving import ApiStartError, provider_api, serve_api
    from broker_config.provisioner import reload_by_pid_file
    from broker_config.reload import SystemAccountReload
    from broker_config.render import ACCOUNTS_FILE
    from harmonaize.heap import freeze_startup_heap

    if not settings.database_url:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    if migrate:
        await _migrate(settings)
    strategy = (
        SystemAccountReload()
        if reload is ReloadMode.system_account
        else reload_by_pid_file(settings.resolved_broker_pid_file)
    )
    try:
        served = provider_api(
            settings,
            servers=[settings.nats_url],
            secret=secret,
            accounts_file=settings.resolved_broker_config_file.parent / ACCOUNTS_FILE,
            reload=strategy,
            replicas=replicas,
            negotiation=NegotiationOptions(carbon_speedup=carbon_speedup),
        )
    except ConfigurationError as exc:
        fail(str(exc), code=2)
    try:
        try:
            listener = None if listen_fd is None else socket.socket(fileno=listen_fd)
            serving = await serve_api(served.app, host=settings.api_host, port=settings.api_port, log_level=log_level,
                                      listener=listener)
        except ApiStartError:
            return False
        freeze_startup_heap()  # this process is ours: full GC passes over the start-up heap stall every request
        await serving.task
        return True
    finally:
        await served.aclose()


def _serve_replicas(settings: Settings, replicas: int, *, migrate: bool, args: list[str]) -> None:
    """Migrate once (not once per replica), bind the address, then supervise the replicas until stopped."""
    from harmonaize import event_loop
    from harmonaize_cli.api_replicas import reserve_address, supervise

    if migrate:
        event_loop.run(_migrate(settings), choice=settings.event_loop)
    try:
        reserved = reserve_address(settings.api_host, settings.api_port)
    except OSError as exc:
        fail(f"HZ_API_HOST/HZ_API_PORT {settings.api_host}:{settings.api_port}: cannot listen there "
             f"({exc.strerror or exc})", code=2)
    raise typer.Exit(supervise(reserved, replicas, args))


async def _migrate(settings: Settings) -> None:
    from api.migrate import upgrade_async

    if not settings.database_url:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        await upgrade_async(settings)
    except Exception as exc:  # alembic and the drivers raise many types; the operator needs the message
        fail(f"migrating the database failed: {str(exc).splitlines()[0] if str(exc) else repr(exc)}")
    typer.echo("harmonaize api: database at the newest schema", err=True)


@api_app.command("bootstrap")
def api_bootstrap(
    scenario: Annotated[
        Path | None, typer.Option(help="Register every host of this scenario (id, GPUs, locality group).")
    ] = None,
    tenant: Annotated[str | None, typer.Option(help="Create this tenant once and keep its credentials.")] = None,
    credentials_dir: Annotated[
        Path, typer.Option(help=f"Where the tenant's credentials go ({DEMO_TENANT_ENV_FILE}, mode 0600).")
    ] = Path("."),
    job: Annotated[str | None, typer.Option(help="Also submit this job as the tenant (kept if it exists).")] = None,
    min_workers: Annotated[int, typer.Option(min=1)] = 1,
    max_workers: Annotated[int, typer.Option(min=1)] = 4,
    initial_workers: Annotated[int | None, typer.Option(min=1, help="Place this many workers at once.")] = None,
    gpus_per_worker: Annotated[int, typer.Option(min=1)] = 1,
    entrypoint: Annotated[
        str, typer.Option(help="What torchrun runs on each node, one shell-quoted string (empty: nothing runs).")
    ] = "",
    wait: Annotated[float, typer.Option(help="Seconds to wait for the API to answer first.", min=0)] = 60.0,
) -> None:
    """Prepare a fresh control plane for the demo: hosts, a tenant with its credentials file, a job (idempotent)."""
    from harmonaize.ids import InvalidIdError, validate_id

    try:
        tenant = None if tenant is None else validate_id("tenant", tenant)
        job = None if job is None else validate_id("job", job)
    except InvalidIdError as exc:
        fail(str(exc), code=2)
    if job is not None and tenant is None:
        fail("--job needs --tenant (the job is submitted as that tenant)", code=2)
    settings = settings_or_fail()
    if settings.admin_token is None or not settings.admin_token.get_secret_value():
        fail("HZ_ADMIN_TOKEN is not set (bootstrap registers hosts and tenants as the provider's admin)", code=2)
    hosts = _scenario_hosts(scenario) if scenario is not None else []
    job_body = None
    if job is not None:
        job_body = {
            "id": job,
            "min_workers": min_workers,
            "max_workers": max_workers,
            "gpus_per_worker": gpus_per_worker,
            "entrypoint": shlex.split(entrypoint),
        }
        if initial_workers is not None:
            job_body["initial_workers"] = initial_workers
    try:
        _bootstrap(settings, hosts=hosts, tenant=tenant, credentials_dir=credentials_dir, job=job_body, wait_s=wait)
    except _BootstrapError as exc:
        fail(str(exc))


class _BootstrapError(RuntimeError):
    pass


def _scenario_hosts(path: Path) -> list[dict[str, object]]:
    """(id, gpus, locality group) of each host, with the agent's defaults (8 GPUs, group 'default')."""
    from provider_agents.telemetry.scenario import ScenarioError, load_scenario

    try:
        loaded = load_scenario(path)
    except (ScenarioError, OSError) as exc:
        fail(f"cannot read scenario {path}: {exc}", code=2)
    return [
        {
            "id": host,
            "gpus": spec.gpus if spec.gpus is not None else 8,
            "locality_group": spec.locality_group or "default",
        }
        for host, spec in sorted(loaded.hosts.items())
        if spec.gpus != 0
    ]


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


def read_credentials(path: Path) -> dict[str, str]:
    """The KEY=value lines of a credentials file written by `api bootstrap`."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.strip().removeprefix("export ").partition("=")
        if sep and not key.startswith("#"):
            values[key] = shlex.split(value)[0] if value else ""
    return values


def _bootstrap(
    settings: Settings,
    *,
    hosts: list[dict[str, object]],
    tenant: str | None,
    credentials_dir: Path,
    job: dict[str, object] | None,
    wait_s: float,
) -> None:
    import httpx

    assert settings.admin_token is not None
    base = settings.resolved_api_url
    admin = httpx.Client(
        base_url=base, headers={"Authorization": f"Bearer {settings.admin_token.get_secret_value()}"}, timeout=30
    )
    with admin:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if admin.get("/v1/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise _BootstrapError(f"the API at {base} did not answer /v1/healthz within {wait_s:.0f} s")
            time.sleep(0.5)
        for host in hosts:
            reply = admin.post("/v1/hosts", json=host)
            if reply.status_code not in (201, 409):
                raise _BootstrapError(f"registering host {host['id']}: {reply.status_code} {reply.text}")
            state = "registered" if reply.status_code == 201 else "already registered"
            typer.echo(f"host {host['id']} ({host['gpus']} GPUs, group {host['locality_group']}): {state}")
        if tenant is None:
            return
        path = credentials_dir / DEMO_TENANT_ENV_FILE
        if path.exists():
            token = read_credentials(path).get("HZ_TENANT_TOKEN", "")
            typer.echo(f"tenant {tenant}: credentials kept in {path}")
        else:
            reply = admin.post("/v1/tenants", json={"id": tenant, "display_name": tenant})
            if reply.status_code == 409:
                raise _BootstrapError(
                    f"tenant {tenant} exists but {path} is missing; its credentials were shown once at creation "
                    f"(delete the tenant, DELETE /v1/tenants/{tenant}, to create it again)"
                )
            if reply.status_code != 201:
                raise _BootstrapError(f"creating tenant {tenant}: {reply.status_code} {reply.text}")
            body = reply.json()
            token = body["api_token"]
            lines = {"HZ_TENANT": tenant, "HZ_TENANT_TOKEN": token, "HZ_TENANT_NATS_SEED": body["nats"]["seed"]}
            _write_private(path, "".join(f"{k}={shlex.quote(v)}\n" for k, v in lines.items()))
            typer.echo(f"tenant {tenant}: created, credentials in {path}")
    if job is None:
        return
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        if client.get(f"/v1/jobs/{job['id']}").status_code == 200:
            typer.echo(f"job {job['id']}: already submitted")
            return
        reply = client.post("/v1/jobs", json=job)
        if reply.status_code != 201:
            raise _BootstrapError(f"submitting job {job['id']}: {reply.status_code} {reply.text}")
        typer.echo(f"job {job['id']}: submitted ({reply.json().get('desired_workers', 0)} workers placed)")


@broker_app.command("render-config")
def broker_render_config(
    out: Annotated[
        Path | None, typer.Option(help="Directory of the config (default: that of HZ_BROKER_CONFIG_FILE).")
    ] = None,
    listen: Annotated[str, typer.Option(help="Client listener, HOST:PORT.")] = "0.0.0.0:4222",
    http_port: Annotated[int | None, typer.Option(help="Monitoring port (healthz).", min=1, max=65535)] = None,
    store_dir: Annotated[Path | None, typer.Option(help="JetStream store (default: <out>/jetstream).")] = None,
    server_name: Annotated[str, typer.Option(help="Server name of the single-node config.")] = "hz-nats",
    cluster_node: Annotated[
        list[str] | None, typer.Option(help="Also write cluster-<node>.conf for this node (repeat per node).")
    ] = None,
    cluster_port: Annotated[int, typer.Option(help="Route port of cluster nodes.", min=1, max=65535)] = 6222,
    cluster_name: Annotated[str, typer.Option(help="Cluster name.")] = "hz",
) -> None:
    """Write nats.conf and accounts.conf (and cluster node configs) for a broker that starts after this exits."""
    from broker_config.keys import ProviderKeys
    from broker_config.render import (
        ACCOUNTS_FILE,
        ClusterOptions,
        ServerOptions,
        render_accounts,
        render_server,
        write_atomically,
    )
    from broker_config.server import BrokerError, validate_config_file

    settings = settings_or_fail()
    keys = ProviderKeys(_secret(settings))
    directory = out if out is not None else settings.resolved_broker_config_file.parent
    host, port = _host_port(listen, "--listen")
    store = store_dir if store_dir is not None else directory / "jetstream"
    accounts = directory / ACCOUNTS_FILE
    current = accounts.read_text() if accounts.exists() else None
    if current is not None and keys.provider.public_key in current and keys.system.public_key in current:
        typer.echo(f"{accounts}: kept (tenant accounts are reconciled by the API when it starts)")
    else:
        write_atomically(accounts, render_accounts(keys, []))
        reason = "written" if current is None else "rewritten for a new provider secret"
        typer.echo(f"{accounts}: {reason} (tenant accounts are added by the API when it starts)")
    configs = {
        directory / MAIN_CONFIG_FILE: ServerOptions(
            host=host, port=port, store_dir=store, server_name=server_name, http_port=http_port,
            sync_interval=settings.broker_sync_interval,
        )
    }
    nodes = list(dict.fromkeys(cluster_node or []))
    routes = tuple(f"nats-route://{node}:{cluster_port}" for node in nodes)
    for node in nodes:
        cluster = ClusterOptions(name=cluster_name, host=host, port=cluster_port, routes=routes)
        configs[directory / f"cluster-{node}.conf"] = ServerOptions(
            host=host, port=port, store_dir=store, server_name=node, http_port=http_port, cluster=cluster,
            sync_interval=settings.broker_sync_interval,
        )
    for path, options in configs.items():
        write_atomically(path, render_server(options))
        try:
            validate_config_file(path)
        except BrokerError as exc:
            fail(str(exc))
        typer.echo(f"{path}: written")
