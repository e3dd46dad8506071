"""Commands `agent` and `fleet-monitor` (a typer app; `harmonaize` registers it, and `python -m provider_agents.cli`
runs it directly).

Configuration follows the rest of the project: the provider secret and the broker URL come from `Settings`
(`HZ_PROVIDER_SECRET`, `HZ_NATS_URL`), as do the inputs a provider switches on for its agents (`HZ_CLOUD_NOTICES`,
`HZ_NVSENTINEL_URL`, `HZ_CARBON_API` and what each needs); options override what makes sense per process. Bad input
(a setting included: the variable is named) is one line on stderr and exit code 2; a failure at run time exits 1.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Annotated

import typer

from harmonaize import event_loop
from harmonaize.cli_errors import fail, settings_or_fail
from harmonaize.ids import InvalidIdError, validate_id
from harmonaize.settings import Settings
from provider_agents.changes import DEFAULT_CARBON_EVERY
from provider_agents.telemetry.detect import SourceKind, SourceUnavailableError
from provider_agents.telemetry.model import REGION_PATTERN
from provider_agents.telemetry.scenario import ScenarioError

__all__ = ["app"]

app = typer.Typer(help="Provider host agents and the fleet monitor.", no_args_is_help=True)


def _settings(nats_url: str | None) -> Settings:
    settings = settings_or_fail()
    return settings.model_copy(update={"nats_url": nats_url}) if nats_url else settings


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _id(kind: str, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return validate_id(kind, value)
    except InvalidIdError as exc:
        fail(str(exc), code=2)


def _region(value: str | None) -> str | None:
    if value is not None and not re.fullmatch(REGION_PATTERN, value):
        fail(f"invalid region {value!r}: expected a public grid zone key such as US-CAL-CISO or DE", code=2)
    return value


@app.command()
def agent(
    host_id: Annotated[str, typer.Option("--host-id", help="This host's provider-internal id.")],
    locality_group: Annotated[
        str | None, typer.Option(help="Locality group (default: the scenario's, else 'default').")
    ] = None,
    gpus: Annotated[
        int | None, typer.Option(help="Simulated GPUs (default: the scenario's, else 8).", min=0, max=64)
    ] = None,
    region: Annotated[str | None, typer.Option(help="Grid zone for carbon (default US-CAL-CISO).")] = None,
    scenario: Annotated[Path | None, typer.Option(help="Scenario YAML for the simulated host.")] = None,
    seed: Annotated[int | None, typer.Option(help="Simulator seed (default: the scenario's, else 0).")] = None,
    source: Annotated[SourceKind, typer.Option(help="Telemetry source.")] = SourceKind.AUTO,
    tick: Annotated[float, typer.Option(help="Seconds between telemetry samples.", min=0.01)] = 1.0,
    carbon_every: Annotated[
        int, typer.Option(help="Re-send carbon every N ticks even unchanged.", min=1)
    ] = DEFAULT_CARBON_EVERY,
    launch: Annotated[
        bool, typer.Option(help="Run the node launcher (needs HZ_ADMIN_TOKEN and HZ_API_URL to relay progress).")
    ] = True,
    work_dir: Annotated[
        Path | None, typer.Option(help="Node state and job control files (default: <HZ_DATA_DIR>/hosts/<host>).")
    ] = None,
    checkpoint_root: Annotated[
        Path | None, typer.Option(help="Shared checkpoint storage (default: <HZ_DATA_DIR>/checkpoints).")
    ] = None,
    grace: Annotated[float, typer.Option(help="Seconds a node gets to checkpoint after SIGTERM.", min=0)] = 30.0,
    stop_nodes_on_exit: Annotated[
        bool, typer.Option(help="Stop this host's nodes when the agent exits (off: a restarted agent adopts them).")
    ] = True,
    testbed_layout: Annotated[
        Path | None,
        typer.Option(help="The testbed this host is a namespace of (its layout JSON): links measured, not scripted."),
    ] = None,
    nats_url: Annotated[str | None, typer.Option(help="Broker URL (default: HZ_NATS_URL).")] = None,
    log_level: Annotated[str, typer.Option(help="Logging level.")] = "INFO",
) -> None:
    """Run the host agent: per-tenant events, raw telemetry, heartbeats, and this host's torchrun nodes."""
    from provider_agents.runtime import AgentOptions, SettingsError, run_agent

    _logging(log_level)
    options = AgentOptions(
        host=_id("host", host_id) or host_id,
        locality_group=_id("locality group", locality_group),
        gpus=gpus,
        region=_region(region),
        scenario=scenario,
        seed=seed,
        source=source,
        tick_s=tick,
        carbon_every=carbon_every,
        launch=launch,
        work_dir=work_dir,
        checkpoint_root=checkpoint_root,
        grace_s=grace,
        stop_nodes_on_exit=stop_nodes_on_exit,
        testbed_layout=testbed_layout,
    )
    try:
        settings = _settings(nats_url)
        event_loop.run(run_agent(settings, options), choice=settings.event_loop)
    except (SettingsError, ScenarioError, SourceUnavailableError) as exc:
        fail(str(exc), code=2)
    except KeyboardInterrupt:
        pass


@app.command("fleet-monitor")
def fleet_monitor(
    nats_url: Annotated[str | None, typer.Option(help="Broker URL (default: HZ_NATS_URL).")] = None,
    check_interval: Annotated[
        float | None, typer.Option(help="Seconds between liveness checks (default: a quarter heartbeat).", min=0.01)
    ] = None,
    rendezvous_bind: Annotated[
        str, typer.Option(help="Address the jobs' rendezvous stores listen on (0.0.0.0: nodes on other machines).")
    ] = "127.0.0.1",
    rendezvous_advertise: Annotated[
        str | None, typer.Option(help="Host name nodes reach the stores by (default: the bind address).")
    ] = None,
    log_level: Annotated[str, typer.Option(help="Logging level.")] = "INFO",
) -> None:
    """Run the provider's central loops: fleet monitor (outages), rendezvous stores, micro loop (directives)."""
    from provider_agents.runtime import MonitorOptions, SettingsError, run_fleet_monitor

    _logging(log_level)
    try:
        options = MonitorOptions(
            check_interval_s=check_interval, rendezvous_bind=rendezvous_bind, rendezvous_advertise=rendezvous_advertise
        )
        settings = _settings(nats_url)
        event_loop.run(run_fleet_monitor(settings, options), choice=settings.event_loop)
    except SettingsError as exc:
        fail(str(exc), code=2)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    app()
