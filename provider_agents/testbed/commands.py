"""Runs the kernel's network tools (`ip`, `tc`) for the testbed; a failure names the command and what it said."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

__all__ = ["TestbedError", "run"]

COMMAND_TIMEOUT_S = 30.0


class TestbedError(RuntimeError):
    """An `ip` or `tc` command failed; the message names it and the kernel's words."""


def run(command: Sequence[str], *, check: bool = True) -> str:
    """Run `command`; its stdout. `check`: raise `TestbedError` on a non-zero exit (else return what it printed)."""
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestbedError(f"`{' '.join(command)}` could not run: {exc}") from exc
    if check and done.returncode != 0:
        raise TestbedError(f"`{' '.join(command)}` failed: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout
