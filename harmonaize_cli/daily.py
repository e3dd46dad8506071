"""Commands for daily use against a running cloud: what a tenant sees (`events tail`, `negotiations`, `jobs`) and
what the provider can inject (`scenario run`).

Tenant commands take the tenant's credentials from the environment (`source .hz/tenant-demo.env`): HZ_TENANT,
HZ_TENANT_TOKEN, HZ_TENANT_NATS_SEED, HZ_API_URL, HZ_NATS_URL. `scenario run` is the provider's (HZ_PROVIDER_SECRET,
HZ_NATS_URL: `source .hz/admin.env`). Exit codes: 0 done, 1 the cloud refused or failed (the reason on stderr),
2 bad input or configuration (the variable or field named).
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

import typer

from harmonaize.cli_errors import fail, settings_or_fail

# Imported by `harmonaize` on every invocation: only typer here; the rest inside the commands (harmonaize_cli/main.py).

__all__ = ["events_app", "jobs_app", "negotiations_app", "scenario_app"]

events_app = typer.Typer(help="The tenant's event feed.", no_args_is_help=True)
negotiations_app = typer.Typer(help="The tenant's negotiations (REST history).", no_args_is_help=True)
jobs_app = typer.Typer(help="The tenant's jobs, their progress and the shapes they ran in.", no_args_is_help=True)
scenario_app = typer.Typer(help="Inject scenarios into a running local cloud (provider).", no_args_is_help=True)


def _need(value: object, variable: str, hint: str) -> str:
    text = value.get_secret_value() if hasattr(value, "get_secret_value") else value
    if not text:
        fail(f"{variable} is not set ({hint})", code=2)
    return str(text)


TENANT_HINT = "source the tenant's env file, e.g. .hz/tenant-demo.env"


class _TenantApi:
    """The tenant's side of the API for one command: the settings read once and one httpx client, so the command's
    requests share a connection and the TLS set-up (httpx builds an SSL context per client, which costs more than a
    request to a local API)."""

    def __init__(self) -> None:
        import httpx

        settings = settings_or_fail()
        token = _need(settings.tenant_token, "HZ_TENANT_TOKEN", TENANT_HINT)
        self.url = settings.resolved_api_url
        self._client = httpx.Client(
            base_url=self.url.rstrip("/"), headers={"Authorization": f"Bearer {token}"}, timeout=30
        )

    def __enter__(self) -> _TenantApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.close()

    def get(self, path: str, *, missing: str | None = None, **params: Any) -> Any:
        """The API's JSON answer, or one line on stderr and the exit code. `missing` names what the path points at
        ("job 'x'") for a 404, whose reason from the API ("job not found") does not say which."""
        import httpx

        try:
            reply = self._client.get(path, params={k: v for k, v in params.items() if v is not None})
        except httpx.TransportError as exc:
            fail(f"cannot reach the API at {self.url}: {exc}")
        if reply.status_code in (401, 403):
            fail(f"the API refused the tenant token: {reply.json().get('reason', reply.text)}", code=2)
        if reply.status_code == 422:
            fail(reply.json().get("reason", reply.text), code=2)
        if reply.status_code == 404 and missing is not None:
            fail(f"{missing} not found")
        if reply.status_code >= 400:
            fail(reply.json().get("reason", reply.text) if reply.content else str(reply.status_code))
        return reply.json()


def _print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, default=str))


def _job_id(value: str) -> str:
    from harmonaize.ids import InvalidIdError, validate_id

    try:
        return validate_id("job", value)
    except InvalidIdError as exc:
        fail(str(exc), code=2)


def figure(value: float | None) -> str:
    """A measured rate for people: 4 significant digits and at least one decimal (1117.4, 87.65, 0.03124), since
    the digits past those are noise of the measurement; '-' when there is none."""
    if value is None:
        return "-"
    if value == 0 or not math.isfinite(value):
        return f"{value:.1f}"
    return f"{value:.{max(1, 3 - math.floor(math.log10(abs(value))))}f}"


# -- negotiations -----------------------------------------------------------------------------------------------


@negotiations_app.command("list")
def negotiations_list(
    job: Annotated[str | None, typer.Option(help="Only this job's.")] = None,
    state: Annotated[
        str | None, typer.Option(help="offered, accepted, rejected, declined, cancelled, expired.")
    ] = None,
    kind: Annotated[
        str | None, typer.Option(help="scale, repartition, defer, migrate_region, approve_maintenance.")
    ] = None,
    limit: Annotated[int, typer.Option(help="At most this many (newest first).", min=1, max=500)] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Negotiations, newest first."""
    with _TenantApi() as api:
        page = api.get("/v1/negotiations", job=job, state=state, kind=kind, limit=limit)
    if as_json:
        _print_json(page["items"])
        return
    for item in page["items"]:
        typer.echo(f"{item['id']}  {item['created_at'][:19]}  {item['job']:<20} {item['kind']:<12} "
                   f"{item['state']:<9} round {item['round']}")


@negotiations_app.command("show")
def negotiations_show(
    negotiation_id: Annotated[str, typer.Argument(help="The negotiation's id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """One negotiation with every round: who, when, what was asked and offered."""
    from urllib.parse import quote

    with _TenantApi() as api:
        detail = api.get(f"/v1/negotiations/{quote(negotiation_id, safe='')}",
                         missing=f"negotiation {negotiation_id!r}")
    if as_json:
        _print_json(detail)
        return
    typer.echo(f"{detail['id']}  job {detail['job']}  {detail['kind']}  {detail['state']}")
    for item in detail["rounds"]:
        what = item.get("offer") or item.get("terms") or {}
        note = f"  ({item['note']})" if item.get("note") else ""
        typer.echo(f"  round {item['round']}  {item['at'][:19]}  {item['actor']:<8} {item['action']:<8} "
                   f"{json.dumps(what, default=str)}{note}")


# -- jobs -------------------------------------------------------------------------------------------------------


@jobs_app.command("list")
def jobs_list(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """The tenant's jobs."""
    with _TenantApi() as api:
        jobs = api.get("/v1/jobs")
    if as_json:
        _print_json(jobs)
        return
    for job in jobs:
        typer.echo(f"{job['id']:<24} workers {job['desired_workers']} ({job['min_workers']}-{job['max_workers']})  "
                   f"plan {job['parallel_plan']}  epoch {job['placement_epoch']}")


@jobs_app.command("show")
def jobs_show(
    job_id: Annotated[str, typer.Argument(help="The job's id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """A job: its agreed shape, its latest progress, the shapes it ran in and the provider's directives."""
    job_id = _job_id(job_id)
    missing = f"job {job_id!r}"
    with _TenantApi() as api:
        job = api.get(f"/v1/jobs/{job_id}", missing=missing)
        status = api.get(f"/v1/jobs/{job_id}/status", missing=missing)
        timeline = api.get(f"/v1/jobs/{job_id}/timeline", missing=missing)
        directives = api.get(f"/v1/jobs/{job_id}/directives", missing=missing, limit=10)
    if as_json:
        _print_json({"job": job, "status": status, "timeline": timeline, "directives": directives})
        return
    typer.echo(f"{job['id']}: {job['desired_workers']} worker(s) agreed ({job['min_workers']}-{job['max_workers']}), "
               f"plan {job['parallel_plan']}, epoch {job['placement_epoch']}, {status.get('phase', 'phase unknown')}")
    progress = status.get("progress")
    if progress is None:
        typer.echo("  no progress reported yet")
    else:
        loss = progress.get("loss")
        rate = figure(progress.get("samples_per_s"))
        typer.echo(f"  step {progress['step']}  world {progress['world_size']}  {progress['parallel_plan']}  "
                   f"loss {loss if loss is None else round(loss, 5)}  samples/s {rate}  "
                   f"compression {progress['compression']}  checkpoint every {progress['checkpoint_interval_steps']}")
    for failure in status.get("node_failures", []):
        if failure["left_job"]:
            outcome = "its workers left the job"
        elif failure["epoch"] == job["placement_epoch"]:
            outcome = "the job stands still until its epoch moves on"
        else:
            outcome = "an earlier epoch"
        step = "?" if failure["step"] is None else failure["step"]
        typer.echo(f"  node failure: {failure['kind']} ({failure['reason']}) on {failure['host']} at step {step}, "
                   f"epoch {failure['epoch']}, {failure['detected_at'][:19]}: {outcome}")
    for entry in timeline:
        typer.echo(f"  from step {entry['step']:>6}: world {entry['world_size']} {entry['parallel_plan']} "
                   f"(epoch {entry['epoch']}, {entry['at'][:19]})")
    for item in directives:
        typer.echo(f"  directive v{item['version']} {item['state']}: {item['reason']} "
                   f"{'; '.join(item['refusals'])}".rstrip())


# -- events -----------------------------------------------------------------------------------------------------


@events_app.command("tail")
def events_tail(
    kind: Annotated[str | None, typer.Option(help="Only this kind (failure, carbon, negotiation, ...).")] = None,
    job: Annotated[str | None, typer.Option(help="Only this job's.")] = None,
    count: Annotated[int | None, typer.Option(help="Exit after this many events.", min=1)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print each CloudEvent as JSON.")] = False,
) -> None:
    """Print the tenant's events as they arrive (live), until Ctrl-C or `--count`."""
    from harmonaize.events import UnknownEventKindError
    from harmonaize.ids import InvalidIdError
    from harmonaize.subjects import tenant_events_filter

    settings = settings_or_fail()
    tenant = _need(settings.tenant, "HZ_TENANT", TENANT_HINT)
    seed = _need(settings.tenant_nats_seed, "HZ_TENANT_NATS_SEED", TENANT_HINT)
    try:
        subject = tenant_events_filter(tenant, kind=kind or None, job=job or None)
    except (UnknownEventKindError, InvalidIdError) as exc:
        fail(str(exc), code=2)
    from harmonaize import event_loop

    try:
        event_loop.run(
            _tail(settings.nats_url, seed, subject, count=count, as_json=as_json), choice=settings.event_loop
        )
    except KeyboardInterrupt:
        pass


async def _tail(url: str, seed: str, subject: str, *, count: int | None, as_json: bool) -> None:
    import asyncio

    import nats

    try:
        nc = await asyncio.wait_for(nats.connect(url, nkeys_seed_str=seed, name="hz-events-tail"), 10)
    except Exception as exc:
        fail(f"cannot connect to the broker at {url}: {exc!r}")
    done = asyncio.Event()
    seen = 0

    async def on_event(msg: Any) -> None:
        nonlocal seen
        if as_json:
            typer.echo(msg.data.decode())
        else:
            event = json.loads(msg.data)
            parts = msg.subject.split(".")
            typer.echo(f"{event.get('time', '')[:23]}  {parts[4]:<11} {parts[5]:<20} "
                       f"{json.dumps(event.get('data'), separators=(',', ':'))}")
        seen += 1
        if count is not None and seen >= count:
            done.set()

    await nc.subscribe(subject, cb=on_event)
    try:
        await done.wait()
    finally:
        await nc.close()


# -- scenario ---------------------------------------------------------------------------------------------------


@scenario_app.command("run")
def scenario_run(
    file: Annotated[Path, typer.Argument(help="Scenario YAML: congestion, failures, predicted failures, maintenance, "
                                            "carbon; offsets count from the injection.")],
    delay: Annotated[float, typer.Option(help="Seconds from now until offset 0.", min=0)] = 0.0,
    wait: Annotated[float, typer.Option(help="Seconds to collect the hosts' acknowledgements.", min=0.1)] = 2.0,
) -> None:
    """Inject a scenario into every running simulated host (as the provider)."""
    from harmonaize import event_loop
    from provider_agents.telemetry.scenario import ScenarioError, ScenarioInjection, load_scenario

    try:
        scenario = load_scenario(file)
    except ScenarioError as exc:
        fail(str(exc), code=2)
    settings = settings_or_fail()
    secret = _need(settings.provider_secret, "HZ_PROVIDER_SECRET", "source .hz/admin.env")
    injection = ScenarioInjection(scenario=scenario, at=datetime.now(UTC) + timedelta(seconds=delay))
    replies = event_loop.run(
        _inject(settings.nats_url, secret.encode(), injection.model_dump_json().encode(), wait),
        choice=settings.event_loop,
    )
    applied = sorted(r["host"] for r in replies if r.get("applied"))
    refused = sorted(f"{r['host']} ({r.get('reason')})" for r in replies if not r.get("applied"))
    if not replies:
        fail("no simulated host answered: is the local cloud running (harmonaize up)?")
    typer.echo(f"injected {file.name} into {len(applied)} host(s): {', '.join(applied) or 'none'}"
               + (f"; not applied on {', '.join(refused)}" if refused else ""))


async def _inject(url: str, secret: bytes, payload: bytes, wait: float) -> list[dict[str, Any]]:
    """Publish the injection as the provider and collect the hosts' answers.

    A one-shot connection, not the long-running processes' `connect_provider`: that one reconnects forever and
    reports every disconnection, and nats-py runs a connection's disconnected callback on a deliberate close() too,
    so every normal exit would report a lost broker. Here a broker lost mid-command is an error to report, and the
    close at the end is quiet."""
    import asyncio

    import nats

    from broker_config.keys import ProviderKeys
    from provider_agents.telemetry.scenario import SCENARIO_INJECT_SUBJECT

    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:  # nats-py logs these with a traceback unless someone takes them
        errors.append(exc)

    try:
        nc = await asyncio.wait_for(
            nats.connect(url, nkeys_seed_str=ProviderKeys(secret).provider.seed, name="hz-scenario-run",
                         allow_reconnect=False, max_reconnect_attempts=1, reconnect_time_wait=0.5,
                         connect_timeout=2, error_cb=on_error),
            10,
        )
    except Exception as exc:
        cause = f" ({errors[-1]!r})" if errors and errors[-1] is not exc else ""
        fail(f"cannot connect to the broker at {url}: {exc!r}{cause}")
    replies: list[dict[str, Any]] = []

    async def collect(msg: Any) -> None:
        if msg.data:  # an empty one is the broker's "no responders" status: no host listens
            replies.append(json.loads(msg.data))

    try:
        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=collect)
        await nc.publish(SCENARIO_INJECT_SUBJECT, payload, reply=inbox)
        await nc.flush()
        await asyncio.sleep(wait)  # replies from an unknown number of hosts: collect for a fixed window
        if nc.is_closed or errors:
            fail(f"the broker at {url} failed during the injection: {errors[-1] if errors else 'connection lost'}")
    finally:
        await nc.close()
    return replies
