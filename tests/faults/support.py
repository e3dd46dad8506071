"""Tools of the fault-injection suite: a seeded broker bouncer, a TCP proxy that can cut a database off, process
helpers, and readers that count what a stream really holds, by CloudEvent id.

Every schedule draws from a seeded RNG (`random.Random(seed)`), so a failing run can be replayed. The soak variant
(`HZ_TEST_FAULTS_SOAK=1`) runs the same tests with more events, more bounces and more seeds (tests/faults/README.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext

from broker_config.server import NatsServer

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "scripts"
SOAK = os.environ.get("HZ_TEST_FAULTS_SOAK", "") not in ("", "0", "false", "no")
"""The long variant: set HZ_TEST_FAULTS_SOAK=1 (see tests/faults/README.md)."""


def scaled(ci: int, soak: int) -> int:
    """`ci` in the normal run, `soak` under HZ_TEST_FAULTS_SOAK."""
    return soak if SOAK else ci


# -- the broker, bounced --------------------------------------------------------------------------------------------


@dataclass
class Bounce:
    at: float
    how: str  # "term" (graceful stop) or "kill" (SIGKILL: what a crash looks like)
    down_s: float


@dataclass
class BrokerBouncer:
    """Restarts a real nats-server (same port, same JetStream store) every `min_s`..`max_s` seconds, drawn from a
    seeded RNG, in a thread of its own so the test's event loop (and an API served in it) keeps running. Each time it
    stays down `down_s` (drawn from the range) before it starts again, as a real restart does."""

    server: NatsServer
    seed: int
    min_s: float = 1.0
    max_s: float = 3.0
    down_s: tuple[float, float] = (0.1, 0.8)
    kill_share: float = 0.5
    bounces: list[Bounce] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    error: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="broker-bouncer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rng = random.Random(self.seed)
        started = time.monotonic()
        try:
            while not self._stop.wait(rng.uniform(self.min_s, self.max_s)):
                how = "kill" if rng.random() < self.kill_share else "term"
                down = time.monotonic()
                self.server.kill() if how == "kill" else self.server.stop()
                time.sleep(rng.uniform(*self.down_s))
                self.server.start()
                self.bounces.append(Bounce(at=down - started, how=how, down_s=time.monotonic() - down))
        except BaseException as exc:  # surfaced by stop(); a bouncer that died silently would prove nothing
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.error is not None:
            raise AssertionError(f"the bouncer failed: {self.error!r}") from self.error
        if not self.server.is_running():
            self.server.start()

    def summary(self) -> str:
        kills = sum(1 for b in self.bounces if b.how == "kill")
        downs = [b.down_s for b in self.bounces] or [0.0]
        return (f"{len(self.bounces)} bounces ({kills} SIGKILL, {len(self.bounces) - kills} SIGTERM), "
                f"down {min(downs):.2f}-{max(downs):.2f} s each")


# -- a TCP proxy whose far side can be cut off ----------------------------------------------------------------------


class TcpProxy:
    """Forwards 127.0.0.1:<port> to an upstream address; `cut()` makes the upstream unreachable at the network level
    (the listener closes, so new connections are refused, and every open connection is reset), `restore()` listens
    again on the same port. This is what a database restart or crash looks like to its clients."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._pumps: set[asyncio.Task[None]] = set()
        self.connections = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self._pairs.add(pair)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst, pair), name="hz-proxy-pump")
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._reset(pair)

    def _reset(self, pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
        if pair in self._pairs:
            self._pairs.discard(pair)
            for writer in pair:
                writer.transport.abort()

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()
        self._server = None
        for pair in list(self._pairs):
            self._reset(pair)

    async def restore(self) -> None:
        await self.start()

    async def close(self) -> None:
        if self._server is not None:
            await self.cut()
        for pair in list(self._pairs):
            self._reset(pair)
        pumps = list(self._pumps)
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


# -- processes ------------------------------------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any HZ_ variable, plus `extra`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("HZ_")}
    return {**base, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **extra}


@dataclass
class Process:
    """A child process with its log; `kill()` is SIGKILL, what a crash looks like."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired as stuck:
            self.proc.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER=1: its threads' stacks go to the log
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
            raise AssertionError(
                f"{self.name} did not stop within {timeout:.0f} s of SIGTERM:\n{self.tail()}"
            ) from stuck

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


# -- what a stream really holds ---------------------------------------------------------------------------------


async def stored_event_ids(provider: Client, stream: str, *, timeout: float = 30.0) -> Counter[str]:
    """CloudEvent id -> how many times the stream stores it, read by the provider with an ephemeral consumer.

    On a cluster that has just elected a leader, a new consumer can answer 503 for a moment: the read then starts
    over, until `timeout`.
    """
    js = provider.jetstream(timeout=10)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await _read_ids(js, stream)
        except (TimeoutError, nats.errors.Error):
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.5)


async def _read_ids(js: JetStreamContext, stream: str) -> Counter[str]:
    total = (await js.stream_info(stream)).state.messages
    config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE)
    sub = await js.pull_subscribe(">", stream=stream, config=config)
    ids: Counter[str] = Counter()
    seen = 0
    try:
        while seen < total:
            batch = await sub.fetch(min(500, total - seen), timeout=5)
            for msg in batch:
                ids[json.loads(msg.data)["id"]] += 1
            seen += len(batch)
    finally:
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            await sub.unsubscribe()
    return ids


def duplicates(counts: Counter[Any]) -> dict[Any, int]:
    """The keys counted more than once, with their counts."""
    return {key: n for key, n in counts.items() if n > 1}


# -- the control-plane API as a process of its own --------------------------------------------------------------


ADMIN_TOKEN = "faults-admin-token-0123456789abcdef"


@dataclass
class ApiService:
    """`harmonaize api serve` in a child process (the way a provider runs it), against `database_url` (empty: SQLite
    in `data_dir`) and the broker `nats`; `kill()` is SIGKILL, `start()` again restarts it on the same port."""

    data_dir: Path
    nats: NatsServer
    provider_secret: bytes
    database_url: str = ""
    port: int = 0
    process: Process | None = None
    starts: int = 0
    replicas: int = 1
    """More than 1: `--replicas N`, N API processes behind the port under one supervisor (`process`)."""
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from broker_config.server import free_port

        self.port = self.port or free_port()
        self.data_dir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return clean_env(
            HZ_DATA_DIR=str(self.data_dir),
            HZ_DATABASE_URL=self.database_url,
            HZ_NATS_URL=self.nats.url,
            HZ_ADMIN_TOKEN=ADMIN_TOKEN,
            HZ_PROVIDER_SECRET=self.provider_secret.decode(),
            HZ_API_HOST="127.0.0.1",
            HZ_API_PORT=str(self.port),
            HZ_BROKER_CONFIG_FILE=str(self.nats.config_file),
            HZ_BROKER_PID_FILE=str(self.nats.pid_file),
            **self.extra_env,
        )

    async def start(self, *, timeout: float = 60.0) -> None:
        import httpx

        self.starts += 1
        self.process = Process(
            f"api-{self.starts}",
            python("-m", "harmonaize_cli", "api", "serve", "--migrate", "--broker-reload", "pid-file",
                   "--log-level", "warning", "--replicas", str(self.replicas)),
            self.env(),
            self.data_dir / f"api-{self.starts}.log",
        ).start()
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(base_url=self.url, timeout=2.0) as client:
            while True:
                if not self.process.alive():
                    raise AssertionError(f"the API exited at start:\n{self.process.tail()}")
                try:
                    if (await client.get("/v1/healthz")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() >= deadline:
                    raise AssertionError(f"the API did not answer within {timeout:.0f} s:\n{self.process.tail()}")
                await asyncio.sleep(0.1)

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()

    async def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, waited for in a thread: the API's graceful shutdown may need this event loop (a proxy to its
        database can live in it). The exit status, or None (its threads' stacks dumped to its log) if it did not
        stop in time."""
        if self.process is None or self.process.proc is None:
            return None
        try:
            return await asyncio.to_thread(self.process.terminate, timeout)
        except AssertionError:
            return None
