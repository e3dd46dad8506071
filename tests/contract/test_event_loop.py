"""Every process runs on the loop `HZ_EVENT_LOOP` names (harmonaize.event_loop): uvloop by default where installed.

"Not installed" is made real for a test the way Python itself blocks an import: `sys.modules["uvloop"] = None`.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from harmonaize.event_loop import EventLoopUnavailableError, resolve_event_loop, run, running_loop_name
from harmonaize.settings import Settings

uvloop_supported = pytest.mark.skipif(
    sys.platform == "win32" or platform.python_implementation() != "CPython",
    reason="uvloop is a dependency only on CPython outside Windows (pyproject.toml)",
)


async def _loop_seen() -> tuple[str, str]:
    loop = asyncio.get_running_loop()
    return type(loop).__module__, running_loop_name()


@pytest.fixture
def without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)


@uvloop_supported
def test_uvloop_is_installed_with_the_project_and_auto_picks_it() -> None:
    assert resolve_event_loop("auto") == "uvloop", "uvloop is a dependency on this platform (pyproject.toml)"
    module, name = run(_loop_seen())
    assert module.startswith("uvloop") and name == "uvloop"


def test_asyncio_runs_asyncio_s_own_loop_even_where_uvloop_is_installed() -> None:
    module, name = run(_loop_seen(), choice="asyncio")
    assert module.startswith("asyncio") and name == "asyncio"


def test_auto_falls_back_to_asyncio_where_uvloop_is_missing(without_uvloop: None) -> None:
    assert resolve_event_loop("auto") == "asyncio"
    assert run(_loop_seen())[1] == "asyncio"


def test_asking_for_uvloop_where_it_is_missing_says_so_and_runs_nothing(without_uvloop: None) -> None:
    started = []

    async def main() -> None:
        started.append(True)

    coroutine = main()
    with pytest.raises(EventLoopUnavailableError, match="uvloop is not installed"):
        run(coroutine, choice="uvloop")
    assert inspect.getcoroutinestate(coroutine) == inspect.CORO_CLOSED, "the coroutine is closed, not left pending"
    assert not started


def test_an_unknown_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown event loop 'trio'"):
        resolve_event_loop("trio")


def test_settings_refuse_a_loop_that_cannot_run_here(without_uvloop: None) -> None:
    with pytest.raises(ValidationError) as raised:
        Settings(_env_file=None, event_loop="uvloop")
    [error] = raised.value.errors()
    assert error["loc"] == ("event_loop",) and "uvloop is not installed" in error["msg"]
    assert Settings(_env_file=None, event_loop="auto").event_loop == "auto", "auto always resolves"


def test_a_bad_value_is_one_line_naming_the_variable(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HZ_")}
    env["HZ_EVENT_LOOP"] = "fastest"
    script = tmp_path / "ctl.py"
    script.write_text("from tenant_controllers import Controller\nctl = Controller(tenant='acme', job='j1')\n")
    result = subprocess.run(
        [sys.executable, "-m", "tenant_controllers.cli", "run", str(script)],
        env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "harmonaize controller: bad configuration: HZ_EVENT_LOOP: Input should be 'auto', 'uvloop' or 'asyncio'"
    ]



@pytest.mark.parametrize("setting", [None, "asyncio"])
def test_the_controller_runs_on_the_loop_the_setting_names(tmp_path: Path, setting: str | None) -> None:
    """`harmonaize controller run` logs the loop it runs on before it connects (nothing listens at these URLs)."""
    expected = resolve_event_loop(setting or "auto")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HZ_")}
    env.update(HZ_TENANT="acme", HZ_TENANT_TOKEN="token", HZ_TENANT_NATS_SEED="SUAEXAMPLE",
               HZ_NATS_URL="nats://127.0.0.1:1", HZ_API_URL="http://127.0.0.1:1")
    if setting is not None:
        env["HZ_EVENT_LOOP"] = setting
    script = tmp_path / "ctl.py"
    script.write_text("from tenant_controllers import Controller\nctl = Controller(tenant='acme', job='j1')\n")
    log = tmp_path / "controller.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tenant_controllers.cli", "run", str(script)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while "event loop:" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"event loop: {expected}" in log.read_text(), log.read_text()
    finally:
        proc.kill()
        proc.wait(timeout=30)
