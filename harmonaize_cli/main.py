"""The `harmonaize` command: start the local cloud, migrate the database, manage tenants.

Messages for shell users: one line naming what is wrong, on stderr, exit code 2 for bad input or configuration and 1
for a failure at run time.

Start-up is kept short because people type these commands all day: this module and the command modules it registers
eagerly (`daily`, `services`) import only typer at module level; settings (pydantic), the event loop, httpx,
FastAPI, SQLAlchemy, nats and torch are imported inside the commands that need them, and the commands that live with
their part (agent, fleet monitor, controller runner) are registered lazily (`harmonaize_cli.lazy`). A test checks
that `--help` and `version` import none of the heavy stacks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from harmonaize import __version__
from harmonaize.cli_errors import fail, settings_or_fail
from harmonaize_cli.daily import events_app, jobs_app, negotiations_app, scenario_app
from harmonaize_cli.lazy import lazy_command, lazy_group
from harmonaize_cli.services import app as services_app

if TYPE_CHECKING:
    import httpx

    from harmonaize.settings import Settings

app = typer.Typer(help="HarmonAIze: tenant-provider cooperation for AI workloads.", no_args_is_help=True)
db_app = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
tenants_app = typer.Typer(help="Tenants of the control plane (needs the admin token).", no_args_is_help=True)

# Commands that live with the part they run (the host agent and fleet monitor, the tenant controller runner), listed
# here with their help text and imported when they run: their modules import their whole part.
lazy_command(app, "agent", "provider_agents.cli:agent",
             help="Run the host agent: per-tenant events, raw telemetry, heartbeats, and this host's torchrun nodes.")
lazy_command(app, "fleet-monitor", "provider_agents.cli:fleet_monitor",
             help="Run the provider's central loops: fleet monitor (outages), rendezvous stores, micro loop "
                  "(directives).")
lazy_command(app, "eval", "harmonaize_cli.evaluation.command:eval_command",
             help="Measure what cooperation buys: each scenario with the status quo and with HarmonAIze; report, "
                  "plots, JSON.")
lazy_command(app, "asyncapi", "harmonaize_cli.asyncapi_command:asyncapi_command",
             help="Write the tenant event interface as an AsyncAPI 3.0 document and JSON Schemas; --check compares "
                  "instead.")
lazy_command(app, "conformance", "harmonaize_cli.conformance.command:conformance_command",
             help="Check the tenant's live event feed against the published interface and probe the tenant's "
                  "isolation.")
app.add_typer(db_app, name="db")
app.add_typer(tenants_app, name="tenants")
lazy_group(app, "controller", "tenant_controllers.cli:app",
           help="Tenant controllers: react to your jobs' events and negotiate with the provider.")
app.add_typer(events_app, name="events")
app.add_typer(negotiations_app, name="negotiations")
app.add_typer(jobs_app, name="jobs")
app.add_typer(scenario_app, name="scenario")
app.add_typer(services_app)  # `api ...`, `broker ...`


@app.command()
def config() -> None:
    """Print the configuration reference (every HZ_ variable, its default and meaning) as markdown."""
    from harmonaize_cli.config_reference import render_reference

    typer.echo(render_reference())


@app.command()
def version() -> None:
    """Print the version."""
    typer.echo(__version__)


@app.command()
def up(
    data_dir: Annotated[Path | None, typer.Option(help="State directory (default: HZ_DATA_DIR or .hz).")] = None,
    nats_port: Annotated[int, typer.Option(help="Broker client port; 0 picks a free one.", min=0, max=65535)] = 0,
    api_port: Annotated[
        int | None, typer.Option(help="API port (default 8080); 0 picks a free one.", min=0, max=65535)
    ] = None,
    demo_tenant: Annotated[bool, typer.Option(help="Create the demo tenant and write its credentials.")] = True,
    hosts: Annotated[
        int | None,
        typer.Option(help="Simulated GPU hosts, in 2 locality groups (default: the scenario's 4).", min=1, max=64),
    ] = None,
    scenario: Annotated[
        Path | None,
        typer.Option(help="Scenario YAML the simulated hosts live through (default: a quiet fleet, no episodes)."),
    ] = None,
    fleet: Annotated[bool, typer.Option(help="Start the simulated hosts' agents and the provider's loops.")] = True,
    demo: Annotated[
        bool, typer.Option(help="Play the demo story once in this cloud (as `harmonaize demo`), then keep running.")
    ] = False,
    testbed: Annotated[
        bool,
        typer.Option(help="Each host a network namespace, the groups joined by shaped links: congestion measured, "
                          "partitions real (needs root and iproute2; otherwise loopback, said in one line)."),
    ] = False,
    uplink_mbit: Annotated[
        float, typer.Option(help="With --testbed: each locality group's uplink rate in Mbit/s.", min=1, max=10_000)
    ] = 50.0,
) -> None:
    """Start the local cloud: embedded nats-server, the API on SQLite, simulated GPU hosts with their agents, a demo
    tenant. Ctrl-C stops everything."""
    from broker_config.server import BrokerError
    from harmonaize import event_loop
    from harmonaize_cli.local_cloud.fleet import fleet_of
    from harmonaize_cli.local_cloud.launcher import LocalCloudError, LocalCloudInfo, run_local_cloud

    settings = settings_or_fail(data_dir=data_dir, api_port=api_port)
    if scenario is not None and not scenario.is_file():
        fail(f"scenario file not found: {scenario}", code=2)

    def ready(info: LocalCloudInfo) -> None:
        typer.echo("HarmonAIze local cloud is up  (Ctrl-C stops it)")
        typer.echo(f"  broker (NATS)   {info.nats_url}    log: {info.broker_log}")
        typer.echo(f"  API             {info.api_url}    docs: {info.api_url}/docs")
        typer.echo(f"  web console     {info.api_url}/console/    (sign in with a token from the env files below)")
        typer.echo(f"  admin env       source {info.admin_env_file}")
        if info.tenant_env_file is not None:
            typer.echo(f"  demo tenant     source {info.tenant_env_file}")
        for host, (group, gpus) in info.hosts.items():
            typer.echo(f"  host {host:<10} group {group}, {gpus} GPU(s)    log: {info.logs_dir}/agent-{host}.log")
        typer.echo(f"  network         {info.network}")
        typer.echo(f"  data dir        {info.data_dir}")

    story = None
    if demo:
        if not fleet or scenario is not None or hosts is not None or not demo_tenant:
            fail("--demo plays its own scenario on the default fleet: drop --no-fleet, --scenario, --hosts", code=2)
        from rich.console import Console

        from harmonaize_cli.local_cloud.demo import DEMO_SCENARIO, DemoStory

        settings.data_dir.mkdir(parents=True, exist_ok=True)
        scenario = settings.data_dir / "demo-scenario.yaml"
        scenario.write_text(DEMO_SCENARIO)
        story = DemoStory(
            console=Console(), done_marker=settings.data_dir / "demo-summary.json", hand_over=True
        )
    try:
        event_loop.run(
            run_local_cloud(
                settings,
                nats_port=nats_port,
                on_ready=ready,
                demo_tenant=demo_tenant,
                fleet=fleet,
                scenario=scenario,
                hosts=fleet_of(hosts) if hosts is not None else None,
                story=story,
                keep_running=True,
                testbed_mbit=uplink_mbit if testbed else None,
            ),
            choice=settings.event_loop,
        )
    except (LocalCloudError, BrokerError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        pass
    typer.echo("HarmonAIze local cloud stopped.")


@app.command()
def demo(
    data_dir: Annotated[
        Path | None, typer.Option(help="State directory; must be new (default: a fresh temporary one).")
    ] = None,
    summary_json: Annotated[Path | None, typer.Option(help="Also write the summary as JSON here.")] = None,
    live: Annotated[bool | None, typer.Option(help="Live status table (default: when stdout is a terminal).")] = None,
) -> None:
    """Run the demo story on a fresh local cloud with a real training job and the example controllers (~3 min)."""
    import tempfile

    from rich.console import Console

    from broker_config.server import BrokerError
    from harmonaize import event_loop
    from harmonaize_cli.local_cloud.demo import DEMO_SCENARIO, DemoStory
    from harmonaize_cli.local_cloud.launcher import LocalCloudError, run_local_cloud

    if data_dir is None:
        data_dir = Path(tempfile.mkdtemp(prefix="hz-demo-"))
    elif data_dir.exists() and any(data_dir.iterdir()):
        fail(f"--data-dir {data_dir} is not empty: the demo needs a fresh cloud", code=2)
    settings = settings_or_fail(data_dir=data_dir, api_port=0)
    scenario = data_dir / "demo-scenario.yaml"
    data_dir.mkdir(parents=True, exist_ok=True)
    scenario.write_text(DEMO_SCENARIO)
    console = Console()
    story = DemoStory(console=console, summary_json=summary_json, live=live)
    console.print(f"HarmonAIze demo: a fresh local cloud in {data_dir} (logs in {data_dir / 'logs'})")
    try:
        event_loop.run(run_local_cloud(settings, scenario=scenario, story=story), choice=settings.event_loop)
    except (LocalCloudError, BrokerError, RuntimeError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    summary = story.summary
    if not (summary.scale_up and summary.recovered and summary.repartitioned and summary.history_complete):
        fail("the story did not complete (see the summary and the logs)")


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument(help="Target revision.")] = "head") -> None:
    """Create or migrate the schema (the only way the schema is created)."""
    from api.migrate import upgrade

    settings = settings_or_fail()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        upgrade(settings, revision)
    except Exception as exc:  # alembic and drivers raise many types; the user needs the message
        fail(f"migration to {revision} failed: {exc}")
    typer.echo(f"database at {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument(help="Target revision, e.g. base.")]) -> None:
    """Step the schema back to a revision."""
    from api.migrate import downgrade

    try:
        downgrade(settings_or_fail(), revision)
    except Exception as exc:
        fail(f"downgrade to {revision} failed: {exc}")
    typer.echo(f"database at {revision}")


@db_app.command("current")
def db_current() -> None:
    """Print the schema revision of the database (empty: not migrated)."""
    from api.migrate import current

    try:
        typer.echo(current(settings_or_fail()) or "(no schema: run 'harmonaize db upgrade')")
    except Exception as exc:
        fail(f"cannot read the schema revision: {exc}")


def _admin_client(settings: Settings) -> httpx.Client:
    import httpx

    if settings.admin_token is None:
        fail("HZ_ADMIN_TOKEN is not set (source the admin env file that 'harmonaize up' printed)", code=2)
    return httpx.Client(
        base_url=settings.resolved_api_url,
        headers={"Authorization": f"Bearer {settings.admin_token.get_secret_value()}"},
        timeout=30,
    )


@tenants_app.command("create")
def tenants_create(
    tenant_id: Annotated[str, typer.Argument(help="Tenant id: lowercase letters, digits, '_' and '-'.")],
    display_name: Annotated[str | None, typer.Option(help="Human-readable name.")] = None,
) -> None:
    """Create a tenant; prints its API token and NATS credentials once, as JSON."""
    import httpx

    from harmonaize.ids import InvalidIdError, validate_id

    try:
        validate_id("tenant", tenant_id)
    except InvalidIdError as exc:
        fail(str(exc), code=2)
    settings = settings_or_fail()
    try:
        with _admin_client(settings) as client:
            reply = client.post("/v1/tenants", json={"id": tenant_id, "display_name": display_name or tenant_id})
    except httpx.HTTPError as exc:
        fail(f"cannot reach the API at {settings.resolved_api_url}: {exc}")
    if reply.status_code != 201:
        fail(f"{reply.status_code}: {reply.json().get('reason', reply.text)}")
    typer.echo(json.dumps(reply.json(), indent=2))


@tenants_app.command("list")
def tenants_list() -> None:
    """List tenants."""
    import httpx

    settings = settings_or_fail()
    try:
        with _admin_client(settings) as client:
            reply = client.get("/v1/tenants")
    except httpx.HTTPError as exc:
        fail(f"cannot reach the API at {settings.resolved_api_url}: {exc}")
    if reply.status_code != 200:
        fail(f"{reply.status_code}: {reply.json().get('reason', reply.text)}")
    for tenant in reply.json():
        typer.echo(f"{tenant['id']}\t{tenant.get('display_name', '')}")


def main() -> None:
    """The entry point. A command that needs an extra this install lacks (`harmonaize[provider]`, `[workloads]`,
    `[all]`) is refused in one line naming it (harmonaize_cli/extras.py), not with a traceback."""
    from harmonaize_cli.extras import missing_extra

    try:
        needed = missing_extra(sys.argv[1:])
        if needed is None:
            app()
    except ModuleNotFoundError as exc:
        needed = missing_extra(sys.argv[1:], exc)
        if needed is None:
            raise
    except KeyboardInterrupt:
        sys.exit(130)
    if needed is not None:
        fail(needed, code=2)


if __name__ == "__main__":
    main()
