"""Finding and stopping a node's processes, including the ones torchrun leaves behind.

torchrun starts its workers in their own sessions with no parent-death signal, so killing a torchrun agent orphans
its workers: they keep training and block every re-rendezvous (docs/building-blocks.md, torchrun trap 3). A node is
therefore identified not by a process tree but by a marker in its environment (`ENV_NODE_MARKER`), which every worker
inherits; stopping a node means signalling every process that carries its marker. Markers begin with their cloud's
id (`markers`), so a signal by marker or host prefix never reaches another cloud's processes. Linux `/proc` only (the
provider's hosts are Linux).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from harmonaize.job_runtime import ENV_NODE_MARKER

__all__ = ["alive", "marked_processes", "signal_marked"]

_PROC = Path("/proc")


def _environ(pid: int) -> bytes:
    try:
        return (_PROC / str(pid) / "environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError, OSError):
        return b""


def marked_processes(marker: str, *, prefix: bool = False) -> list[int]:
    """Pids of live processes whose `ENV_NODE_MARKER` equals `marker` (or starts with it, with `prefix`)."""
    if not marker:
        raise ValueError("an empty marker would match every node of every cloud on this machine")
    wanted = f"{ENV_NODE_MARKER}={marker}".encode()
    found = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        for item in _environ(pid).split(b"\0"):
            if item == wanted or (prefix and item.startswith(wanted)):
                if alive(pid):
                    found.append(pid)
                break
    return sorted(found)


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, OSError):
        return False
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state not in ("Z", "X")


def signal_marked(marker: str, sig: signal.Signals, *, prefix: bool = False) -> list[int]:
    """Send `sig` to every process carrying the marker; returns the pids signalled."""
    signalled = []
    for pid in marked_processes(marker, prefix=prefix):
        try:
            os.kill(pid, sig)
            signalled.append(pid)
        except ProcessLookupError:
            pass
    return signalled


def stopped(pid: int) -> bool:
    """The process is stopped by a signal (SIGSTOP, SIGTSTP: state `T` in /proc/<pid>/stat): none of its threads run.

    Its own host sees this at once, where a missing liveness beat takes several beat intervals to tell apart from a
    busy machine. A ptrace stop (`t`, a debugger) is not counted.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # the command name is in parentheses and may itself contain spaces or parentheses: the state follows the last ')'
    return stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] == "T"
