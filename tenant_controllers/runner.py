"""`harmonaize controller run script.py`: load a controller script, connect it, run it until SIGINT/SIGTERM.

The script only declares handlers; everything about connections comes from the environment through
`Settings` (`HZ_TENANT`, `HZ_TENANT_TOKEN`, `HZ_TENANT_NATS_SEED`, `HZ_NATS_URL`, `HZ_API_URL`), so the same script
runs against the local cloud, a real provider, or a test. Messages for shell users are one line on stderr; exit codes:
0 after a clean stop, 2 for a bad script or configuration (missing credentials name their variable), 1 when the
provider refuses us at run time (for example a revoked token), 130 when a second signal cuts the drain short.

Each controller gets its own durable consumer and its own SQLite file under the state dir (`.hz/controllers` by
default), named after tenant and consumer, so a restart resumes both the broker's and the controller's memory.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from pydantic import ValidationError

from harmonaize import event_loop
from harmonaize.cli_errors import describe_settings_error, report
from harmonaize.heap import freeze_startup_heap
from harmonaize.settings import Settings
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.controller import Controller
from tenant_controllers.errors import ConfigurationError, ControllerError
from tenant_controllers.nats_source import NatsEventSource
from tenant_controllers.runtime import ControllerRuntime
from tenant_controllers.store import HandledStore

__all__ = ["Credentials", "credentials_from", "load_controllers", "main", "run_controllers"]

_log = logging.getLogger("tenant_controllers.runner")

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130
DEFAULT_RESYNC_INTERVAL = 60.0

_CREDENTIAL_HELP = "(source the tenant env file that 'harmonaize up' printed, e.g. .hz/tenant-demo.env)"


@dataclass(frozen=True)
class Credentials:
    """Where the provider is and who we are; never logged."""

    tenant: str
    token: str
    nats_seed: str
    nats_url: str
    api_url: str

    def __repr__(self) -> str:
        return f"Credentials(tenant={self.tenant!r}, nats_url={self.nats_url!r}, api_url={self.api_url!r})"


def load_controllers(path: Path) -> list[Controller]:
    """Import the script and return the Controllers it defines, each with a name (default: the script's)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigurationError(f"controller script not found: {path}")
    module = _import_script(path)
    found: dict[int, tuple[str, Controller]] = {}
    for attribute, value in vars(module).items():
        if isinstance(value, Controller) and id(value) not in found:
            found[id(value)] = (attribute, value)
    if not found:
        raise ConfigurationError(
            f"{path} defines no Controller (create one at module level: ctl = Controller(tenant=..., job=...))"
        )
    stem = _as_name(path.stem)
    unnamed = [c for _, c in found.values() if not c.has_name]
    for attribute, controller in found.values():
        controller.set_default_name(stem if len(unnamed) == 1 else f"{stem}-{_as_name(attribute)}")
    controllers = [controller for _, controller in found.values()]
    consumers = [c.consumer for c in controllers]
    if len(set(consumers)) != len(consumers):
        raise ConfigurationError(f"{path}: two controllers would share a consumer; give them different name=...")
    return controllers


def _import_script(path: Path) -> ModuleType:
    module_name = f"hz_controller_{_as_name(path.stem).replace('-', '_')}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigurationError(f"cannot load {path} as a Python script")
    module = importlib.util.module_from_spec(spec)
    script_dir = str(path.resolve().parent)
    if script_dir not in sys.path:
        sys.path.insert(0, script_dir)  # a script may import its siblings, as `python script.py` would allow
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except ControllerError:
        raise
    except Exception as exc:
        raise ConfigurationError(f"{path} failed to import: {type(exc).__name__}: {exc}") from exc
    return module


def _as_name(text: str) -> str:
    name = re.sub(r"[^a-z0-9_-]+", "-", text.lower()).strip("-_") or "controller"
    return name[:40]


def credentials_from(settings: Settings, controllers: Sequence[Controller]) -> Credentials:
    """The connection details, or ConfigurationError naming every missing variable in one line."""
    tenants = {c.tenant for c in controllers if c.tenant is not None}
    if settings.tenant is not None:
        others = tenants - {settings.tenant}
        if others:
            raise ConfigurationError(
                f"the script's controller is for tenant {sorted(others)[0]!r} but HZ_TENANT is {settings.tenant!r}"
            )
        tenants = {settings.tenant}
    if len(tenants) > 1:
        raise ConfigurationError(f"one run serves one tenant; the script names {sorted(tenants)}")
    missing = []
    if not tenants:
        missing.append("HZ_TENANT")
    if settings.tenant_token is None or not settings.tenant_token.get_secret_value():
        missing.append("HZ_TENANT_TOKEN")
    if settings.tenant_nats_seed is None or not settings.tenant_nats_seed.get_secret_value():
        missing.append("HZ_TENANT_NATS_SEED")
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise ConfigurationError(f"missing credentials: {', '.join(missing)} {verb} not set {_CREDENTIAL_HELP}")
    assert settings.tenant_token is not None and settings.tenant_nats_seed is not None
    return Credentials(
        tenant=tenants.pop(),
        token=settings.tenant_token.get_secret_value(),
        nats_seed=settings.tenant_nats_seed.get_secret_value(),
        nats_url=settings.nats_url,
        api_url=settings.resolved_api_url,
    )


async def run_controllers(
    controllers: Sequence[Controller],
    *,
    credentials: Credentials,
    state_dir: Path,
    stop: asyncio.Event,
    resync_interval: float | None = DEFAULT_RESYNC_INTERVAL,
    drain_timeout: float = 30.0,
    ack_wait: float | None = None,
) -> None:
    """Run every controller over the real broker and API until `stop` is set; each drains before returning."""
    stores: list[HandledStore] = []
    async with ProviderApi(base_url=credentials.api_url, token=credentials.token) as api:
        runtimes = []
        for controller in controllers:
            if controller.tenant is None:
                controller.tenant = credentials.tenant
            store = HandledStore(state_dir / f"{credentials.tenant}-{controller.consumer}.sqlite3")
            stores.append(store)
            source = NatsEventSource(
                servers=credentials.nats_url, seed=credentials.nats_seed, api=api, ack_wait=ack_wait
            )
            runtimes.append(
                ControllerRuntime(
                    controller, source=source, api=api, store=store, resync_interval=resync_interval,
                    drain_timeout=drain_timeout,
                )
            )
        try:
            results = await asyncio.gather(*(runtime.run(stop) for runtime in runtimes), return_exceptions=True)
        finally:
            for store in stores:
                store.close()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]


def main(
    script: Path,
    *,
    state_dir: Path | None = None,
    resync_interval: float | None = DEFAULT_RESYNC_INTERVAL,
    ack_wait: float | None = None,
    log_level: str = "INFO",
) -> int:
    """Run a controller script until SIGINT/SIGTERM; returns the process exit code."""
    logging.basicConfig(
        level=log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = Settings()
    except ValidationError as exc:
        return _fail(describe_settings_error(exc), EXIT_CONFIG)
    try:
        controllers = load_controllers(script)
        credentials = credentials_from(settings, controllers)
    except ConfigurationError as exc:
        return _fail(str(exc), EXIT_CONFIG)
    directory = state_dir if state_dir is not None else settings.data_dir / "controllers"
    try:
        return event_loop.run(
            _serve(controllers, credentials, directory, resync_interval, ack_wait), choice=settings.event_loop
        )
    except ControllerError as exc:
        return _fail(str(exc), EXIT_RUNTIME)


async def _serve(
    controllers: Sequence[Controller],
    credentials: Credentials,
    state_dir: Path,
    resync_interval: float | None,
    ack_wait: float | None = None,
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    current = asyncio.current_task()
    signals_seen = 0

    def on_signal() -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen == 1:
            _log.info("stopping: finishing handlers in flight (signal again to stop at once)")
            stop.set()
        elif current is not None:
            current.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    _log.info("event loop: %s", event_loop.running_loop_name())
    freeze_startup_heap()  # this process is ours: full GC passes over the start-up heap would stall events in flight
    try:
        await run_controllers(
            controllers,
            credentials=credentials,
            state_dir=state_dir,
            stop=stop,
            resync_interval=resync_interval,
            ack_wait=ack_wait,
        )
    except asyncio.CancelledError:
        return EXIT_INTERRUPTED
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return EXIT_OK


def _fail(message: str, code: int) -> int:
    """Report like every command, and return the code: `main` returns its exit code rather than exiting."""
    report(message, program="harmonaize controller")
    return code
