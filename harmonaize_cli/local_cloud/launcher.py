"""The local cloud in one process tree: an embedded nats-server, the control-plane API on SQLite, a demo tenant, and
the simulated fleet (four hosts in two locality groups by default, one agent process each, and the provider's
central loops), so jobs placed by the control plane really run as torchrun nodes on this machine.

`harmonaize up` calls `run_local_cloud`; `harmonaize demo` runs its story inside one. Everything lives in the data dir
(`.hz/` by default): the broker's config, JetStream store and log, the SQLite database, the generated secrets and the
demo tenant's credentials, so a second start resumes where the first stopped. A lock file keeps two clouds off one
data dir.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import secrets
import signal
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

import httpx
from pydantic import SecretStr

from api.migrate import upgrade_async
from api.options import NegotiationOptions
from api.services.carbon_forecast import StepCurveForecast, TraceReplayForecast
from api.serving import ApiStartError, ProviderApi, provider_api, serve_api
from broker_config.keys import ProviderKeys
from broker_config.render import render_accounts
from broker_config.server import NatsServer, PortInUseError, port_is_free
from harmonaize.settings import Settings
from harmonaize_cli.local_cloud.fleet import DEFAULT_SCENARIO, LocalFleet, pin_scenario, register_hosts, scenario_hosts
from harmonaize_cli.local_cloud.testbed import LocalTestbed, testbed_unavailable
from provider_agents.markers import cloud_id
from provider_agents.telemetry.scenario import BUILTIN_TRACE_NAMES, ScenarioError, load_scenario
from provider_agents.testbed.commands import TestbedError

DEMO_TENANT = "demo"
CARBON_SPEEDUP = 60.0
"""The local cloud replays the shipped carbon trace 60x faster than real time (an hour of grid data per minute)."""


class LocalCloudError(RuntimeError):
    """The local cloud cannot start; the message names the problem in one line."""


@dataclass(frozen=True)
class LocalCloudInfo:
    data_dir: Path
    nats_url: str
    api_url: str
    admin_env_file: Path
    tenant_env_file: Path | None
    broker_log: Path
    hosts: dict[str, tuple[str, int]] = field(default_factory=dict)
    logs_dir: Path | None = None
    network: str = "loopback"
    """One line: where the hosts' traffic runs (the testbed and its uplink rate, or loopback and, when a testbed was
    asked for, why not)."""


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _env_file(values: dict[str, str]) -> str:
    return "".join(f"export {k}={json.dumps(v)}\n" for k, v in values.items())


def ensure_local_secrets(settings: Settings) -> Settings:
    """Fill in the provider secret and admin token, generated once and kept in the data dir (mode 0600)."""
    path = settings.data_dir / "secrets.json"
    stored: dict[str, str] = json.loads(path.read_text()) if path.exists() else {}
    changed = False
    for key in ("provider_secret", "admin_token"):
        if key not in stored:
            stored[key] = secrets.token_urlsafe(32)
            changed = True
    if changed:
        _write_private(path, json.dumps(stored, indent=2))
    update: dict[str, object] = {}
    if settings.provider_secret is None:
        update["provider_secret"] = SecretStr(stored["provider_secret"])
    if settings.admin_token is None:
        update["admin_token"] = SecretStr(stored["admin_token"])
    return settings.model_copy(update=update)


def _lock_data_dir(data_dir: Path) -> IO[str]:
    data_dir.mkdir(parents=True, exist_ok=True)
    handle = open(data_dir / "up.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise LocalCloudError(
            f"another 'harmonaize up' is already running on data dir {data_dir} (stop it, or use --data-dir)"
        ) from None
    return handle


async def _ensure_demo_tenant(settings: Settings, api_url: str, nats_url: str) -> Path | None:
    """Create the demo tenant once; its token and seed are shown once, so they are kept in the data dir."""
    creds_path = settings.data_dir / f"tenant-{DEMO_TENANT}.json"
    if not creds_path.exists():
        assert settings.admin_token is not None
        headers = {"Authorization": f"Bearer {settings.admin_token.get_secret_value()}"}
        async with httpx.AsyncClient(base_url=api_url, headers=headers, timeout=30) as client:
            reply = await client.post("/v1/tenants", json={"id": DEMO_TENANT, "display_name": "Demo tenant"})
        if reply.status_code == 409:
            return None  # created by an earlier run whose credentials file was deleted: they cannot be shown again
        if reply.status_code != 201:
            raise LocalCloudError(f"creating the demo tenant failed: {reply.status_code} {reply.text}")
        _write_private(creds_path, reply.text)
    body = json.loads(creds_path.read_text())
    env_path = settings.data_dir / f"tenant-{DEMO_TENANT}.env"
    _write_private(
        env_path,
        _env_file(
            {
                "HZ_TENANT": DEMO_TENANT,
                "HZ_TENANT_TOKEN": body["api_token"],
                "HZ_TENANT_NATS_SEED": body["nats"]["seed"],
                "HZ_NATS_URL": nats_url,
                "HZ_API_URL": api_url,
            }
        ),
    )
    return env_path


async def run_local_cloud(
    settings: Settings,
    *,
    nats_port: int = 0,
    on_ready: Callable[[LocalCloudInfo], None] = lambda info: None,
    stop: asyncio.Event | None = None,
    demo_tenant: bool = True,
    fleet: bool = True,
    scenario: Path | None = None,
    hosts: dict[str, tuple[str, int]] | None = None,
    story: Callable[[LocalCloudInfo, LocalFleet | None], Coroutine[Any, Any, None]] | None = None,
    keep_running: bool = False,
    testbed_mbit: float | None = None,
) -> None:
    """Start broker, API and fleet, call `on_ready`, and run until `stop` is set (or SIGINT/SIGTERM), or until
    `story` returns when one is given (unless `keep_running`); then stop everything (the fleet first, so jobs
    checkpoint). `testbed_mbit`: the hosts as network namespaces, their groups joined by uplinks of that rate
    (`local_cloud.testbed`); where none can be built, loopback, and `LocalCloudInfo.network` says why."""
    lock = _lock_data_dir(settings.data_dir)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    settings = ensure_local_secrets(settings)
    assert settings.provider_secret is not None
    secret = settings.provider_secret.get_secret_value().encode()
    if not fleet:
        hosts = {}
    elif hosts is None:
        hosts = scenario_hosts(scenario or DEFAULT_SCENARIO)
    testbed: LocalTestbed | None = None
    network = "loopback"
    if testbed_mbit is not None and hosts:
        reason = testbed_unavailable()
        if reason is None:
            cloud = cloud_id(secret, settings.data_dir.resolve())
            groups = {host: group for host, (group, _) in hosts.items()}
            try:
                testbed = await asyncio.to_thread(
                    LocalTestbed.build, settings.data_dir, cloud, groups, uplink_mbit=testbed_mbit
                )
            except (TestbedError, ValueError) as exc:
                reason = f"the testbed could not be built ({exc}); running on loopback instead"
        network = reason or (
            f"testbed: {len(hosts)} host namespaces in {len(set(groups.values()))} locality groups, uplinks "
            f"{testbed_mbit:g} Mbit/s, services at {testbed.services_address if testbed else '?'}"
        )
    bind_host = testbed.services_address if testbed is not None else settings.api_host
    if settings.api_port and not port_is_free(bind_host, settings.api_port):
        if testbed is not None:
            await asyncio.to_thread(testbed.remove)
        lock.close()
        raise LocalCloudError(
            f"cannot start the API: port {settings.api_port} on {bind_host} is already in use "
            "(set --api-port, or 0 for any free port)"
        )
    server = NatsServer(
        settings.data_dir / "broker",
        accounts_text=render_accounts(ProviderKeys(secret), []),
        host=bind_host if testbed is not None else "127.0.0.1",
        port=nats_port,
        sync_interval=settings.broker_sync_interval,
    )
    served: ProviderApi | None = None
    local_fleet: LocalFleet | None = None
    tasks: list[asyncio.Task[None]] = []
    try:
        await upgrade_async(settings)
        try:
            await asyncio.to_thread(server.start)
        except PortInUseError as exc:
            raise LocalCloudError(f"{exc} (set --nats-port, or 0 for any free port)") from None
        scenario_start = datetime.now(UTC) + timedelta(seconds=1)
        served = provider_api(
            settings.model_copy(update={"nats_url": server.url}),
            servers=[server.url],
            secret=secret,
            accounts_file=server.accounts_file,
            reload=server.reload,
            negotiation=_negotiation_options(scenario or DEFAULT_SCENARIO, scenario_start) if fleet else
            NegotiationOptions(carbon_speedup=CARBON_SPEEDUP),
        )
        try:
            api = await serve_api(served.app, host=bind_host, port=settings.api_port)
        except ApiStartError as exc:
            raise LocalCloudError(str(exc)) from None
        api_url = f"http://{bind_host}:{api.port}"
        admin_env = settings.data_dir / "admin.env"
        assert settings.admin_token is not None
        _write_private(
            admin_env,
            _env_file(
                {
                    "HZ_API_URL": api_url,
                    "HZ_NATS_URL": server.url,
                    "HZ_ADMIN_TOKEN": settings.admin_token.get_secret_value(),
                    "HZ_PROVIDER_SECRET": secret.decode(),
                }
            ),
        )
        tenant_env = await _ensure_demo_tenant(settings, api_url, server.url) if demo_tenant else None
        if fleet:
            local_fleet = _start_fleet(
                settings, api_url, server.url, secret, scenario or DEFAULT_SCENARIO, hosts, start=scenario_start
            )
            local_fleet.testbed = testbed
            await register_hosts(api_url, settings.admin_token.get_secret_value(), hosts)
            local_fleet.start()
            if testbed is not None:
                tasks.append(asyncio.create_task(testbed.play(
                    local_fleet.scenario, start=scenario_start, nats_url=server.url, secret=secret, stop=stop
                ), name="hz-testbed-episodes"))
        info = LocalCloudInfo(
            settings.data_dir, server.url, api_url, admin_env, tenant_env, server.log_file, hosts,
            settings.data_dir / "logs", network,
        )
        on_ready(info)
        stopping = asyncio.create_task(stop.wait())
        waits = {api.task, stopping}
        if story is not None:
            waits.add(asyncio.create_task(story(info, local_fleet)))
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if keep_running and not (done & {api.task, stopping}):
            for task in done:
                task.result()
            done, pending = await asyncio.wait({api.task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if local_fleet is not None:
            await asyncio.to_thread(local_fleet.stop)
            local_fleet = None
        await api.stop()
        for task in pending - {api.task}:
            task.cancel()
        for task in done - {api.task}:
            task.result()
    finally:
        stop.set()
        if local_fleet is not None:
            await asyncio.to_thread(local_fleet.stop)
        await asyncio.gather(*tasks, return_exceptions=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if served is not None:
            await served.aclose()
        await asyncio.to_thread(server.stop)
        if testbed is not None:
            await asyncio.to_thread(testbed.remove)
        lock.close()


def _negotiation_options(scenario: Path, start: datetime) -> NegotiationOptions:
    """The provider's carbon forecast follows the scenario the hosts replay (its first host's region)."""
    try:
        loaded = load_scenario(scenario)
    except ScenarioError as exc:
        raise LocalCloudError(str(exc)) from None
    region = next((spec.region for spec in loaded.hosts.values() if spec.region), None) or "US-CAL-CISO"
    curve = loaded.carbon_for(region)
    if curve.points is not None:
        steps = tuple((timedelta(seconds=point.at), point.g_per_kwh) for point in curve.points)
        forecast = StepCurveForecast(anchor=start, steps=steps)
        return NegotiationOptions(forecast=forecast, region=region)
    if curve.trace is None or curve.trace in BUILTIN_TRACE_NAMES:
        return NegotiationOptions(
            forecast=TraceReplayForecast(anchor=start, speedup=curve.speedup), region=region
        )
    return NegotiationOptions(carbon_speedup=CARBON_SPEEDUP)


def _start_fleet(
    settings: Settings,
    api_url: str,
    nats_url: str,
    secret: bytes,
    scenario: Path,
    hosts: dict[str, tuple[str, int]],
    *,
    start: datetime,
) -> LocalFleet:
    """The fleet's processes, configured like the API (same secret and admin token) and all in step on one scenario.

    The agents derive the cloud id from the secret and data dir they are given here; the fleet is handed the same id,
    so stopping or killing its hosts reaches only this cloud's node processes."""
    assert settings.admin_token is not None
    pinned = pin_scenario(scenario, settings.data_dir / "scenario.yaml", start=start, hosts=hosts)
    data_dir = settings.data_dir.resolve()
    env = {
        "HZ_PROVIDER_SECRET": secret.decode(),
        "HZ_ADMIN_TOKEN": settings.admin_token.get_secret_value(),
        "HZ_API_URL": api_url,
        "HZ_NATS_URL": nats_url,
        "HZ_DATA_DIR": str(data_dir),
        "OMP_NUM_THREADS": "1",
    }
    return LocalFleet(
        data_dir=settings.data_dir, env=env, scenario=pinned, hosts=hosts, cloud=cloud_id(secret, data_dir)
    )
