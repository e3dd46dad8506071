"""`harmonaize conformance`: check a provider's tenant feed and isolation with nothing but a tenant's credentials.

The credentials are the ones a tenant's env file holds (`source .hz/tenant-demo.env`): HZ_TENANT, HZ_TENANT_TOKEN,
HZ_TENANT_NATS_SEED, HZ_NATS_URL, HZ_API_URL. The command reads the tenant's slice of the broker (`hz.t.<tenant>.>`,
or one job's events with `--job`) for `--duration` seconds or until `--events` arrived, checking every message, and
meanwhile runs the isolation probes; then it prints the report (`--json` writes it too).

Exit codes: 0 the feed and isolation conform; 1 something failed (the report says what); 2 bad input, nothing checked
(a variable missing or malformed, a broker or API that cannot be reached or refuses the credentials, a bad `--spec`),
in one line naming it. Only typer and the standard library are imported at module level: the lazy registration in
`harmonaize_cli.main` imports this module for `--help` too, and the checks need `jsonschema-rs`, which a plain
install may lack (the command then says which extra to install).
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Final
from urllib.parse import urlsplit

import typer

from harmonaize.cli_errors import EXIT_BAD_INPUT, EXIT_FAILURE, fail, settings_or_fail
from harmonaize.cli_errors import report as say

if TYPE_CHECKING:
    import httpx
    from nats.aio.client import Client

    from harmonaize.settings import Settings
    from harmonaize_cli.conformance.interface import Interface
    from harmonaize_cli.conformance.report import Report

__all__ = ["Credentials", "conformance_command"]

TENANT_HINT: Final = "source the tenant's env file, e.g. .hz/tenant-demo.env"
EXTRA_LINE: Final = ("'conformance' needs jsonschema-rs to validate payloads (it is not installed): "
                     "pip install 'harmonaize[conformance]'")
DEFAULT_OTHER_TENANT: Final = "conformance-other"
EXIT_INTERRUPTED: Final = 130
_NATS_SCHEMES: Final = ("nats", "tls", "ws", "wss")
_API_SCHEMES: Final = ("http", "https")


class BadInput(Exception):
    """Nothing can be checked: the message names the variable or the service that is wrong."""


def conformance_command(
    duration: Annotated[float, typer.Option(min=0.1, help="Seconds to read the feed, at most.")] = 10.0,
    events: Annotated[int | None, typer.Option(
        min=1, help="Stop after this many events; fewer by the end of --duration fails the run.")] = None,
    job: Annotated[str | None, typer.Option(help="Only this job's events.")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON here.")] = None,
    spec: Annotated[Path | None, typer.Option(
        help="Directory of the published interface (asyncapi.json, schemas/); default: this install's own.")] = None,
    other_tenant: Annotated[str, typer.Option(
        help="A tenant id the isolation probes try to reach (it need not exist).")] = DEFAULT_OTHER_TENANT,
    other_job: Annotated[str | None, typer.Option(
        help="Another tenant's job id for the REST probes (default: a random id).")] = None,
    probe_timeout: Annotated[float, typer.Option(
        min=0.1, help="Seconds to wait for the broker to refuse the NATS probes.")] = 3.0,
    strict_duplicates: Annotated[bool, typer.Option(
        help="Fail an identical re-send of an event id too (default: a warning; delivery is at least once).")] = False,
) -> None:
    """Check the tenant's live event feed against the published interface and probe the tenant's isolation."""
    try:
        import jsonschema_rs  # noqa: F401  (the checks need it; say which extra brings it before anything else)
    except ModuleNotFoundError:
        fail(EXTRA_LINE, code=EXIT_BAD_INPUT)
    from harmonaize import event_loop
    from harmonaize.ids import InvalidIdError, validate_id
    from harmonaize_cli.conformance.interface import InterfaceError, load_interface

    settings = settings_or_fail()
    credentials = Credentials.from_settings(settings)
    try:
        for kind, value in (("--job", job), ("--other-tenant", other_tenant), ("--other-job", other_job)):
            if value is not None:
                validate_id(kind, value)
    except InvalidIdError as exc:
        fail(str(exc), code=EXIT_BAD_INPUT)
    if other_tenant == credentials.tenant:
        fail(f"--other-tenant: {other_tenant!r} is this tenant (HZ_TENANT); name another", code=EXIT_BAD_INPUT)
    if json_path is not None and (json_path.is_dir() or not json_path.parent.is_dir()):
        fail(f"--json: cannot write {json_path} (a directory, or its folder does not exist)", code=EXIT_BAD_INPUT)
    try:
        interface = load_interface(spec)
    except InterfaceError as exc:
        fail(str(exc), code=EXIT_BAD_INPUT)
    run = _Run(
        credentials, interface, job=job, other_tenant=other_tenant,
        other_job=other_job or f"conformance-{secrets.token_hex(4)}",
        duration=duration, events=events, probe_timeout=probe_timeout, strict_duplicates=strict_duplicates,
    )
    try:
        result = event_loop.run(run.main(), choice=settings.event_loop)
    except BadInput as exc:
        fail(str(exc), code=EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        fail("interrupted: no report", code=EXIT_INTERRUPTED)
    typer.echo(result.render())
    if json_path is not None:
        json_path.write_text(json.dumps(result.to_json(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if not result.passed:
        raise typer.Exit(EXIT_FAILURE)


class Credentials:
    """A tenant's credentials from the environment, each checked for presence and shape (exit 2 naming it)."""

    def __init__(self, *, tenant: str, token: str, seed: str, nats_url: str, api_url: str) -> None:
        self.tenant, self.token, self.seed, self.nats_url, self.api_url = tenant, token, seed, nats_url, api_url

    @classmethod
    def from_settings(cls, settings: Settings) -> Credentials:
        values = {
            "HZ_TENANT": settings.tenant or "",
            "HZ_TENANT_TOKEN": _secret(settings.tenant_token),
            "HZ_TENANT_NATS_SEED": _secret(settings.tenant_nats_seed),
            # Both URLs have defaults in the settings (a local cloud's); a tenant's env names them, so must the user.
            "HZ_NATS_URL": settings.nats_url if "nats_url" in settings.model_fields_set else "",
            "HZ_API_URL": settings.api_url,
        }
        missing = [name for name, value in values.items() if not value]
        if missing:
            fail(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set ({TENANT_HINT})",
                 code=EXIT_BAD_INPUT)
        for variable, schemes in (("HZ_NATS_URL", _NATS_SCHEMES), ("HZ_API_URL", _API_SCHEMES)):
            problem = url_problem(values[variable], schemes)
            if problem is not None:
                fail(f"{variable}: {problem}", code=EXIT_BAD_INPUT)
        if not _is_user_seed(values["HZ_TENANT_NATS_SEED"]):
            fail("HZ_TENANT_NATS_SEED is not a NATS user nkey seed (SU...)", code=EXIT_BAD_INPUT)
        return cls(tenant=values["HZ_TENANT"], token=values["HZ_TENANT_TOKEN"], seed=values["HZ_TENANT_NATS_SEED"],
                   nats_url=values["HZ_NATS_URL"], api_url=values["HZ_API_URL"].rstrip("/"))


def url_problem(value: str, schemes: tuple[str, ...]) -> str | None:
    """What is wrong with a URL (each of a comma-separated list), or None."""
    for url in value.split(","):
        try:
            parts = urlsplit(url.strip())
            parts.port  # noqa: B018  (raises ValueError for a port that is not a number or out of range)
        except ValueError as exc:
            return f"{url.strip()!r} is not a URL ({exc})"
        if parts.scheme not in schemes or not parts.hostname:
            return f"{url.strip()!r} is not a {'/'.join(schemes)} URL with a host"
    return None


def _secret(value: object) -> str:
    getter = getattr(value, "get_secret_value", None)
    return str(getter()) if getter is not None else ""


def _is_user_seed(seed: str) -> bool:
    if not seed.startswith("SU"):
        return False
    from broker_config.keys import public_key_of

    try:
        public_key_of(seed)
    except Exception:  # nkeys raises its own untyped errors for a malformed seed
        return False
    return True


class _Run:
    """One conformance run: the pre-flight checks of the credentials, then the feed and the probes side by side."""

    def __init__(
        self,
        credentials: Credentials,
        interface: Interface,
        *,
        job: str | None,
        other_tenant: str,
        other_job: str,
        duration: float,
        events: int | None,
        probe_timeout: float,
        strict_duplicates: bool,
    ) -> None:
        self.credentials, self.interface = credentials, interface
        self.job, self.other_tenant, self.other_job = job, other_tenant, other_job
        self.duration, self.events, self.probe_timeout = duration, events, probe_timeout
        self.strict_duplicates = strict_duplicates

    async def main(self) -> Report:
        import asyncio

        import httpx

        from harmonaize.subjects import tenant_events_filter, tenant_slice
        from harmonaize_cli.conformance.binding import Received
        from harmonaize_cli.conformance.checks import DuplicateTracker, check_message
        from harmonaize_cli.conformance.feed import read_feed
        from harmonaize_cli.conformance.probes import (
            Action,
            NatsProbe,
            nats_probes,
            rest_probes,
            run_nats_probes,
            run_rest_probes,
            violation_seen,
        )
        from harmonaize_cli.conformance.report import Report

        creds = self.credentials
        subject = tenant_events_filter(creds.tenant, job=self.job) if self.job else tenant_slice(creds.tenant)
        headers = {"Authorization": f"Bearer {creds.token}"}
        async with httpx.AsyncClient(base_url=creds.api_url, headers=headers, timeout=10) as api:
            await self._check_token(api)
            feed_errors: list[str] = []
            probe_errors: list[str] = []
            feed_nc = await self._connect("hz-conformance", feed_errors)
            try:
                probe_nc = await self._connect("hz-conformance-probes", probe_errors)
            except BadInput:
                await feed_nc.close()
                raise
            result = Report(tenant=creds.tenant, subject=subject, interface=self.interface.origin,
                            expected_events=self.events)
            duplicates = DuplicateTracker(strict=self.strict_duplicates)
            nonce = secrets.token_hex(8)

            def on_message(received: Received) -> None:
                try:
                    checked = check_message(received, tenant=creds.tenant, interface=self.interface,
                                            duplicates=duplicates)
                except Exception as exc:  # a message the kit cannot handle is reported, never silently dropped
                    result.feed_problems.append(f"a message on {received.subject} could not be checked: {exc!r}")
                    return
                result.add_message(checked)

            try:
                feed, nats_results, rest_results = await asyncio.gather(
                    read_feed(
                        feed_nc, subject, duration=self.duration, max_events=self.events, nonce=nonce,
                        on_message=on_message,
                        on_listening=lambda: say(f"conformance: listening on {subject} for up to {self.duration:g} s; "
                                                 "probing isolation"),
                    ),
                    run_nats_probes(probe_nc, probe_errors, nats_probes(creds.tenant, other_tenant=self.other_tenant),
                                    timeout=self.probe_timeout, nonce=nonce),
                    run_rest_probes(api, rest_probes(other_tenant=self.other_tenant, other_job=self.other_job)),
                )
            finally:
                await probe_nc.close()
                await feed_nc.close()
            result.add_probes([*nats_results, *rest_results])
            if violation_seen(feed_errors, NatsProbe("", Action.SUBSCRIBE, subject)):
                result.feed_problems.append(f"the broker refused this tenant's own subscription to {subject}")
            result.finish(seconds=feed.seconds, duplicates=duplicates.duplicates)
            return result

    async def _check_token(self, api: httpx.AsyncClient) -> None:
        """`GET /v1/tenant` answers with this tenant: the API is reachable and the token is this tenant's."""
        import httpx

        url = self.credentials.api_url
        try:
            reply = await api.get("/v1/tenant")
        except httpx.HTTPError as exc:
            raise BadInput(f"cannot reach the API at {url} (HZ_API_URL): {exc!r}") from exc
        if reply.status_code in (401, 403):
            raise BadInput(f"the API at {url} refused HZ_TENANT_TOKEN ({reply.status_code}): {_reason(reply)}")
        if reply.status_code != 200:
            raise BadInput(f"the API at {url} answered GET /v1/tenant with {reply.status_code}: {_reason(reply)}")
        owner = _json_field(reply, "id")
        if owner != self.credentials.tenant:
            raise BadInput(f"HZ_TENANT_TOKEN belongs to tenant {owner!r}, not HZ_TENANT {self.credentials.tenant!r}")

    async def _connect(self, name: str, errors: list[str]) -> Client:
        """A connection with the tenant's seed whose asynchronous errors (permission violations) land in `errors`."""
        import asyncio

        import nats

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        url = self.credentials.nats_url
        try:
            return await asyncio.wait_for(nats.connect(
                url.split(","), nkeys_seed_str=self.credentials.seed, name=name, error_cb=on_error,
                allow_reconnect=False, connect_timeout=5,
            ), timeout=15)
        except Exception as exc:  # nats-py raises many kinds (no servers, auth, timeouts, OS errors)
            raise BadInput(f"cannot connect to the broker at {url} (HZ_NATS_URL) with HZ_TENANT_NATS_SEED: "
                           f"{exc!r}") from exc


def _reason(reply: httpx.Response) -> str:
    reason = _json_field(reply, "reason")
    return str(reason) if reason is not None else reply.text[:200]


def _json_field(reply: httpx.Response, name: str) -> object:
    try:
        body = reply.json()
    except ValueError:
        return None
    return body.get(name) if isinstance(body, dict) else None
