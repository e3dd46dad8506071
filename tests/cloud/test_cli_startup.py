"""The CLI's start-up contract: commands import only what they use (harmonaize_cli/main.py), so `--help`, `version` and
the daily commands do not pay for FastAPI, SQLAlchemy, nats or torch; and the commands registered lazily
(harmonaize_cli/lazy.py) are listed with the help text of the real command they load. Behaviour, not timing: what
each command leaves in `sys.modules`, checked in a fresh interpreter (bench/bench_cli.py measures the time)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import click
import pytest
from typer.testing import CliRunner

from harmonaize_cli.lazy import lazy_entries
from harmonaize_cli.main import app

HEAVY = ("torch", "fastapi", "starlette", "sqlalchemy", "alembic", "nats", "uvicorn", "uvloop", "numpy")
PARTS = ("api", "provider_agents", "tenant_controllers", "workloads")
"""(Not broker_config: validating the settings reads its sync-interval rule, which imports nothing heavy.)"""

_PROBE = """
import json, sys
from harmonaize_cli.main import main
out, sys.argv = sys.argv[1], ["harmonaize", *sys.argv[2:]]
try:
    main()
except SystemExit as exit:
    code = exit.code
else:
    code = 0
with open(out, "w") as f:
    json.dump({"code": code, "modules": sorted({name.split(".")[0] for name in sys.modules})}, f)
"""


def imported_by(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, set[str]]:
    """Run `harmonaize *args` in a fresh interpreter; its exit code and the top-level packages it imported."""
    out = tmp_path / "modules.json"
    base = {k: v for k, v in os.environ.items() if not k.startswith("HZ_")}
    completed = subprocess.run([sys.executable, "-c", _PROBE, str(out), *args], capture_output=True, text=True,
                               timeout=60, env={**base, **(env or {})}, cwd=tmp_path)
    assert out.exists(), completed.stderr
    probe = json.loads(out.read_text())
    return probe["code"], set(probe["modules"])


@pytest.fixture
def refused_url() -> Iterator[str]:
    """An API URL on a port bound here and not listening: a connection is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("args", [["--help"], ["version"], ["jobs", "--help"], ["agent", "--help"]])
def test_help_and_version_import_no_heavy_stack(tmp_path: Path, args: list[str]) -> None:
    code, modules = imported_by(tmp_path, *args)
    assert code == 0
    assert not modules & set(HEAVY), f"`harmonaize {' '.join(args)}` imported {sorted(modules & set(HEAVY))}"
    if args != ["agent", "--help"]:
        assert not modules & set(PARTS), f"`harmonaize {' '.join(args)}` imported {sorted(modules & set(PARTS))}"
        assert "httpx" not in modules and "pydantic_settings" not in modules


def test_daily_commands_import_only_their_client(tmp_path: Path, refused_url: str) -> None:
    env = {"HZ_API_URL": refused_url, "HZ_TENANT": "acme", "HZ_TENANT_TOKEN": "token"}
    for args in (["jobs", "show", "my-job"], ["negotiations", "list"]):
        code, modules = imported_by(tmp_path, *args, env=env)
        assert code == 1, "the API is not there: a run-time failure"
        assert "httpx" in modules, "it did try the API"
        assert not modules & set(HEAVY) and not modules & set(PARTS), sorted(modules & set(HEAVY + PARTS))


def test_the_probe_sees_a_heavy_import(tmp_path: Path) -> None:
    """`controller run` does load the tenant SDK (and nats): the probe above would notice a leak."""
    script = tmp_path / "ctl.py"
    script.write_text("from tenant_controllers import Controller\nctl = Controller(tenant='acme', job='j1')\n")
    code, modules = imported_by(tmp_path, "controller", "run", str(script))  # no credentials: exit 2
    assert code == 2 and {"tenant_controllers", "nats"} <= modules


def test_lazy_commands_are_listed_with_their_real_help() -> None:
    lazy = lazy_entries(app)
    assert set(lazy) == {"agent", "fleet-monitor", "controller", "eval", "asyncapi", "conformance"}
    for name, entry in lazy.items():
        real = entry.real()
        listed_help = cast(click.Command, entry).help  # every lazy entry is a click command (the mixin is not)
        assert listed_help == real.help, f"{name}: the listing's help differs from the command's own"
    listed = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1"})
    assert listed.exit_code == 0
    for name in lazy:
        assert name in listed.output
    run_help = CliRunner().invoke(app, ["controller", "run", "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert run_help.exit_code == 0 and "--resync-interval" in run_help.output, "the real group parses its commands"


def test_tools_walking_the_command_tree_see_the_real_commands() -> None:
    """What tests/cloud/test_compose.py and completion do: sub-commands, parameters and callbacks are the real ones."""
    lazy = lazy_entries(app)
    assert "run" in lazy["controller"].commands  # type: ignore[attr-defined]
    assert "host_id" in {param.name for param in lazy["agent"].params}
    assert lazy["fleet-monitor"].callback is not None and lazy["fleet-monitor"].callback.__name__ != "_not_loaded"
