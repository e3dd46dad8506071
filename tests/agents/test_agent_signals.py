"""An agent that stops hands SIGTERM/SIGINT back: on uvloop a handler left installed outlives its loop and swallows
every later signal (asyncio's loop restores the defaults itself when it closes; uvloop's does not)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harmonaize.event_loop import resolve_event_loop

PROBE = """
import signal, sys
from harmonaize import event_loop
from provider_agents.runtime import _default_signals, _stop_on_signals

async def agent_lifetime():
    _stop_on_signals(lambda: None)
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None), "installed while running"
    _default_signals()

event_loop.run(agent_lifetime(), choice=sys.argv[1])
print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_signals_are_the_defaults_again_once_the_agent_has_stopped(loop: str) -> None:
    if loop == "uvloop" and resolve_event_loop("auto") != "uvloop":
        pytest.skip("uvloop is not installed on this platform")
    result = subprocess.run([sys.executable, "-c", PROBE, loop], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]
