"""`pip install harmonaize` is a tenant's install: the wheel, built from this tree and installed with its base
dependencies only into a fresh virtualenv, has no PyTorch, FastAPI or SQLAlchemy, and the README's first controller
runs from it against a running local cloud (started from the test's own, full install, as a provider would).

The tenant's shell has the fresh virtualenv first on its PATH and types the README's first-controller blocks as
written, except the failure injection, which is the provider's: `harmonaize scenario run` comes from the full install.
A provider command run from the base install is refused in one line naming the extra to install.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cloud.test_readme_flow import Output, _client, _eventually, _stop, readme_blocks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
PROVIDER_OR_TRAINING = ("torch", "numpy", "fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "aiosqlite",
                        "asyncpg", "yaml", "prometheus_client")
"""Top-level modules of the `[provider]` and `[workloads]` extras: none may be importable from the base install."""


def _run(args: list[str], *, timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run a set-up step; its output, or a failure that shows it."""
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    shown = f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
    assert done.returncode == 0, f"{shlex.join(args)}: exit {done.returncode}\n{shown}"
    return done.stdout


def _clean_env(*, path_first: Path) -> dict[str, str]:
    """The environment of a shell a person opens: no HZ_ variables, no PYTHONPATH into this checkout, `path_first`
    (a virtualenv's bin) first on the PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HZ_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{path_first}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with the wheel of this tree installed, base dependencies only; its bin directory."""
    work = tmp_path_factory.mktemp("base-install")
    source = work / "src"
    source.mkdir()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    env = _clean_env(path_first=Path(sys.executable).parent)
    # The build backend of this install (setuptools), not a download: the wheel is what is tested, not its build.
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(work / "dist"),
          str(source)], timeout=180, env=env)
    (wheel,) = (work / "dist").glob("harmonaize-*.whl")
    _run([sys.executable, "-m", "venv", str(work / "venv")], timeout=120, env=env)
    bin_dir = work / "venv" / "bin"
    _run([str(bin_dir / "python"), "-m", "pip", "install", "-q", str(wheel)], timeout=600, env=env)
    return bin_dir


def test_the_base_install_has_no_provider_or_training_stack(base_venv: Path) -> None:
    probe = (
        "import importlib.util, json, harmonaize, tenant_controllers\n"
        f"found = [m for m in {PROVIDER_OR_TRAINING!r} if importlib.util.find_spec(m)]\n"
        "print(json.dumps([harmonaize.__file__, found]))"
    )
    out = _run([str(base_venv / "python"), "-c", probe], timeout=60, cwd=base_venv.parent,
               env=_clean_env(path_first=base_venv))
    location, importable = json.loads(out)
    assert Path(location).is_relative_to(base_venv.parent), f"harmonaize came from {location}, not the base install"
    assert importable == [], f"the base install can import {importable}"


@pytest.mark.parametrize(
    ("command", "extra"),
    [(["up"], "all"), (["demo"], "all"), (["agent"], "provider"), (["db", "upgrade"], "provider"),
     (["scenario", "run", "failure.yaml"], "provider")],
)
def test_a_provider_command_names_the_extra_it_needs(base_venv: Path, tmp_path: Path, command: list[str],
                                                     extra: str) -> None:
    (tmp_path / "failure.yaml").write_text("version: 1\n")
    done = subprocess.run([str(base_venv / "harmonaize"), *command], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env=_clean_env(path_first=base_venv))
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pip install 'harmonaize[{extra}]'" in lines[0], done.stderr


@pytest.fixture
def provider_cloud(tmp_path: Path) -> Iterator[Path]:
    """`harmonaize up` from the full install, its data dir the `.hz` of the folder the tenant works in."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "harmonaize_cli", "up", "--data-dir", str(tmp_path / ".hz"), "--api-port", "0"],
        cwd=tmp_path, env=_clean_env(path_first=Path(sys.executable).parent), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    output = Output(proc)
    try:
        output.wait_for("data dir", timeout=120, proc=proc, what="the local cloud to come up")
        yield tmp_path
    finally:
        _stop(proc, signal.SIGINT)
    assert "Traceback" not in output.text(), output.text()[-6000:]


def test_the_readme_first_controller_runs_from_the_base_install(base_venv: Path, provider_cloud: Path) -> None:
    folder = provider_cloud
    blocks = readme_blocks()
    assert [lang for lang, _ in blocks] == ["bash", "python", "bash", "bash"], blocks
    (_, submit), (_, controller), (_, react), (_, history) = blocks
    assert "harmonaize scenario run" in react, "the README injects the failure with `harmonaize scenario run`"
    provider_inject = react.replace("harmonaize scenario run", f"{shlex.quote(sys.executable)} -m harmonaize_cli "
                                                               "scenario run")
    (folder / "my_controller.py").write_text(controller)

    shell = subprocess.Popen(
        ["bash", "--norc", "--noprofile"], cwd=folder, env=_clean_env(path_first=base_venv), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    output = Output(shell)

    def type_in(block: str, marker: str, *, timeout: float) -> str:
        assert shell.stdin is not None
        before = len(output.text())
        shell.stdin.write(block + f"\necho {marker} $?\n")
        shell.stdin.flush()
        output.wait_for(marker, timeout=timeout, proc=shell, what=f"the README block ending in {marker}")
        return output.text()[before:]

    admin = _client(folder, "admin.env", "HZ_ADMIN_TOKEN")
    tenant = _client(folder, "tenant-demo.env", "HZ_TENANT_TOKEN")
    try:
        which = type_in("command -v harmonaize", "__WHICH__", timeout=10)
        assert str(base_venv / "harmonaize") in which, f"the tenant's shell runs another harmonaize:\n{which}"

        created = type_in(submit, "__SUBMITTED__", timeout=90)
        assert "__SUBMITTED__ 0" in created and '"id":"my-job"' in created.replace(" ", ""), created
        hosts = admin.get("/v1/allocations", params={"tenant_id": "demo", "job_id": "my-job"})
        assert hosts.status_code == 200 and "h1" in {a["host_id"] for a in hosts.json()}, hosts.text

        injected = type_in(provider_inject, "__INJECTED__", timeout=120)
        assert "__INJECTED__ 0" in injected and "injected failure.yaml" in injected, injected

        def accepted() -> dict[str, Any] | None:
            page = tenant.get("/v1/negotiations", params={"job": "my-job"})
            items = page.json().get("items", []) if page.status_code == 200 else []
            return next((item for item in items if item["state"] == "accepted"), None)

        negotiation = _eventually(accepted, timeout=180, what="the base install's controller to negotiate and accept")
        _eventually(lambda: re.search(r"\sfailure\s+my-job\s", output.text()), timeout=30,
                    what="`harmonaize events tail --kind failure` to show the failure")

        shown = type_in(history.replace("<id>", str(negotiation["id"])), "__HISTORY__", timeout=60)
        assert "__HISTORY__ 0" in shown and str(negotiation["id"]) in shown, shown[-4000:]
    finally:
        admin.close()
        tenant.close()
        if shell.stdin is not None:
            shell.stdin.close()
        _stop(shell, signal.SIGTERM)
    assert "Traceback" not in output.text(), output.text()[-6000:]
