#!/usr/bin/env python
"""API benchmark: the control plane's hot endpoints against a bare FastAPI + SQLAlchemy app, in one run.

Two uvicorn servers, each in its own subprocess on a free loopback port (one worker; the event loop `HZ_EVENT_LOOP`
names, as for the shipped API: uvloop where installed; uvicorn's default HTTP implementation; no access log), loaded
from this process at a fixed concurrency, one keep-alive connection per concurrent request: `httpx.AsyncClient`s by
default, or `--client raw`, a minimal HTTP/1.1 client that needs ~10x less CPU (on 2 cores an httpx load generator
takes CPU the server would otherwise get; see the CPU column):

* ours      `api.app.create_app(settings, broker=<in-memory broker>)` on a fresh SQLite database migrated with
            `api.migrate.upgrade_async` (so: WAL, synchronous=NORMAL, one pooled connection, as api/db.py makes it).
            Scenarios: `GET /v1/jobs/{id}` (a tenant's authenticated read: token lookup + job read),
            `POST /v1/jobs` (validate + insert + commit), `POST /v1/allocations` (admin; the capacity ledger's
            conditional UPDATE + allocation insert + commit; hosts are sized so it never runs out, and grants and
            409 refusals are counted separately; requests cycle over `--alloc-jobs` jobs so no per-job cap is hit).
* baseline  a bare FastAPI app written here with `GET /ping`, `GET /rows/{id}` (one primary-key read) and
            `POST /rows` (insert one row and commit, SQLAlchemy async ORM), on its own SQLite file with the
            pragmas and pool api/db.py used when this was written (WAL, synchronous=NORMAL, busy_timeout, a pool of
            one connection) and nothing else: whatever api/db.py adds later counts as our cost.

Every round runs every scenario once, rotating their order; req/s are medians over rounds and their ratios medians
of the per-round ratios, latency percentiles are over all rounds' samples. Ratios compare each of our endpoints with
the baseline doing the nearest amount of database work. `--postgres [URL]` repeats everything on a fresh PostgreSQL
database (`hz_bench_<random>`, dropped afterwards); both apps then use a pool of 16 connections (api/db.py's
POSTGRES_POOL_SIZE).

Run from the repository root: `python bench/bench_api.py` (~60 s), `--quick` (~10 s), `--help` for sizes.
No timed assertions: it prints figures. Every loop is bounded in count and in time; only loopback addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.metadata
import importlib.util
import itertools
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _benchutil import (
    Deadline,
    clean_nan,
    ensure_repo_on_path,
    event_loop_choice,
    fmt,
    git_state,
    loadavg,
    machine_busy_seconds,
    machine_line,
    median,
    package_version,
    percentile,
    proc_cpu_seconds,
    ratio,
    table,
    write_json,
)
from _cpu_quota import CpuQuota

ensure_repo_on_path()

if importlib.util.find_spec("sniffio") is None:
    # httpcore (under httpx) runs `import sniffio` on every lock it creates, several per request; when sniffio is not
    # installed each attempt is a failed import that walks sys.path (~0.5 ms). Recording the absence once makes the
    # import fail at once, as it would with sniffio present and asyncio running. Load generator only: the servers are
    # other processes.
    sys.modules["sniffio"] = None  # type: ignore[assignment]

import httpx  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from sqlalchemy import DateTime, Integer, String  # noqa: E402
from sqlalchemy.orm import DeclarativeBase, mapped_column  # noqa: E402

HOST = "127.0.0.1"
ADMIN_TOKEN = "bench-admin-token-0123456789abcdef"
PROVIDER_SECRET = "bench-provider-secret-0123456789abcdef"
DEFAULT_POSTGRES_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
POSTGRES_POOL_SIZE = 16  # api/db.py's value; the baseline uses the same
HOST_GPUS = 4096  # api/schemas.py MAX_GPUS
MAX_WORKERS = 4096  # api/schemas.py MAX_WORKERS
CLIENT_BOUND_CPU = 0.9  # load generator CPU (cores) above which a figure is marked as bounded by the client


# ====================================================================================================================
# server side (runs in the subprocesses: `bench_api.py --serve ours|baseline ...`)


class BenchBroker:
    """A minimal in-memory `TenantBroker`: real nkeys, remembers the tenant list; no NATS traffic (the API alone)."""

    def __init__(self) -> None:
        self.tenants: list[Any] = []

    def new_user_keys(self) -> Any:
        import nkeys

        from broker_config.accounts import UserKeys

        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        public = nkeys.from_seed(bytearray(seed)).public_key
        return UserKeys(public_key=public.decode(), seed=seed.decode())

    async def apply(self, tenants: Sequence[Any]) -> None:
        self.tenants = list(tenants)

    def credentials(self, tenant: str, keys: Any) -> Any:
        from broker_config.accounts import TenantNatsCredentials
        from harmonaize.subjects import tenant_subject_prefix

        return TenantNatsCredentials(
            servers=["nats://127.0.0.1:4222"], account=f"T_{tenant}", user_public_key=keys.public_key, seed=keys.seed,
            stream=f"HZ_T_{tenant}", js_api_prefix="$JS.hz.API", subject_prefix=tenant_subject_prefix(tenant),
        )

    async def ensure_consumer(
        self, tenant: str, name: str, *, filter_subjects: Sequence[str] = (), ack_wait_s: float = 30.0,
        position: str = "broker", start_after: int | None = None, stream_created: str | None = None,
    ) -> Any:
        from broker_config.accounts import EventConsumer

        return EventConsumer(name=name, stream=f"HZ_T_{tenant}", js_api_prefix="$JS.hz.API",
                             filter_subjects=list(filter_subjects), ack_wait_s=ack_wait_s,
                             position=position)  # type: ignore[arg-type]


def ours_settings(data_dir: Path, database_url: str) -> Any:
    from harmonaize.settings import Settings

    # negotiation_rate_per_s=0: the per-tenant rate limit would refuse a benchmark's load (its check still runs)
    return Settings(_env_file=None, data_dir=data_dir, database_url=database_url, admin_token=ADMIN_TOKEN,
                    provider_secret=PROVIDER_SECRET, negotiation_rate_per_s=0)


def build_ours(data_dir: Path, database_url: str) -> Any:
    from api.app import create_app

    return create_app(ours_settings(data_dir, database_url), broker=BenchBroker())


class _BaselineBase(DeclarativeBase):
    pass


class BaselineRow(_BaselineBase):
    # No `Mapped[...]` annotations: under `from __future__ import annotations` SQLAlchemy resolves them by module
    # name, which fails when this file runs as __main__ under another runner (cProfile, runpy).
    __tablename__ = "bench_rows"
    id = mapped_column(Integer, primary_key=True, autoincrement=True)
    name = mapped_column(String(200), nullable=False)
    created_at = mapped_column(DateTime(timezone=True), nullable=False)


class RowIn(BaseModel):
    name: str


class RowOut(BaseModel):
    id: int
    name: str
    created_at: dt.datetime


def build_baseline(data_dir: Path, database_url: str) -> Any:
    """Bare FastAPI + SQLAlchemy 2 async: ping, a primary-key read, and insert-one-row-and-commit."""
    from fastapi import FastAPI, HTTPException
    from sqlalchemy import event
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    Base, Row = _BaselineBase, BaselineRow
    url = database_url or f"sqlite+aiosqlite:///{(data_dir / 'baseline.db').as_posix()}"
    if url.startswith("sqlite"):
        engine = create_async_engine(url, pool_size=1, max_overflow=0, pool_timeout=60)

        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA busy_timeout = 5000")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.close()
    else:
        engine = create_async_engine(url, pool_size=POSTGRES_POOL_SIZE, max_overflow=0, pool_pre_ping=True)
    sessions = async_sessionmaker(engine, expire_on_commit=False)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with engine.begin() as conn:
            if engine.dialect.name == "postgresql":  # replicas start at once: one creates the table, the rest see it
                await conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7235)")
            await conn.run_sync(Base.metadata.create_all)
        yield
        await engine.dispose()

    app = FastAPI(lifespan=lifespan)

    @app.get("/ping")
    async def ping() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/rows", status_code=201)
    async def insert(body: RowIn) -> RowOut:
        async with sessions() as session:
            row = Row(name=body.name, created_at=dt.datetime.now(dt.UTC))
            session.add(row)
            await session.commit()
            return RowOut(id=row.id, name=row.name, created_at=row.created_at)

    @app.get("/rows/{row_id}")
    async def read(row_id: int) -> RowOut:
        async with sessions() as session:
            row = await session.get(Row, row_id)
            if row is None:
                raise HTTPException(404, "no such row")
            return RowOut(id=row.id, name=row.name, created_at=row.created_at)

    return app


def _exit_with_parent() -> None:
    """A server subprocess never outlives the benchmark that started it (even if that one is killed)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def serve(kind: str, port: int, data_dir: Path, database_url: str, fd: int | None = None) -> int:
    import uvicorn

    _exit_with_parent()
    app = build_ours(data_dir, database_url) if kind == "ours" else build_baseline(data_dir, database_url)
    # Keep-alive longer than uvicorn's 5 s default: a connection sits idle while the other scenarios of a round run.
    # `fd`: this replica's own listening socket on the replicas' address, made by the parent, handed to uvicorn as a
    # socket object of its real family (as `harmonaize api serve --replicas` does): uvicorn's own `fd=` wraps it as
    # AF_UNIX, so the loop leaves TCP_NODELAY off on its connections and Nagle's algorithm holds every response ~40 ms.
    config = uvicorn.Config(app, host=HOST, port=port, log_level="warning", access_log=False, lifespan="on",
                            timeout_keep_alive=120, loop=event_loop_choice())
    sockets = None if fd is None else [socket.socket(fileno=fd)]
    if kind == "ours":
        from harmonaize.heap import freeze_startup_heap

        freeze_startup_heap()  # as `harmonaize api serve` does once started
    uvicorn.Server(config).run(sockets=sockets)
    return 0


# ====================================================================================================================
# load side (this process)


class ServerProcess:
    """One server subprocess, or with `replicas` > 1 that many, each listening on a socket of its own on one address
    held here, as `harmonaize api serve --replicas N` runs them (`harmonaize_cli.api_replicas`): the kernel spreads the
    load's connections among them by a hash of their addresses."""

    def __init__(self, kind: str, data_dir: Path, database_url: str, *, replicas: int = 1,
                 cpu_limit: float | None = None) -> None:
        from broker_config.server import free_port  # loopback free-port helper

        self.kind = kind
        self.port = free_port(HOST)
        self.data_dir = data_dir
        self.database_url = database_url
        self.replicas = replicas
        self.log = data_dir / f"{kind}-server.log"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.reserved: socket.socket | None = None
        self.cpu_limit = cpu_limit  # cores per process (`_cpu_quota`), or None: as much as the machine gives
        self.quotas: list[CpuQuota] = []

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve", self.kind, "--port", str(self.port),
                "--data-dir", str(self.data_dir), "--database-url", self.database_url]
        from harmonaize_cli.api_replicas import replica_listener, reserve_address

        if self.replicas > 1:
            self.reserved = reserve_address(HOST, self.port)
        with open(self.log, "ab") as log:
            for i in range(self.replicas):
                quota = None if self.cpu_limit is None else CpuQuota(f"{self.kind}-{i}", self.cpu_limit)
                if quota is not None:
                    self.quotas.append(quota)
                listener = None if self.reserved is None else replica_listener((HOST, self.port))
                try:
                    self.procs.append(subprocess.Popen(
                        argv + ([] if listener is None else ["--fd", str(listener.fileno())]), stdout=log,
                        stderr=subprocess.STDOUT, cwd=str(Path(__file__).resolve().parent.parent),
                        pass_fds=() if listener is None else (listener.fileno(),),
                    ))
                finally:
                    if listener is not None:
                        listener.close()  # the replica's now
                if quota is not None:  # still importing: held from (almost) its first instruction
                    quota.add(self.procs[-1].pid)

    async def wait_ready(self, path: str, timeout: float = 30.0) -> None:
        deadline = Deadline(timeout)
        ready = 0
        async with httpx.AsyncClient(base_url=self.url, timeout=2.0) as client:
            while not deadline.expired:
                if any(proc.poll() is not None for proc in self.procs):
                    raise RuntimeError(f"{self.kind} server exited at start: {self.tail_log()}")
                try:
                    # several answers in a row, so a replica still starting is not the only one counted
                    ready = ready + 1 if (await client.get(path)).status_code == 200 else 0
                    if ready >= 3 * self.replicas:
                        return
                except httpx.HTTPError:
                    ready = 0
                await asyncio.sleep(0.05)
        raise RuntimeError(f"{self.kind} server not ready within {timeout:.0f} s: {self.tail_log()}")

    def tail_log(self) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-5:])
        except OSError:
            return "no log"

    def throttled_seconds(self) -> float:
        """Seconds the processes were held back by their CPU quotas so far (0 without quotas)."""
        return sum(quota.throttled_s() for quota in self.quotas)

    def cpu_seconds(self) -> float:
        """user + system CPU time of the server processes so far (Linux /proc), NaN where unavailable."""
        return sum(proc_cpu_seconds(proc.pid) for proc in self.procs) if self.procs else math.nan

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        for quota in self.quotas:
            quota.release()
        self.quotas = []
        if self.reserved is not None:
            self.reserved.close()
            self.reserved = None


RequestFactory = Callable[[int], tuple[str, str, Any, dict[str, str] | None]]


@dataclass
class Scenario:
    key: str
    side: str  # "ours" | "baseline"
    label: str
    make: RequestFactory
    results: list[dict[str, Any]] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)


class RawHttpConnection:
    """A minimal HTTP/1.1 keep-alive client on one connection: for `--client raw`, a load generator ~10x lighter
    than httpx, so the server (not the client) bounds the figures on a 2-core machine. Content-Length bodies only,
    which is all uvicorn sends for these JSON endpoints."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.last_body = b""
        """The body of the last response (bench_negotiations.py reads ids out of it)."""

    async def request(self, method: str, path: str, body: Any, headers: dict[str, str] | None) -> int:
        import json as _json

        payload = b"" if body is None else _json.dumps(body).encode()
        head = [f"{method} {path} HTTP/1.1", f"host: {HOST}:{self.port}", f"content-length: {len(payload)}"]
        if body is not None:
            head.append("content-type: application/json")
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        message = ("\r\n".join(head) + "\r\n\r\n").encode() + payload
        reused = self.writer is not None
        try:
            return await self._exchange(message)
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as exc:
            # A kept-alive connection the server closed while idle (nothing of the response came back): reconnect
            # and send once more, as HTTP clients do. Anything else is counted as an error by the caller.
            stale = isinstance(exc, asyncio.IncompleteReadError) and not exc.partial
            if reused and (stale or not isinstance(exc, asyncio.IncompleteReadError)):
                return await self._exchange(message)
            raise

    async def _exchange(self, message: bytes) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(HOST, self.port)
        assert self.reader is not None
        try:
            self.writer.write(message)
            raw = await self.reader.readuntil(b"\r\n\r\n")
            lines = raw.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            length, close = 0, False
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "connection" and value.strip().lower() == "close":
                    close = True
                elif name == "transfer-encoding":
                    raise RuntimeError("raw client: chunked responses are not supported")
            self.last_body = await self.reader.readexactly(length)
        except BaseException:
            await self.close()
            raise
        if close:
            await self.close()
        return status

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await asyncio.wait_for(self.writer.wait_closed(), 2)
            except Exception:
                pass
        self.reader = self.writer = None


class LoadClients:
    """`concurrency` independent connections to one server, one per worker.

    httpx: one `httpx.AsyncClient` per worker (pool of one connection). A single AsyncClient with a 32-connection
    pool spends its time in httpcore's pool bookkeeping (it rescans every connection for every request): measured
    here ~100 req/s against `GET /ping` at concurrency 32, so it would benchmark httpx rather than the server.
    """

    def __init__(self, server: ServerProcess, concurrency: int, kind: str) -> None:
        self.kind = kind
        if kind == "httpx":
            limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
            self.httpx = [httpx.AsyncClient(base_url=server.url, limits=limits, timeout=httpx.Timeout(30.0))
                          for _ in range(concurrency)]
        else:
            self.raw = [RawHttpConnection(server.port) for _ in range(concurrency)]

    def sender(self, worker: int) -> Callable[[str, str, Any, dict[str, str] | None], Any]:
        if self.kind == "httpx":
            client = self.httpx[worker]

            async def send_httpx(method: str, path: str, body: Any, headers: dict[str, str] | None) -> int:
                response = await client.request(method, path, json=body, headers=headers)
                return response.status_code

            return send_httpx
        return self.raw[worker].request

    def body_sender(self, worker: int) -> Callable[[str, str, Any, dict[str, str] | None], Any]:
        """Like `sender`, but the coroutine returns (status, response body bytes)."""
        if self.kind == "httpx":
            client = self.httpx[worker]

            async def send_httpx(method: str, path: str, body: Any,
                                 headers: dict[str, str] | None) -> tuple[int, bytes]:
                response = await client.request(method, path, json=body, headers=headers)
                return response.status_code, response.content

            return send_httpx
        connection = self.raw[worker]

        async def send_raw(method: str, path: str, body: Any, headers: dict[str, str] | None) -> tuple[int, bytes]:
            status = await connection.request(method, path, body, headers)
            return status, connection.last_body

        return send_raw

    async def aclose(self) -> None:
        for c in getattr(self, "httpx", []):
            await c.aclose()
        for r in getattr(self, "raw", []):
            await r.close()


async def run_load(clients: LoadClients, make: RequestFactory, n: int, concurrency: int, cap_s: float,
                   server: ServerProcess) -> dict[str, Any]:
    """`n` requests from `concurrency` workers over keep-alive connections, or fewer if `cap_s` runs out."""
    counter = itertools.count()
    deadline = Deadline(cap_s)
    latencies: list[float] = []
    statuses: Counter[str] = Counter()

    async def worker(index: int) -> None:
        send = clients.sender(index)
        while True:
            i = next(counter)
            if i >= n or deadline.expired:
                return
            method, path, body, headers = make(i)
            t0 = time.perf_counter()
            try:
                status = await asyncio.wait_for(send(method, path, body, headers), 30)
            except (TimeoutError, httpx.HTTPError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
                statuses[type(exc).__name__] += 1
                continue
            latencies.append(time.perf_counter() - t0)
            statuses[str(status)] += 1

    cpu0, own0, busy0 = server.cpu_seconds(), time.process_time(), machine_busy_seconds()
    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - start
    cpu1, own1, busy1 = server.cpu_seconds(), time.process_time(), machine_busy_seconds()
    done = len(latencies)
    return {
        "n": done,
        "elapsed_s": elapsed,
        "rate": done / elapsed if elapsed else 0.0,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "server_cpu": (cpu1 - cpu0) / elapsed if elapsed else math.nan,
        "client_cpu": (own1 - own0) / elapsed if elapsed else math.nan,
        "machine_cpu": (busy1 - busy0) / elapsed if elapsed else math.nan,
        "statuses": dict(statuses),
        "latencies": latencies,
    }


async def setup_ours(client: httpx.AsyncClient, hosts: int, alloc_jobs: int) -> dict[str, str]:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    async def ok(method: str, path: str, body: Any, headers: dict[str, str]) -> dict[str, Any]:
        response = await client.request(method, path, json=body, headers=headers)
        if response.status_code != 201:
            raise RuntimeError(f"setup {method} {path}: {response.status_code} {response.text[:300]}")
        created: dict[str, Any] = response.json()
        return created

    created = await ok("POST", "/v1/tenants", {"id": "acme", "display_name": "Acme"}, admin)
    tenant = {"Authorization": f"Bearer {created['api_token']}"}
    for i in range(hosts):
        await ok("POST", "/v1/hosts", {"id": f"h{i:03d}", "gpus": HOST_GPUS, "locality_group": f"rack-{i % 4}"}, admin)
    await ok("POST", "/v1/jobs", {"id": "read-me", "min_workers": 1, "max_workers": 4}, tenant)
    for j in range(alloc_jobs):  # allocations cycle over these; each may grow to MAX_WORKERS 1-GPU workers
        await ok("POST", "/v1/jobs", {"id": f"alloc-{j:03d}", "min_workers": 1, "max_workers": MAX_WORKERS}, tenant)
    return {"tenant_token": created["api_token"]}


def scenarios_for(tenant_token: str, baseline_row: int, run_tag: str, alloc_jobs: int) -> list[Scenario]:
    tenant = {"Authorization": f"Bearer {tenant_token}"}
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    job_ids = itertools.count()

    def new_job(_i: int) -> tuple[str, str, Any, dict[str, str]]:
        body = {"id": f"{run_tag}-{next(job_ids):07d}", "min_workers": 1, "max_workers": 4,
                "batch_size": {"min": 16, "max": 64}}
        return "POST", "/v1/jobs", body, tenant

    return [
        Scenario("ours_get_job", "ours", "GET /v1/jobs/{id}", lambda i: ("GET", "/v1/jobs/read-me", None, tenant)),
        Scenario("base_read", "baseline", "GET /rows/{id}", lambda i: ("GET", f"/rows/{baseline_row}", None, None)),
        Scenario("base_ping", "baseline", "GET /ping", lambda i: ("GET", "/ping", None, None)),
        Scenario("ours_post_job", "ours", "POST /v1/jobs", new_job),
        Scenario("base_insert", "baseline", "POST /rows",
                 lambda i: ("POST", "/rows", {"name": f"row-{i}"}, None)),
        Scenario("ours_alloc", "ours", "POST /v1/allocations",
                 lambda i: ("POST", "/v1/allocations",
                            {"tenant_id": "acme", "job_id": f"alloc-{i % alloc_jobs:03d}", "gpus": 1}, admin)),
    ]


COMPARISONS = [
    ("GET /v1/jobs/{id} vs GET /rows/{id}", "ours_get_job", "base_read"),
    ("GET /v1/jobs/{id} vs GET /ping", "ours_get_job", "base_ping"),
    ("POST /v1/jobs vs POST /rows", "ours_post_job", "base_insert"),
    ("POST /v1/allocations vs POST /rows", "ours_alloc", "base_insert"),
]


async def bench_backend(args: argparse.Namespace, backend: str, workdir: Path, database_url: str) -> dict[str, Any]:
    from api.migrate import upgrade_async

    data_dir = workdir / backend
    data_dir.mkdir(parents=True, exist_ok=True)
    ours = ServerProcess("ours", data_dir, database_url)
    base = ServerProcess("baseline", data_dir, database_url)
    clients: list[LoadClients] = []
    try:
        base.start()  # starts (imports) while ours' database is migrated; ours needs the schema at start-up
        await upgrade_async(ours_settings(data_dir, database_url))
        ours.start()
        await ours.wait_ready("/v1/healthz")
        await base.wait_ready("/ping")
        allocations = (args.rounds * args.requests + args.warmup) * 1.1 + 100
        hosts = args.hosts or max(2, math.ceil(allocations / HOST_GPUS))
        async with httpx.AsyncClient(base_url=ours.url, timeout=30.0) as setup_client:
            setup = await setup_ours(setup_client, hosts, args.alloc_jobs)
        async with httpx.AsyncClient(base_url=base.url, timeout=30.0) as setup_client:
            row = (await setup_client.post("/rows", json={"name": "read-me"})).json()["id"]
        scenarios = scenarios_for(setup["tenant_token"], row, run_tag=f"b{secrets.token_hex(2)}",
                                  alloc_jobs=args.alloc_jobs)
        ours_clients = LoadClients(ours, args.concurrency, args.client)
        base_clients = LoadClients(base, args.concurrency, args.client)
        clients += [ours_clients, base_clients]
        servers = {"ours": (ours_clients, ours), "baseline": (base_clients, base)}
        for s in scenarios:  # warm-up, not recorded: connections, lazy imports, statement caches
            client, server = servers[s.side]
            await run_load(client, s.make, args.warmup, args.concurrency, args.cap, server)
        for r in range(args.rounds):
            order = scenarios[r % len(scenarios):] + scenarios[: r % len(scenarios)]
            for s in order:
                client, server = servers[s.side]
                result = await run_load(client, s.make, args.requests, args.concurrency, args.cap, server)
                s.latencies += result.pop("latencies")
                s.statuses.update(result["statuses"])
                s.results.append(result)
            if not args.json_only:
                print(f"  {backend}: round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        summary = {
            s.key: {
                "side": s.side,
                "label": s.label,
                "rate": median(x["rate"] for x in s.results),
                "rate_min": min(x["rate"] for x in s.results),
                "rate_max": max(x["rate"] for x in s.results),
                "p50_ms": percentile(s.latencies, 50) * 1e3,
                "p99_ms": percentile(s.latencies, 99) * 1e3,
                "server_cpu": median(x["server_cpu"] for x in s.results),
                "client_cpu": median(x["client_cpu"] for x in s.results),
                "requests": len(s.latencies),
                "statuses": dict(s.statuses),
            }
            for s in scenarios
        }
        # req/s ratios: the median of per-round ratios, so slow drift of the machine's load cancels in each pair
        by_key = {s.key: s for s in scenarios}
        paired = {f"{a}/{b}": median(ratio(x["rate"], y["rate"])
                                     for x, y in zip(by_key[a].results, by_key[b].results, strict=True))
                  for _, a, b in COMPARISONS}
        return {"backend": backend, "hosts": hosts, "summary": summary, "paired_rate_ratios": paired,
                "rounds": {s.key: s.results for s in scenarios}}
    finally:
        for c in clients:
            await c.aclose()
        ours.stop()
        base.stop()


# ====================================================================================================================
# PostgreSQL database lifecycle


def _pg_dsn(url: str, database: str | None = None) -> str:
    from sqlalchemy.engine import make_url

    u = make_url(url)
    if database is not None:
        u = u.set(database=database)
    return u.set(drivername="postgresql").render_as_string(hide_password=False)


def _pg_url(url: str, database: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).set(database=database).render_as_string(hide_password=False)


async def _pg_execute(url: str, statement: str) -> None:
    import asyncpg

    connection = await asyncpg.connect(_pg_dsn(url), timeout=5)
    try:
        await connection.execute(statement)
    finally:
        await connection.close()


# ====================================================================================================================
# report


def render_report(args: argparse.Namespace, results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"bench_api  {meta['date']}  {meta['machine']}  code: {meta['git']}",
        f"uvicorn {meta['uvicorn']} ({meta['loop']}), fastapi {meta['fastapi']}, SQLAlchemy {meta['sqlalchemy']}, "
        f"httpx {meta['httpx']}; load: {args.client} client, concurrency {args.concurrency}; {args.rounds} rounds x "
        f"{args.requests} requests per scenario; load average at start {meta['loadavg']}",
        "req/s: median over rounds (min-max), ratio: median of per-round ratios; latencies: percentiles over all "
        "rounds' samples; CPU: server process / load generator, in cores",
    ]
    flagged = False
    for res in results:
        s = res["summary"]
        rows = []
        for v in s.values():
            codes = ", ".join(f"{k}:{c}" for k, c in sorted(v["statuses"].items()))
            client_bound = v["client_cpu"] >= CLIENT_BOUND_CPU
            flagged = flagged or client_bound
            rows.append([
                f"{v['side']:<8} {v['label']}", fmt(v["rate"], "/s") + ("*" if client_bound else ""),
                f"{v['rate_min']:,.0f}-{v['rate_max']:,.0f}", fmt(v["p50_ms"], "ms"), fmt(v["p99_ms"], "ms"),
                f"{v['server_cpu']:.2f}/{v['client_cpu']:.2f}", codes,
            ])
        lines += ["", f"[{res['backend']}]",
                  table(["scenario", "req/s", "range", "p50 ms", "p99 ms", "CPU srv/cli", "status counts"], rows)]
        ratio_rows = []
        for name, a, b in COMPARISONS:
            ratio_rows.append([name, fmt(res["paired_rate_ratios"][f"{a}/{b}"], "x"),
                               fmt(ratio(s[a]["p50_ms"], s[b]["p50_ms"]), "x"),
                               fmt(ratio(s[a]["p99_ms"], s[b]["p99_ms"]), "x")])
        lines += ["", table(["ours / baseline", "req/s", "p50", "p99"], ratio_rows)]
        alloc = s["ours_alloc"]["statuses"]
        lines.append(f"allocations: {alloc.get('201', 0)} granted, {alloc.get('409', 0)} refused (409), 1 GPU each, "
                     f"cycling over {args.alloc_jobs} jobs, on {res['hosts']} hosts x {HOST_GPUS} GPUs")
    if flagged:
        lines.append(f"* the load generator used >= {CLIENT_BOUND_CPU} of a core: that figure is bounded by the "
                     "client, not the server (try --client raw)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, ~10 s")
    ap.add_argument("--rounds", type=int, help="rounds; each runs every scenario once (default 6, quick 2)")
    ap.add_argument("--requests", type=int, help="requests per scenario per round (default 120, quick 40)")
    ap.add_argument("--warmup", type=int, help="unrecorded requests per scenario first (default 30, quick 5)")
    ap.add_argument("--concurrency", type=int, default=32, help="concurrent requests (default 32)")
    ap.add_argument("--client", choices=["httpx", "raw"], default="httpx",
                    help="load generator: httpx.AsyncClient per connection (default), or a minimal raw HTTP/1.1 "
                         "client that leaves more CPU to the server")
    ap.add_argument("--cap", type=float, help="seconds cap per scenario run (default 8, quick 3)")
    ap.add_argument("--hosts", type=int, default=0,
                    help=f"hosts of {HOST_GPUS} GPUs for the ledger (default: enough for every allocation)")
    ap.add_argument("--alloc-jobs", type=int, default=16,
                    help=f"jobs (max_workers {MAX_WORKERS}) the allocations cycle over, 1 GPU each (default 16)")
    ap.add_argument("--postgres", nargs="?", const=DEFAULT_POSTGRES_URL, metavar="URL",
                    help=f"also run on PostgreSQL: a fresh database hz_bench_<random> on the server of URL, dropped "
                         f"afterwards (default {DEFAULT_POSTGRES_URL})")
    ap.add_argument("--no-sqlite", action="store_true", help="skip SQLite (with --postgres)")
    ap.add_argument("--dir", type=Path, help="parent of the temp dir for SQLite files and logs")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (databases, server logs)")
    ap.add_argument("--json", metavar="PATH", help="also write all figures as JSON to PATH ('-': stdout, no table)")
    ap.add_argument("--serve", choices=["ours", "baseline"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--database-url", default="", help=argparse.SUPPRESS)
    ap.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    defaults = {"rounds": (6, 2), "requests": (120, 40), "warmup": (30, 5), "cap": (8.0, 3.0)}
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    for name in ("rounds", "requests", "concurrency", "alloc_jobs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if args.no_sqlite and not args.postgres:
        ap.error("--no-sqlite needs --postgres")
    args.json_only = args.json == "-"
    return args


async def bench(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    results = []
    if not args.no_sqlite:
        results.append(await bench_backend(args, "sqlite", workdir, ""))
    if args.postgres:
        name = f"hz_bench_{os.getpid()}_{secrets.token_hex(4)}"
        await _pg_execute(args.postgres, f'CREATE DATABASE "{name}"')
        try:
            results.append(await bench_backend(args, "postgres", workdir, _pg_url(args.postgres, name)))
        finally:
            await _pg_execute(args.postgres, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        return serve(args.serve, args.port, args.data_dir, args.database_url, args.fd)
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="hz-bench-api-", dir=args.dir))
    httptools = importlib.util.find_spec("httptools") is not None
    meta: dict[str, Any] = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_line(),
        "uvicorn": package_version("uvicorn"), "fastapi": package_version("fastapi"),
        "sqlalchemy": package_version("SQLAlchemy"),
        "httpx": package_version("httpx"),
        "loop": f"{event_loop_choice()}/{'httptools' if httptools else 'h11'}",
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "loadavg": loadavg(),
        "git": git_state(),
    }
    started = time.monotonic()
    try:
        results = asyncio.run(asyncio.wait_for(bench(args, workdir), timeout=1200))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    meta["seconds"] = round(time.monotonic() - started, 1)
    if not args.json_only:
        print(render_report(args, results, meta))
        print(f"\n(total {meta['seconds']} s)")
    if args.json:
        payload = {"meta": meta, "args": {k: v for k, v in vars(args).items() if k not in ("dir", "data_dir")},
                   "results": results}
        write_json(args.json, clean_nan(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
