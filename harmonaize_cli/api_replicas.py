"""`harmonaize api serve --replicas N`: N API processes behind one address, restarted when one dies.

The parent holds the address (bound, never listening) and gives each replica process (`api serve --listen-fd`) a
listening socket of its own on it (`SO_REUSEPORT`): the kernel hands each new connection to one of them by a hash of
its addresses, so connections spread evenly however they arrive. One socket shared by all would not: every replica
is woken for a new connection and the first one awake accepts all that are waiting, so a burst of keep-alive
connections (a controller's pool, a load balancer's) lands on one replica while the others idle (measured: 30, 2
and 0 of 32). Sockets beside each other rather than a proxy: no extra hop and no extra process in every request's
path, and nothing new to fail. A replica's socket lives as long as the replica: when it dies, new connections go to
the others until its successor listens, and only connections it had not yet accepted are reset. Linux only (elsewhere
`SO_REUSEPORT` does not spread connections, and replicas are refused).

What holds across replicas is the database's work: idempotency keys (the key's row), the capacity ledger (its lock),
the outbox (one relay delivers at a time, `api/services/relay_leadership.py`), the negotiation pace (a shared bucket
on PostgreSQL) and tenant provisioning (serialised by an advisory lock). A replica that dies mid-request loses that
connection; the client's retry with the same Idempotency-Key reaches a live replica and gets the committed answer,
or runs again if nothing was committed. The parent restarts a dead replica after a short pause (doubling while they
keep dying, up to `RESTART_CAP_S`), and on SIGTERM or SIGINT stops them all and exits.

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

__all__ = ["RESTART_CAP_S", "replica_listener", "reserve_address", "supervise"]

FIRST_PAUSE_S = 0.5
RESTART_CAP_S = 5.0
HEALTHY_S = 30.0
"""A replica that ran this long before it died is restarted after the first pause again."""
STOP_GRACE_S = 15.0
POLL_S = 0.2


class _Stop(Exception):
    """SIGTERM or SIGINT reached the parent."""


def _port_sharing_socket(host: str) -> socket.socket:
    if not sys.platform.startswith("linux"):
        raise OSError(f"API replicas need Linux's SO_REUSEPORT, which spreads connections ({sys.platform} has no "
                      "such thing): serve one process")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


def reserve_address(host: str, port: int) -> socket.socket:
    """The replicas' address, held for as long as they are supervised (port 0: a free port): bound but never
    listening, so no connection ever waits on it, and no other program can take the port while a replica restarts.

    OSError (EADDRINUSE) if anything holds the address already, even a port-sharing socket of the same user (another
    cloud's replicas), which `SO_REUSEPORT` alone would let us join: a plain bind is tried first.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
    reserved = _port_sharing_socket(host)
    try:
        reserved.bind((host, port))
    except OSError:
        reserved.close()
        raise
    return reserved


def replica_listener(address: tuple[str, int]) -> socket.socket:
    """One replica's own listening socket on the reserved `address`, inheritable by the process it is made for."""
    listener = _port_sharing_socket(address[0])
    try:
        listener.bind(address)
        listener.listen(2048)
    except OSError:
        listener.close()
        raise
    listener.set_inheritable(True)
    return listener


def _start(replica: int, address: tuple[str, int], args: Sequence[str]) -> subprocess.Popen[bytes]:
    listener = replica_listener(address)
    try:
        command = [sys.executable, "-m", "harmonaize_cli", "api", "serve", *args, "--listen-fd",
                   str(listener.fileno())]
        env = {**os.environ, "HZ_API_REPLICA": str(replica)}
        return subprocess.Popen(command, pass_fds=(listener.fileno(),), env=env, preexec_fn=_end_with_parent)
    finally:
        listener.close()  # the replica's now: the socket closes with it


def _end_with_parent() -> None:
    """In the replica, before it runs: SIGTERM when the supervisor dies, even by SIGKILL (Linux), so no replica is
    left serving an address nobody supervises."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def supervise(reserved: socket.socket, replicas: int, args: Sequence[str]) -> int:
    """Run `replicas` replicas on the address `reserved` holds (`reserve_address`) until SIGTERM/SIGINT; restart any
    that exits. The exit code: 0."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise _Stop

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    procs: dict[int, subprocess.Popen[bytes]] = {}
    pause = {i: FIRST_PAUSE_S for i in range(replicas)}
    started: dict[int, float] = {}
    due: dict[int, float] = {}
    address: tuple[str, int] = reserved.getsockname()[:2]
    host, port = address
    try:
        for i in range(replicas):
            procs[i], started[i] = _start(i, address, args), time.monotonic()
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
                    procs[i], started[i] = _start(i, address, args), now
            time.sleep(POLL_S)  # a supervisor's period: children are polled, not waited on one at a time
    except _Stop:
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop_all(list(procs.values()))
        reserved.close()


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
