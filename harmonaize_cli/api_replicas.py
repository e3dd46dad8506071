"""`harmonaize api serve --replicas N`: N API processes behind one address, restarted when one dies.

The parent binds the listening socket once and starts N replica processes (`api serve --listen-fd`) that all accept
on it; the kernel spreads connections among them. Processes sharing a socket rather than a proxy: no extra hop and
no extra process in every request's path, and nothing new to fail. What holds across replicas is the database's
work: idempotency keys (the key's row), the capacity ledger (its lock), the outbox (one relay delivers at a time,
`api/services/relay_leadership.py`), the negotiation pace (a shared bucket on PostgreSQL) and tenant provisioning
(serialised by an advisory lock). A replica that dies mid-request loses that connection; the client's retry with
the same Idempotency-Key reaches a live replica and gets the committed answer, or runs again if nothing was
committed. The parent restarts a dead replica after a short pause (doubling while they keep dying, up to
`RESTART_CAP_S`), and on SIGTERM or SIGINT stops them all and exits.

Replicas share one database: SQLite has one writer, so several replicas on it only queue behind each other;
`--replicas` is for PostgreSQL (`HZ_DATABASE_URL`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

import typer

__all__ = ["RESTART_CAP_S", "bind_listener", "supervise"]

FIRST_PAUSE_S = 0.5
RESTART_CAP_S = 5.0
HEALTHY_S = 30.0
"""A replica that ran this long before it died is restarted after the first pause again."""
STOP_GRACE_S = 15.0
POLL_S = 0.2


class _Stop(Exception):
    """SIGTERM or SIGINT reached the parent."""


def bind_listener(host: str, port: int) -> socket.socket:
    """The one listening socket every replica accepts on (port 0: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(2048)
    listener.set_inheritable(True)
    return listener


def _start(replica: int, listener: socket.socket, args: Sequence[str]) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "harmonaize_cli", "api", "serve", *args, "--listen-fd", str(listener.fileno())]
    env = {**os.environ, "HZ_API_REPLICA": str(replica)}
    return subprocess.Popen(command, pass_fds=(listener.fileno(),), env=env, preexec_fn=_end_with_parent)


def _end_with_parent() -> None:
    """In the replica, before it runs: SIGTERM when the supervisor dies, even by SIGKILL (Linux), so no replica is
    left serving an address nobody supervises."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def supervise(listener: socket.socket, replicas: int, args: Sequence[str]) -> int:
    """Run `replicas` replicas on `listener` until SIGTERM/SIGINT; restart any that exits. The exit code: 0."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise _Stop

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    procs: dict[int, subprocess.Popen[bytes]] = {}
    pause = {i: FIRST_PAUSE_S for i in range(replicas)}
    started: dict[int, float] = {}
    due: dict[int, float] = {}
    host, port = listener.getsockname()[:2]
    try:
        for i in range(replicas):
            procs[i], started[i] = _start(i, listener, args), time.monotonic()
        typer.echo(f"harmonaize api: {replicas} replicas serving on {host}:{port} (pids "
                   f"{', '.join(str(p.pid) for p in procs.values())})", err=True)
        while True:
            now = time.monotonic()
            for i, proc in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                del procs[i]
                if now - started[i] > HEALTHY_S:
                    pause[i] = FIRST_PAUSE_S
                due[i] = now + pause[i]
                typer.echo(f"harmonaize api: replica {i} (pid {proc.pid}) exited with {code}; restarting in "
                           f"{pause[i]:.1f} s", err=True)
                pause[i] = min(pause[i] * 2, RESTART_CAP_S)
            for i, at in list(due.items()):
                if now >= at:
                    del due[i]
                    procs[i], started[i] = _start(i, listener, args), now
            time.sleep(POLL_S)  # a supervisor's period: children are polled, not waited on one at a time
    except _Stop:
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop_all(list(procs.values()))
        listener.close()


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
