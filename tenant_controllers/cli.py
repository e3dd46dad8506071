"""`harmonaize controller ...` (and `python -m tenant_controllers.cli ...`): run tenant controller scripts.

A typer app on its own so the `harmonaize` CLI can mount it (`app.add_typer(controller_app, name="controller")`)
without importing the SDK until the command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Tenant controllers: react to your jobs' events and negotiate with the provider.",
                  no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Tenant controllers.

    Credentials come from HZ_TENANT, HZ_TENANT_TOKEN, HZ_TENANT_NATS_SEED, HZ_NATS_URL and HZ_API_URL.
    """


@app.command()
def run(
    script: Annotated[Path, typer.Argument(help="A Python file that defines one or more Controller objects.")],
    state_dir: Annotated[
        Path | None, typer.Option(help="Where handled-event records live (default: <HZ_DATA_DIR>/controllers).")
    ] = None,
    resync_interval: Annotated[
        float, typer.Option(help="Seconds between resyncs of each job (0 disables periodic resync).", min=0)
    ] = 60.0,
    ack_wait: Annotated[
        float,
        typer.Option(
            help="Seconds before an event we did not ack is redelivered (e.g. after a crash).", min=1, max=600
        ),
    ] = 30.0,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
) -> None:
    """Run the controllers a script defines until SIGINT/SIGTERM, then finish handlers in flight and exit 0."""
    from tenant_controllers.runner import main

    code = main(
        script, state_dir=state_dir, resync_interval=resync_interval or None, ack_wait=ack_wait, log_level=log_level
    )
    raise typer.Exit(code)


if __name__ == "__main__":
    app()
