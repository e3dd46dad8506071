#!/usr/bin/env python
"""Negotiation benchmark: `POST /v1/negotiations` over HTTP against a bare FastAPI + SQLAlchemy insert, in one run.

The same two uvicorn servers as bench_api.py (its `ServerProcess`, `--serve ours|baseline`): ours is
`api.app.create_app` with the in-memory broker port (the API alone: no broker traffic; outbox rows accumulate, as in
any app without a bus) on a fresh SQLite database migrated with `api.migrate.upgrade_async`; the baseline is
bench_api.py's bare app (`POST /rows`: insert one row and commit, SQLAlchemy 2 async ORM, the pragmas and pool
api/db.py had when it was written). Load comes from this process at a fixed concurrency over keep-alive connections
(bench_api.py's load generator, `--client httpx|raw`).

Scenarios (every round runs each once, rotating their order; req/s are medians over rounds, their ratios medians of
per-round ratios, latency percentiles over all rounds' samples):

* ours  request -> offer     `POST /v1/negotiations` with a new `Idempotency-Key` each time: a scale request
                             (1 -> 2 workers, accepting 1..2) on one of `--jobs` jobs that each run 1 worker; the
                             provider answers at once with an offer (201). Offers hold no capacity, so this repeats
                             forever on the same jobs: the idempotency claim, the job read, the free-capacity read,
                             the policy, the negotiation and its two rounds, the outbox event, the stored response.
* ours  replay (same key)    the same POST again with a key already answered: the idempotency lookup only.
* ours  request + accept     a cycle per worker on its own job: request 1 -> 2, accept option 0 (the ledger places a
                             worker), request 2 -> 1, accept (the ledger releases it), so capacity never runs out.
                             Timed per request; cycles/s = req/s / 2.
* base  POST /rows           the baseline insert, the reference for every ratio.

That closed loop runs at saturation: it says how many requests a server carries, not what latency a client sees at
a given load (a closed loop slows its own sending when the server slows, so it never sees a queue build up). The
project's target is about the latter: p99 <= 50 ms at an offered 50 negotiations/s on one API process. `--rate R`
(repeatable, or a comma list) adds an **open loop** after the closed-loop scenarios (`--open-loop-only`: instead of
them), for each rate and each backend selected:

* ours  request -> offer     the closed loop's request (new key, `scale_body` over the `--jobs` jobs) at R/s.
* ours  request + accept     R negotiations/s: each arrival requests 1 -> 2 (or 2 -> 1) and accepts option 0 on a
                             job of its own, taken from a pool of `--open-connections` jobs made at setup and given
                             back when its cycle ends (no job has two cycles in flight; capacity never runs out).
                             Latency per negotiation: request + accept.
* base  POST /rows           the baseline insert at R/s.

Arrivals are a Poisson process (exponential gaps from `random.Random(--seed)`; every scenario at one rate sees the
same arrival times) over `--open-warmup` s (not recorded) then `--open-duration` s (recorded). Each arrival takes a
free connection from a pool of at most `--open-connections` keep-alive connections (each carries one request at a
time; when all are busy the arrival waits), always bench_api.py's raw HTTP client: the lightest load generator, so
the client's own CPU delays arrivals least. **Latency runs from each arrival's scheduled time**, not from when it
was sent: when the server (or the client, or the wait for a connection) falls behind, the lateness is part of what a
caller would see, and measuring from the send would hide exactly the queueing the target is about (coordinated
omission). Per scenario: offered and achieved rate (2xx answers that came within the recorded window / its length:
below the offered rate, the server fell behind), p50/p90/p99/max over the recorded arrivals' 2xx answers, non-2xx
and errors (arrivals still unanswered `OPEN_DRAIN_S` after the last one are cut off and counted as `unfinished`),
server and client CPU in cores (from the end of the warm-up to the last answer), and whether p99 <= 50 ms with
nothing failed. The server is let go idle between runs, so one run's backlog is not billed to the next.

With one server on PostgreSQL the request + accept cycles also report the ledger's locks: waits and holds by mode
(shared: an accepted resize; whole: the rest) and the waits for host rows, from the server's own `/v1/metrics`
histograms read before and after each recorded run (means exact, p50/p99 interpolated within the buckets).

Run from the repository root: `python bench/bench_negotiations.py` (~60-80 s), `--quick` (~15 s),
`--postgres [URL]` to repeat on PostgreSQL (a fresh database, dropped afterwards), `--replicas N` to serve each side
from N processes on one address, `--replicas 1,2,3` to run each count in turn (a fresh database each) and add a
scaling table, with `--replica-cpu 0.2` to hold every server process to a fifth of a core (`_cpu_quota`: on a
machine smaller than N full replicas, the quota, not the machine, bounds each one, so whether N of them carry N
times the load is the software's answer; with `--hosts 64 --host-gpus 8` the cycles' accepts write different hosts,
as on a provider's 8-GPU hosts, rather than all the same two: bench/README.md has the command, ~2.5 min),
`--rate 50 --open-loop-only`
for the open loop alone (~75 s per rate and backend, `--quick` ~35 s), `--help` for sizes.
No timed assertions: it prints figures. Every loop is bounded in count and in time; only loopback addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.metadata
import importlib.util
import itertools
import json
import math
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
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
    ratio,
    table,
    write_json,
)

ensure_repo_on_path()

import bench_api  # noqa: E402  (also records sniffio's absence for httpcore, if it is absent)
import httpx  # noqa: E402
from _cpu_quota import CpuQuotaError, cpu_quota_root  # noqa: E402
from bench_api import (  # noqa: E402
    ADMIN_TOKEN,
    CLIENT_BOUND_CPU,
    DEFAULT_POSTGRES_URL,
    HOST_GPUS,
    LoadClients,
    RawHttpConnection,
    ServerProcess,
    ours_settings,
    run_load,
)

SCENARIOS = {
    "ours_request": ("ours", "POST /v1/negotiations (request -> offer)"),
    "ours_replay": ("ours", "POST /v1/negotiations replay (same key)"),
    "ours_cycle": ("ours", "request + accept cycle, per request"),
    "base_insert": ("baseline", "POST /rows"),
}
COMPARISONS = [
    ("request -> offer vs POST /rows", "ours_request", "base_insert"),
    ("replay vs POST /rows", "ours_replay", "base_insert"),
    ("request + accept (per request) vs POST /rows", "ours_cycle", "base_insert"),
]
ERRORS = (httpx.HTTPError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, KeyError)

OPEN_SCENARIOS = {
    "ours_request": ("ours", "POST /v1/negotiations (request -> offer)"),
    "ours_negotiation": ("ours", "request + accept, per negotiation"),
    "base_insert": ("baseline", "POST /rows"),
}
OPEN_TARGET_P99_MS = 50.0  # the project's target: p99 <= 50 ms at an offered 50 negotiations/s, one API process
OPEN_DRAIN_S = 15.0  # after the last arrival, how long answers are still waited for before the rest are cut off
OPEN_SETTLE_S = 10.0  # at most this long between open-loop scenarios for the last one's server to go idle
OPEN_MAX_ARRIVALS_FACTOR = 3  # arrivals of one run: at most this times the expected count (+100), a bound on the loop


LOCK_SERIES = {  # /v1/metrics histograms of the ledger lock (api/services/ledger_lock.py), by label set
    "wait_shared": ("hz_ledger_lock_wait_seconds", (("mode", "shared"),)),
    "held_shared": ("hz_ledger_lock_held_seconds", (("mode", "shared"),)),
    "wait_whole": ("hz_ledger_lock_wait_seconds", (("mode", "whole"),)),
    "held_whole": ("hz_ledger_lock_held_seconds", (("mode", "whole"),)),
    "hosts_wait": ("hz_ledger_hosts_wait_seconds", ()),
}


async def lock_histograms(server: ServerProcess) -> dict[str, dict[str, float]]:
    """The ledger lock's histograms from the server's `/v1/metrics`: per series, its cumulative bucket counts by
    upper bound ("+Inf" included), "sum" and "count". Only meaningful for one server process (each has its own)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        text = (await client.get("/v1/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})).text
    found: dict[str, dict[str, float]] = {key: {} for key in LOCK_SERIES}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            bound = labels.pop("le", None)
            for key, (name, wanted) in LOCK_SERIES.items():
                if tuple(sorted(labels.items())) != wanted:
                    continue
                if sample.name == f"{name}_bucket" and bound is not None:
                    found[key][bound] = sample.value
                elif sample.name in (f"{name}_sum", f"{name}_count"):
                    found[key][sample.name.rsplit("_", 1)[1]] = sample.value
    return found


def lock_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
               total: dict[str, dict[str, float]]) -> None:
    """Add what each series gained between `before` and `after` to `total`."""
    for key, values in after.items():
        into = total.setdefault(key, {})
        for field_name, value in values.items():
            into[field_name] = into.get(field_name, 0.0) + value - before.get(key, {}).get(field_name, 0.0)


def lock_summary(series: dict[str, float]) -> dict[str, float]:
    """n, mean and bucket-interpolated p50 / p99 (as Prometheus' histogram_quantile) of one series, in ms."""
    count = series.get("count", 0.0)
    if not count:
        return {"n": 0}
    bounds = sorted((float(b), c) for b, c in series.items() if b not in ("sum", "count"))

    def quantile(q: float) -> float:
        rank, lower, below = q * count, 0.0, 0.0
        for upper, cumulative in bounds:
            if cumulative >= rank:
                if math.isinf(upper):
                    return lower * 1e3
                inside = cumulative - below
                return (lower + (upper - lower) * ((rank - below) / inside if inside else 1.0)) * 1e3
            lower, below = upper, cumulative
        return math.nan

    return {"n": int(count), "mean_ms": series.get("sum", 0.0) / count * 1e3, "p50_ms": quantile(0.5),
            "p99_ms": quantile(0.99)}


def scale_body(job: str, workers: int) -> dict[str, Any]:
    return {"job": job, "kind": "scale",
            "terms": {"desired_workers": workers, "accept_workers": {"min": 1, "max": max(1, workers)}}}


async def setup_ours(client: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, Any]:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    async def ok(method: str, path: str, body: Any, headers: dict[str, str]) -> dict[str, Any]:
        response = await client.request(method, path, json=body, headers=headers)
        if response.status_code not in (200, 201):
            raise RuntimeError(f"setup {method} {path}: {response.status_code} {response.text[:300]}")
        return dict(response.json())

    created = await ok("POST", "/v1/tenants", {"id": "acme", "display_name": "Acme"}, admin)
    tenant = {"Authorization": f"Bearer {created['api_token']}"}
    for i in range(args.hosts):
        await ok("POST", "/v1/hosts", {"id": f"h{i:03d}", "gpus": args.host_gpus, "locality_group": f"rack-{i % 4}"},
                 admin)
    body = {"min_workers": 1, "max_workers": 4, "initial_workers": 1, "gpus_per_worker": args.worker_gpus}
    for j in range(args.jobs):
        await ok("POST", "/v1/jobs", {"id": f"neg-{j:03d}", **body}, tenant)
    for w in range(0 if args.open_loop_only else args.concurrency):
        await ok("POST", "/v1/jobs", {"id": f"cyc-{w:03d}", **body}, tenant)
    open_jobs = [f"ocyc-{k:03d}" for k in range(args.open_connections if args.rate else 0)]
    for job in open_jobs:  # the open loop's request + accept cycles, one in flight per job
        await ok("POST", "/v1/jobs", {"id": job, **body}, tenant)
    # the replayed request: answered once here, then sent again with the same key in the replay scenario
    replay = scale_body("neg-000", 2)
    await ok("POST", "/v1/negotiations", replay, {**tenant, "Idempotency-Key": "bench-replay"})
    return {"tenant": tenant, "replay": replay, "open_jobs": open_jobs}


async def run_cycles(clients: LoadClients, tenant: dict[str, str], n_requests: int, concurrency: int, cap_s: float,
                     server: ServerProcess, state: dict[int, int], tag: str) -> dict[str, Any]:
    """Worker w drives job cyc-w: request (1 -> 2 or 2 -> 1) then accept option 0, until `n_requests` in total."""
    deadline = Deadline(cap_s)
    budget = itertools.count()
    keys = itertools.count()
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    cycles = [0]

    async def timed(send: Any, method: str, path: str, body: Any, headers: dict[str, str]) -> tuple[int, bytes]:
        t0 = time.perf_counter()
        status, content = await asyncio.wait_for(send(method, path, body, headers), 30)
        latencies.append(time.perf_counter() - t0)
        statuses[str(status)] += 1
        return status, content

    async def worker(w: int) -> None:
        send = clients.body_sender(w)
        job = f"cyc-{w:03d}"
        while not deadline.expired and next(budget) + 1 < n_requests:
            next(budget)  # a cycle is two requests
            target = 1 if state.get(w, 1) == 2 else 2
            headers = {**tenant, "Idempotency-Key": f"{tag}-c{next(keys)}"}
            try:
                status, content = await timed(send, "POST", "/v1/negotiations", scale_body(job, target), headers)
                if status != 201:
                    continue
                negotiation = json.loads(content)
                if negotiation.get("state") != "offered":
                    continue
                status, _ = await timed(send, "POST", f"/v1/negotiations/{negotiation['id']}/accept", {"option": 0},
                                        tenant)
                if status == 200:
                    state[w] = target
                    cycles[0] += 1
            except ERRORS as exc:
                statuses[type(exc).__name__] += 1

    cpu0, own0, busy0 = server.cpu_seconds(), time.process_time(), machine_busy_seconds()
    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - start
    cpu1, own1, busy1 = server.cpu_seconds(), time.process_time(), machine_busy_seconds()
    return {
        "n": len(latencies),
        "cycles": cycles[0],
        "elapsed_s": elapsed,
        "rate": len(latencies) / elapsed if elapsed else 0.0,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "server_cpu": (cpu1 - cpu0) / elapsed if elapsed else math.nan,
        "client_cpu": (own1 - own0) / elapsed if elapsed else math.nan,
        "machine_cpu": (busy1 - busy0) / elapsed if elapsed else math.nan,
        "statuses": dict(statuses),
        "latencies": latencies,
    }


async def count_statements(workdir: Path, database_url: str = "", *, worker_gpus: int = 1,
                           host_gpus: int = HOST_GPUS) -> dict[str, int]:
    """Database round trips per request of each scenario (SQL statements incl. BEGIN, plus commits), counted once
    with a SQLAlchemy cursor listener on an in-process app (httpx.ASGITransport) with its own fresh SQLite file;
    hosts of `host_gpus`, jobs of `worker_gpus` a worker (a grow needing a new host starts a warm joiner)."""
    from sqlalchemy import event

    from api.migrate import upgrade_async

    data_dir = workdir / "count"
    data_dir.mkdir(parents=True, exist_ok=True)
    settings = ours_settings(data_dir, database_url)
    await upgrade_async(settings)
    app = bench_api.build_ours(data_dir, database_url)
    counts: Counter[str] = Counter()
    out: dict[str, int] = {}
    async with app.router.lifespan_context(app):
        engine = app.state.engine

        @event.listens_for(engine.sync_engine, "before_cursor_execute")
        def _statement(*_args: Any) -> None:
            counts["statements"] += 1

        @event.listens_for(engine.sync_engine, "commit")
        def _commit(*_args: Any) -> None:
            counts["commits"] += 1

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
            # Two jobs of one worker, one of them grown to two: one host when the three workers fit on it, else one
            # host each (the grow then needs a host its job does not run on).
            hosts = 1 if 3 * worker_gpus <= host_gpus else 3
            args = argparse.Namespace(hosts=hosts, host_gpus=host_gpus, worker_gpus=worker_gpus, jobs=1,
                                      concurrency=1, open_loop_only=False, rate=[], open_connections=0)
            setup = await setup_ours(client, args)
            tenant = setup["tenant"]

            async def measure(name: str, method: str, path: str, body: Any, headers: dict[str, str]) -> Any:
                counts.clear()
                reply = await client.request(method, path, json=body, headers=headers)
                if not reply.is_success:  # a refused request's round trips would stand for the scenario's
                    raise RuntimeError(f"counting {name}: {method} {path} answered {reply.status_code} "
                                       f"{reply.text[:300]}")
                out[name] = counts["statements"] + counts["commits"]
                return reply.json()

            offer = await measure("ours_request", "POST", "/v1/negotiations", scale_body("cyc-000", 2),
                                  {**tenant, "Idempotency-Key": "count-1"})
            await measure("ours_replay", "POST", "/v1/negotiations", scale_body("cyc-000", 2),
                          {**tenant, "Idempotency-Key": "count-1"})
            await measure("ours_accept", "POST", f"/v1/negotiations/{offer['id']}/accept", {"option": 0}, tenant)
    return out


# ====================================================================================================================
# open loop: Poisson arrivals at a fixed offered rate, latency from each arrival's scheduled time

OpenOp = Callable[[int, RawHttpConnection], Awaitable[tuple[bool, str]]]
"""One arrival's work on a connection it holds: (2xx?, status label for the counts)."""


def poisson_arrivals(rate: float, horizon_s: float, rng: random.Random) -> list[float]:
    """Arrival offsets (s) of a Poisson process at `rate`/s over `horizon_s`: exponential gaps, so arrivals bunch as
    independent callers' do. Bounded in count (a few times the expected number) whatever the draws."""
    cap = int(rate * horizon_s * OPEN_MAX_ARRIVALS_FACTOR) + 100
    arrivals: list[float] = []
    t = rng.expovariate(rate)
    while t < horizon_s and len(arrivals) < cap:
        arrivals.append(t)
        t += rng.expovariate(rate)
    return arrivals


class ConnectionPool:
    """At most `size` raw keep-alive connections to one server, each carrying one request at a time (a bounded
    client pool). LIFO: the load reuses the connections it already has open and opens another only when all are busy,
    as a client's pool grows with its concurrency. `peak` counts the most held at once (reset per run)."""

    def __init__(self, port: int, size: int) -> None:
        self.free: asyncio.LifoQueue[RawHttpConnection] = asyncio.LifoQueue()
        self.all = [RawHttpConnection(port) for _ in range(size)]
        for connection in reversed(self.all):
            self.free.put_nowait(connection)
        self.busy = 0
        self.peak = 0
        self.waits = 0

    async def acquire(self) -> RawHttpConnection:
        if self.free.empty():
            self.waits += 1  # every connection busy: this arrival queues here, and the wait is in its latency
        connection = await self.free.get()
        self.busy += 1
        self.peak = max(self.peak, self.busy)
        return connection

    def release(self, connection: RawHttpConnection) -> None:
        self.busy -= 1
        self.free.put_nowait(connection)

    def reset_counts(self) -> None:
        self.peak = self.busy
        self.waits = 0

    async def aclose(self) -> None:
        for connection in self.all:
            await connection.close()


class CycleJobs:
    """The open loop's request + accept jobs. A cycle takes a free job and gives it back when done, so no job ever has
    two cycles in flight (a second request on a job whose offer is being accepted would race it); each cycle scales
    its job 1 -> 2 or 2 -> 1, so capacity never runs out. There are as many jobs as pooled connections and a cycle
    holds its connection throughout, so a free job is always there once a connection is."""

    def __init__(self, jobs: list[str]) -> None:
        self.free: asyncio.Queue[str] = asyncio.Queue()
        for job in jobs:
            self.free.put_nowait(job)
        self.workers = dict.fromkeys(jobs, 1)
        self.dirty: set[str] = set()

    async def run(self, connection: RawHttpConnection, tenant: dict[str, str], key: str) -> tuple[bool, str]:
        job = await self.free.get()
        done = False
        try:
            target = 1 if self.workers[job] == 2 else 2
            status = await connection.request("POST", "/v1/negotiations", scale_body(job, target),
                                              {**tenant, "Idempotency-Key": key})
            if status != 201:
                return False, f"request {status}"
            offer = json.loads(connection.last_body)
            if offer.get("state") != "offered":
                return False, f"request {offer.get('state')}"
            status = await connection.request("POST", f"/v1/negotiations/{offer['id']}/accept", {"option": 0}, tenant)
            if status != 200:
                return False, f"accept {status}"
            self.workers[job] = target
            done = True
            return True, "200"
        finally:
            if not done:  # the job's worker count is uncertain now (e.g. an accept cut off): read it back later
                self.dirty.add(job)
            self.free.put_nowait(job)

    async def resync(self, pool: ConnectionPool, tenant: dict[str, str]) -> int:
        """Untimed, between runs: read back the worker count of each job whose last cycle did not end cleanly, so the
        next cycle on it asks for a change again instead of being refused."""
        dirty, self.dirty = sorted(self.dirty), set()
        connection = await pool.acquire()
        try:
            for job in dirty:
                try:
                    status = await asyncio.wait_for(connection.request("GET", f"/v1/jobs/{job}", None, tenant), 10)
                    if status == 200:
                        self.workers[job] = int(json.loads(connection.last_body)["desired_workers"])
                except ERRORS:
                    self.dirty.add(job)
        finally:
            pool.release(connection)
        return len(dirty)


async def sleep_until(when: float) -> None:
    delay = when - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def settle(server: ServerProcess) -> float:
    """Wait (at most OPEN_SETTLE_S) until `server` has gone idle: an overloaded run leaves requests the client cut
    off still running there, and they must not be billed to the next run. Returns the seconds waited."""
    deadline = Deadline(OPEN_SETTLE_S)
    while not deadline.expired:
        cpu0 = server.cpu_seconds()
        await asyncio.sleep(0.25)
        if not (server.cpu_seconds() - cpu0) / 0.25 >= 0.1:  # NaN (no /proc) counts as idle
            break
    return OPEN_SETTLE_S - deadline.left


async def run_open_loop(server: ServerProcess, pool: ConnectionPool, op: OpenOp, rate: float, warmup_s: float,
                        duration_s: float, seed: int) -> dict[str, Any]:
    """Arrivals at `rate`/s for `warmup_s` (not recorded) then `duration_s`, each started at its scheduled time
    whatever the earlier ones are doing, and timed from that time. A hard deadline (`OPEN_DRAIN_S` after the last
    arrival) cuts off what is still unanswered."""
    arrivals = poisson_arrivals(rate, warmup_s + duration_s, random.Random(seed))
    deadline = Deadline(warmup_s + duration_s + OPEN_DRAIN_S)
    latencies: list[float] = []  # of the recorded arrivals' 2xx answers
    answered_at: list[float] = []  # when each 2xx answer came, warm-up arrivals' too: the rate actually carried
    statuses: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    in_flight = [0, 0]  # now, peak (incl. arrivals waiting for a connection)

    async def arrival(i: int, scheduled: float, recorded: bool) -> None:
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        try:
            connection = await pool.acquire()
            try:
                ok, label = await op(i, connection)
            finally:
                pool.release(connection)
            now = time.perf_counter()
            elapsed = now - scheduled
            if ok:
                answered_at.append(now)
            if recorded:
                statuses[label] += 1
                counts["ok" if ok else "non_2xx"] += 1
                if ok:
                    latencies.append(elapsed)
        except Exception as exc:  # every arrival is accounted for, whatever went wrong with it
            if recorded:
                statuses[type(exc).__name__] += 1
                counts["errors"] += 1
        finally:
            in_flight[0] -= 1

    tasks: dict[asyncio.Task[None], bool] = {}
    start = time.perf_counter() + 0.01
    marks: dict[str, float] = {}
    for i, offset in enumerate(arrivals):
        if deadline.expired:
            break
        if not marks and offset >= warmup_s:  # the recorded window starts: CPU counters from here
            await sleep_until(start + warmup_s)
            marks.update(t=time.perf_counter(), cpu=server.cpu_seconds(), own=time.process_time())
            pool.reset_counts()
            in_flight[1] = in_flight[0]
        scheduled = start + offset
        await sleep_until(scheduled)
        recorded = offset >= warmup_s
        tasks[asyncio.create_task(arrival(i, scheduled, recorded))] = recorded
    if not marks:
        marks.update(t=time.perf_counter(), cpu=server.cpu_seconds(), own=time.process_time())
    pending: set[asyncio.Task[None]] = set()
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.001, deadline.left))
    end, cpu1, own1 = time.perf_counter(), server.cpu_seconds(), time.process_time()
    for task in pending:
        task.cancel()
        if tasks[task]:
            statuses["unfinished"] += 1
            counts["errors"] += 1
    await asyncio.gather(*pending, return_exceptions=True)
    window = end - marks["t"]
    carried = sum(1 for t in answered_at if marks["t"] <= t < marks["t"] + duration_s)
    p99 = percentile(latencies, 99) * 1e3
    return {
        "offered_rate": rate,
        "warmup_s": warmup_s,
        "duration_s": duration_s,
        "seed": seed,
        "arrivals": sum(tasks.values()),
        "ok": counts["ok"],
        "drained_s": max(0.0, end - (marks["t"] + duration_s)),
        "achieved_rate": carried / duration_s,  # 2xx answers within the recorded window: under overload < offered
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p90_ms": percentile(latencies, 90) * 1e3,
        "p99_ms": p99,
        "max_ms": max(latencies) * 1e3 if latencies else math.nan,
        "non_2xx": counts["non_2xx"],
        "errors": counts["errors"],
        "statuses": dict(statuses),
        "server_cpu": (cpu1 - marks["cpu"]) / window if window > 0 else math.nan,
        "client_cpu": (own1 - marks["own"]) / window if window > 0 else math.nan,
        "server_cpu_ms": (cpu1 - marks["cpu"]) * 1e3 / len(latencies) if latencies else math.nan,
        "peak_in_flight": in_flight[1],
        "peak_connections": pool.peak,
        "waited_for_connection": pool.waits,
        "target_p99_ms": OPEN_TARGET_P99_MS,
        "met": bool(latencies) and p99 <= OPEN_TARGET_P99_MS and counts["non_2xx"] + counts["errors"] == 0,
    }


async def run_open_loops(args: argparse.Namespace, backend: str, ours: ServerProcess, base: ServerProcess,
                         setup: dict[str, Any]) -> list[dict[str, Any]]:
    """Every `--rate`, each open-loop scenario once (order rotating per rate), on pools of raw connections."""
    tenant = setup["tenant"]
    tag = f"o{secrets.token_hex(3)}"
    keys = itertools.count()
    cycles = CycleJobs(setup["open_jobs"])
    pools = {"ours": ConnectionPool(ours.port, args.open_connections),
             "baseline": ConnectionPool(base.port, args.open_connections)}
    servers = {"ours": ours, "baseline": base}

    async def request_offer(i: int, connection: RawHttpConnection) -> tuple[bool, str]:
        status = await connection.request("POST", "/v1/negotiations", scale_body(f"neg-{i % args.jobs:03d}", 2),
                                          {**tenant, "Idempotency-Key": f"{tag}-{next(keys)}"})
        return 200 <= status < 300, str(status)

    async def negotiation(i: int, connection: RawHttpConnection) -> tuple[bool, str]:
        return await cycles.run(connection, tenant, f"{tag}-{next(keys)}")

    async def insert(i: int, connection: RawHttpConnection) -> tuple[bool, str]:
        status = await connection.request("POST", "/rows", {"name": f"open-{i}"}, None)
        return 200 <= status < 300, str(status)

    ops: dict[str, OpenOp] = {"ours_request": request_offer, "ours_negotiation": negotiation, "base_insert": insert}
    order = list(OPEN_SCENARIOS)
    entries: list[dict[str, Any]] = []
    try:
        for r, rate in enumerate(args.rate):
            for key in order[r % len(order):] + order[: r % len(order)]:
                side, label = OPEN_SCENARIOS[key]
                result = await run_open_loop(servers[side], pools[side], ops[key], rate, args.open_warmup,
                                             args.open_duration, args.seed)
                result["settled_s"] = await settle(servers[side])
                if key == "ours_negotiation":
                    result["resynced_jobs"] = await cycles.resync(pools["ours"], tenant)
                entries.append({"backend": backend, "scenario": key, "side": side, "label": label, **result})
                if not args.json_only:
                    print(f"  {backend}: open loop {label} at {rate:g}/s done", file=sys.stderr, flush=True)
    finally:
        for pool in pools.values():
            await pool.aclose()
    return entries


async def bench_backend(args: argparse.Namespace, backend: str, workdir: Path, database_url: str,
                        replicas: int) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """One backend's servers (`replicas` processes a side) and setup, then the closed loop (unless `--open-loop-only`)
    and the open loop (for each `--rate`): (closed-loop result or None, open-loop entries)."""
    from api.migrate import upgrade_async

    data_dir = workdir / (backend if len(args.replicas) == 1 else f"{backend}-{replicas}")
    data_dir.mkdir(parents=True, exist_ok=True)
    ours = ServerProcess("ours", data_dir, database_url, replicas=replicas, cpu_limit=args.replica_cpu)
    base = ServerProcess("baseline", data_dir, database_url, replicas=replicas, cpu_limit=args.replica_cpu)
    try:
        base.start()
        await upgrade_async(ours_settings(data_dir, database_url))
        ours.start()
        await ours.wait_ready("/v1/healthz")
        await base.wait_ready("/ping")
        async with httpx.AsyncClient(base_url=ours.url, timeout=30.0) as setup_client:
            setup = await setup_ours(setup_client, args)
        closed = None if args.open_loop_only else await run_closed_loop(args, backend, ours, base, setup)
        open_entries = await run_open_loops(args, backend, ours, base, setup) if args.rate else []
        for entry in ([closed] if closed else []) + open_entries:
            entry["replicas"], entry["cpu_limit"] = replicas, args.replica_cpu
        if closed is not None:
            closed["throttled_s"] = {"ours": ours.throttled_seconds(), "baseline": base.throttled_seconds()}
        return closed, open_entries
    finally:
        ours.stop()
        base.stop()


async def run_closed_loop(args: argparse.Namespace, backend: str, ours: ServerProcess, base: ServerProcess,
                          setup: dict[str, Any]) -> dict[str, Any]:
    """The saturation scenarios: `--rounds` rounds of every scenario at `--concurrency`, order rotating per round."""
    clients: list[LoadClients] = []
    try:
        tenant, replay = setup["tenant"], setup["replay"]
        ours_clients = LoadClients(ours, args.concurrency, args.client)
        base_clients = LoadClients(base, args.concurrency, args.client)
        clients += [ours_clients, base_clients]
        tag = f"b{secrets.token_hex(3)}"
        keys = itertools.count()

        def request(i: int) -> tuple[str, str, Any, dict[str, str]]:
            return ("POST", "/v1/negotiations", scale_body(f"neg-{i % args.jobs:03d}", 2),
                    {**tenant, "Idempotency-Key": f"{tag}-r{next(keys)}"})

        makers = {
            "ours_request": request,
            "ours_replay": lambda i: ("POST", "/v1/negotiations", replay,
                                      {**tenant, "Idempotency-Key": "bench-replay"}),
            "base_insert": lambda i: ("POST", "/rows", {"name": f"row-{i}"}, None),
        }
        cycle_state: dict[int, int] = {}
        results: dict[str, list[dict[str, Any]]] = {k: [] for k in SCENARIOS}
        latencies: dict[str, list[float]] = {k: [] for k in SCENARIOS}
        statuses: dict[str, Counter[str]] = {k: Counter() for k in SCENARIOS}

        lock_totals: dict[str, dict[str, float]] = {}
        locks_measured = ours.replicas == 1 and backend == "postgres"

        async def run(key: str, n: int, *, recorded: bool = False) -> dict[str, Any]:
            if key == "ours_cycle":
                before = await lock_histograms(ours) if recorded and locks_measured else None
                result = await run_cycles(ours_clients, tenant, n, args.concurrency, args.cap, ours, cycle_state,
                                          f"{tag}-{next(keys)}")
                if before is not None:
                    lock_delta(before, await lock_histograms(ours), lock_totals)
                return result
            client, server = (ours_clients, ours) if SCENARIOS[key][0] == "ours" else (base_clients, base)
            return await run_load(client, makers[key], n, args.concurrency, args.cap, server)

        for key in SCENARIOS:  # warm-up, not recorded
            await run(key, args.warmup)
        keys_order = list(SCENARIOS)
        for r in range(args.rounds):
            order = keys_order[r % len(keys_order):] + keys_order[: r % len(keys_order)]
            for key in order:
                result = await run(key, args.requests, recorded=True)
                latencies[key] += result.pop("latencies")
                statuses[key].update(result["statuses"])
                results[key].append(result)
            if not args.json_only:
                print(f"  {backend} ({ours.replicas} replica(s)): round {r + 1}/{args.rounds} done", file=sys.stderr,
                      flush=True)
        summary = {
            key: {
                "side": SCENARIOS[key][0],
                "label": SCENARIOS[key][1],
                "rate": median(x["rate"] for x in results[key]),
                "rate_min": min(x["rate"] for x in results[key]),
                "rate_max": max(x["rate"] for x in results[key]),
                "p50_ms": percentile(latencies[key], 50) * 1e3,
                "p99_ms": percentile(latencies[key], 99) * 1e3,
                "server_cpu": median(x["server_cpu"] for x in results[key]),
                "client_cpu": median(x["client_cpu"] for x in results[key]),
                "machine_cpu": median(x["machine_cpu"] for x in results[key]),
                "server_cpu_ms": median(
                    x["server_cpu"] * x["elapsed_s"] * 1e3 / x["n"] if x["n"] else math.nan for x in results[key]
                ),
                "requests": len(latencies[key]),
                "statuses": dict(statuses[key]),
                "cycles": sum(x.get("cycles", 0) for x in results[key]) if key == "ours_cycle" else None,
            }
            for key in SCENARIOS
        }
        paired = {f"{a}/{b}": median(ratio(x["rate"], y["rate"]) for x, y in zip(results[a], results[b], strict=True))
                  for _, a, b in COMPARISONS}
        locks = {key: lock_summary(series) for key, series in lock_totals.items()} if locks_measured else None
        return {"backend": backend, "summary": summary, "paired_rate_ratios": paired, "ledger_lock": locks,
                "rounds": results}
    finally:
        for c in clients:
            await c.aclose()


def render_report(args: argparse.Namespace, results: list[dict[str, Any]], open_entries: list[dict[str, Any]],
                  meta: dict[str, Any]) -> str:
    closed = "" if args.open_loop_only else (
        f"closed loop: {args.client} client, concurrency {args.concurrency}, {args.rounds} rounds x {args.requests} "
        f"requests per scenario, {args.concurrency} jobs for cycles; ")
    lines = [
        f"bench_negotiations  {meta['date']}  {meta['machine']}  code: {meta['git']}",
        f"uvicorn {meta['uvicorn']} ({meta['loop']}), fastapi {meta['fastapi']}, SQLAlchemy {meta['sqlalchemy']}, "
        f"httpx {meta['httpx']}; {closed}{args.jobs} jobs for requests, {args.hosts} hosts of {args.host_gpus} GPUs, "
        f"{args.worker_gpus} GPU(s) a worker; "
        f"{' then '.join(map(str, args.replicas))} server process(es) each, on one address"
        f"{quota_words(args.replica_cpu)}; load average at start {meta['loadavg']}",
    ]
    if results:
        lines.append("req/s: median over rounds (min-max), ratio: median of per-round ratios; latencies: percentiles "
                     "over all rounds' samples; CPU: server process / load generator, in cores; srv CPU ms/req: the "
                     "server's CPU time per answered request (median over rounds), the figure least moved by noise")
    trips = meta.get("round_trips") or {}
    if trips:
        lines.append("database round trips per request (statements incl. BEGIN, + COMMIT; SQLite, counted once "
                     "in-process): " + ", ".join(f"{k.removeprefix('ours_')} {v}" for k, v in trips.items())
                     + "; baseline POST /rows: 2 (INSERT, COMMIT)")
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
                f"{v['server_cpu']:.2f}/{v['client_cpu']:.2f}", fmt(v["server_cpu_ms"], "ms"), codes,
            ])
        held = res.get("throttled_s") or {}
        lines += ["", f"[{section_name(args, res)}]" + (
                  f" (held back by the quota: ours {held['ours']:.1f} s, baseline {held['baseline']:.1f} s)"
                  if args.replica_cpu else ""),
                  table(["scenario", "req/s", "range", "p50 ms", "p99 ms", "CPU srv/cli", "srv CPU ms/req",
                         "status counts"], rows)]
        cyc = s["ours_cycle"]
        lines.append(f"cycles: {cyc['cycles']} request+accept pairs completed, "
                     f"~{cyc['rate'] / 2:,.0f} negotiations/s carried out (scale up, then down, per job)")
        if locks := res.get("ledger_lock"):
            def said(key: str) -> str:
                got = locks.get(key, {"n": 0})
                if not got["n"]:
                    return "none"
                return (f"{got['n']}, mean {got['mean_ms']:.2f} / p50 ~{got['p50_ms']:.2f} / p99 ~{got['p99_ms']:.1f} "
                        "ms")
            lines.append(f"ledger lock in the cycles (the server's /v1/metrics; p50/p99 interpolated in its buckets): "
                         f"shared: waits {said('wait_shared')}, held {said('held_shared')}; host rows' waits "
                         f"{said('hosts_wait')}; whole ledger: waits {said('wait_whole')}, held {said('held_whole')}")
        ratio_rows = []
        for name, a, b in COMPARISONS:
            ratio_rows.append([name, fmt(res["paired_rate_ratios"][f"{a}/{b}"], "x"),
                               fmt(ratio(s[a]["p50_ms"], s[b]["p50_ms"]), "x"),
                               fmt(ratio(s[a]["p99_ms"], s[b]["p99_ms"]), "x")])
        lines += ["", table(["ours / baseline", "req/s", "p50", "p99"], ratio_rows)]
    if len(args.replicas) > 1 and results:
        lines += ["", *render_scaling(args, results)]
    if flagged:
        lines.append(f"* the load generator used >= {CLIENT_BOUND_CPU} of a core: that figure is bounded by the "
                     "client, not the server (try --client raw)")
    if open_entries:
        lines += ["", *render_open_loop(args, open_entries)]
    return "\n".join(lines)


def quota_words(cores: float | None) -> str:
    return f", each held to {cores:g} of a core's time (a cgroup CPU quota)" if cores else ""


def section_name(args: argparse.Namespace, entry: dict[str, Any]) -> str:
    """A backend, and its replica count where a run compares several."""
    if len(args.replicas) == 1:
        return str(entry["backend"])
    return f"{entry['backend']}, {entry['replicas']} replica{'s' if entry['replicas'] > 1 else ''}"


def render_scaling(args: argparse.Namespace, results: list[dict[str, Any]]) -> list[str]:
    """Per backend: each scenario's req/s at every replica count, its speed-up over the fewest replicas (linear: the
    count's own ratio), the server CPU per request (flat: no replica makes the others' requests dearer) and ours'
    ratio to the baseline at that count."""
    lines = [f"scaling with replicas{quota_words(args.replica_cpu)}: req/s (speed-up over {args.replicas[0]}; "
             f"linear = the replica ratio), server CPU ms per request, the whole machine's busy cores (of "
             f"{os.cpu_count()}; near all of them: the machine, not the replicas, was the limit)"]
    for backend in dict.fromkeys(r["backend"] for r in results):
        runs = sorted((r for r in results if r["backend"] == backend), key=lambda r: r["replicas"])
        first = runs[0]
        header = ["scenario", *(f"{r['replicas']} repl. req/s" for r in runs),
                  *(f"{r['replicas']} repl. ms/req" for r in runs), "machine busy, cores"]
        rows = []
        for key, (side, label) in SCENARIOS.items():
            rates = [r["summary"][key]["rate"] for r in runs]
            rows.append([
                f"{side:<8} {label}",
                *(fmt(rate, "/s") + ("" if r is first else f" ({ratio(rate, rates[0]):.2f}x)")
                  for r, rate in zip(runs, rates, strict=True)),
                *(fmt(r["summary"][key]["server_cpu_ms"], "ms") for r in runs),
                " / ".join(f"{r['summary'][key]['machine_cpu']:.2f}" for r in runs),
            ])
        for name, a, b in COMPARISONS:
            rows.append([f"ours / baseline: {name}",
                         *(fmt(r["paired_rate_ratios"][f"{a}/{b}"], "x") for r in runs), *("" for _ in runs), ""])
        lines += [f"[{backend}]", table(header, rows)]
    return lines


def render_open_loop(args: argparse.Namespace, entries: list[dict[str, Any]]) -> list[str]:
    """The open-loop table, one per backend, rows by rate then scenario, and what failed where anything did."""
    lines = [
        f"open loop: Poisson arrivals (seed {args.seed}), {args.open_warmup:g} s warm-up (not recorded) + "
        f"{args.open_duration:g} s recorded per scenario and rate; raw client, at most {args.open_connections} "
        f"keep-alive connections per server, one request at a time each; {args.open_connections} jobs for cycles",
        "latency from each arrival's scheduled time (incl. any wait for a connection; request + accept: per "
        "negotiation); percentiles and max over the recorded arrivals' 2xx answers; achieved = 2xx answers that came "
        "within the recorded window / its duration (below offered: the server fell behind); "
        f"target: p99 <= {OPEN_TARGET_P99_MS:g} ms with no non-2xx or error; CPU: server / load generator, in cores; "
        "srv CPU ms: the server's CPU time per recorded answer (request + accept: per negotiation)",
    ]
    target = f"p99 <= {OPEN_TARGET_P99_MS:g} ms"
    for backend in dict.fromkeys(section_name(args, e) for e in entries):
        rows, failures = [], []
        mine = sorted((e for e in entries if section_name(args, e) == backend),
                      key=lambda e: (e["offered_rate"], list(OPEN_SCENARIOS).index(e["scenario"])))
        for e in mine:
            name = f"{e['side']:<8} {e['label']}"
            rows.append([
                name, f"{e['offered_rate']:g}", f"{e['achieved_rate']:,.1f}", fmt(e["p50_ms"], "ms"),
                fmt(e["p90_ms"], "ms"), fmt(e["p99_ms"], "ms"), fmt(e["max_ms"], "ms"), str(e["non_2xx"]),
                str(e["errors"]), f"{e['server_cpu']:.2f}/{e['client_cpu']:.2f}", fmt(e["server_cpu_ms"], "ms"),
                "met" if e["met"] else "MISSED",
            ])
            bad = {k: v for k, v in e["statuses"].items() if not k.startswith("2")}
            if bad:
                failures.append(f"  {name} at {e['offered_rate']:g}/s: "
                                + ", ".join(f"{k}:{v}" for k, v in sorted(bad.items())))
        lines += ["", f"[{backend}] open loop",
                  table(["scenario", "offered/s", "achieved/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "non-2xx",
                         "errors", "CPU srv/cli", "srv CPU ms", target], rows)]
        if failures:
            lines += ["failed (status or error: count):", *failures]
    return lines


def parse_rates(ap: argparse.ArgumentParser, given: list[str]) -> list[float]:
    """`--rate` values, each a number or a comma list, in the order given (duplicates dropped)."""
    rates: list[float] = []
    for text in given:
        for part in filter(None, (p.strip() for p in text.split(","))):
            try:
                rate = float(part)
            except ValueError:
                ap.error(f"--rate: not a number: {part!r}")
            if not 0 < rate <= 10_000:
                ap.error(f"--rate must lie in (0, 10000] per second, not {part}")
            if rate not in rates:
                rates.append(rate)
    return rates


def parse_replicas(ap: argparse.ArgumentParser, text: str) -> list[int]:
    """`--replicas`: one count or a comma list, each 1-16, in rising order without repeats."""
    counts: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit() or not 1 <= int(part) <= 16:
            ap.error(f"--replicas: each count must be a whole number from 1 to 16, not {part!r}")
        counts.append(int(part))
    if not counts:
        ap.error("--replicas: give a count, or a comma list of counts")
    return sorted(set(counts))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, ~15 s")
    ap.add_argument("--rounds", type=int, help="rounds; each runs every scenario once (default 5, quick 2)")
    ap.add_argument("--requests", type=int, help="requests per scenario per round (default 100, quick 40)")
    ap.add_argument("--warmup", type=int, help="unrecorded requests per scenario first (default 30, quick 10)")
    ap.add_argument("--concurrency", type=int, default=32, help="concurrent requests (default 32)")
    ap.add_argument("--client", choices=["httpx", "raw"], default="httpx",
                    help="load generator (bench_api.py's): httpx.AsyncClient per connection (default), or raw")
    ap.add_argument("--cap", type=float, help="seconds cap per scenario run (default 10, quick 4)")
    ap.add_argument("--jobs", type=int, default=16, help="jobs the request -> offer scenario cycles over (16)")
    ap.add_argument("--hosts", type=int, default=2, help="hosts (default 2)")
    ap.add_argument("--host-gpus", type=int, default=HOST_GPUS,
                    help=f"GPUs per host (default {HOST_GPUS}: two hosts hold every job, so every accept writes one "
                         "of the\nsame two hosts' rows; 8 with --hosts 64 spreads the jobs, as a provider's "
                         "8-GPU hosts would)")
    ap.add_argument("--worker-gpus", type=int, default=1,
                    help="GPUs per worker of the bench's jobs (default 1: a grow fits the host the job runs on); "
                         "--worker-gpus 8 with --host-gpus 8 makes every grow need a new host, whose offer starts a "
                         "warm joiner there (api.services.standby: the whole ledger's lock, the host rewritten)")
    ap.add_argument("--postgres", nargs="?", const=DEFAULT_POSTGRES_URL, metavar="URL",
                    help=f"also run on PostgreSQL: a fresh database hz_bench_<random> on the server of URL, dropped "
                         f"afterwards (default {DEFAULT_POSTGRES_URL})")
    ap.add_argument("--no-sqlite", action="store_true", help="skip SQLite (with --postgres)")
    ap.add_argument("--dir", type=Path, help="parent of the temp dir for SQLite files and logs")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (databases, server logs)")
    ap.add_argument("--replicas", default="1", metavar="N[,N...]",
                    help="server processes for ours and for the baseline, on one address (as `harmonaize api "
                         "serve --replicas N`);\nfor PostgreSQL (default 1). A comma list runs each count in turn, "
                         "each on a fresh database,\nand adds a scaling table: --replicas 1,2,3")
    ap.add_argument("--replica-cpu", type=float, metavar="CORES",
                    help="hold every server process (ours' and the baseline's) to CORES of CPU time by a cgroup "
                         "quota of its own,\nso that N replicas fit the machine beside the database and the load "
                         "generator and their sum\nsays whether they scale (needs root and a cgroup CPU controller)")
    ap.add_argument("--rate", action="append", default=[], metavar="R",
                    help="open loop: offer R requests/s (request + accept: R negotiations/s) as Poisson arrivals, "
                         "after the closed loop;\nrepeat it or give a comma list for several rates: --rate 25 --rate "
                         "50, or --rate 25,50")
    ap.add_argument("--open-loop-only", action="store_true", help="skip the closed-loop scenarios (with --rate)")
    ap.add_argument("--open-duration", type=float, help="open loop: recorded seconds per scenario and rate "
                                                        "(default 20, quick 8)")
    ap.add_argument("--open-warmup", type=float, help="open loop: unrecorded seconds at the same rate first "
                                                      "(default 3, quick 2)")
    ap.add_argument("--open-connections", type=int, default=64,
                    help="open loop: keep-alive connections per server at most, one request at a time each; also "
                         "the jobs\nthe request + accept cycles take turns on (default 64)")
    ap.add_argument("--seed", type=int, default=1, help="open loop: seed of the arrival times (default 1)")
    ap.add_argument("--json", metavar="PATH", help="also write all figures as JSON to PATH ('-': stdout, no table)")
    args = ap.parse_args(argv)
    defaults = {"rounds": (5, 2), "requests": (100, 40), "warmup": (30, 10), "cap": (10.0, 4.0),
                "open_duration": (20.0, 8.0), "open_warmup": (3.0, 2.0)}
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    args.replicas = parse_replicas(ap, args.replicas)
    if args.replica_cpu is not None:
        if not 0.05 <= args.replica_cpu <= 64:
            ap.error(f"--replica-cpu must lie in [0.05, 64] cores, not {args.replica_cpu:g}")
        try:
            cpu_quota_root()
        except CpuQuotaError as exc:
            ap.error(f"--replica-cpu: {exc}")
    for name in ("rounds", "requests", "concurrency", "jobs", "hosts", "host_gpus", "worker_gpus",
                 "open_connections"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.worker_gpus > args.host_gpus:
        ap.error(f"--worker-gpus {args.worker_gpus} cannot exceed --host-gpus {args.host_gpus}: no worker would fit")
    if args.no_sqlite and not args.postgres:
        ap.error("--no-sqlite needs --postgres")
    args.rate = parse_rates(ap, args.rate)
    if args.open_loop_only and not args.rate:
        ap.error("--open-loop-only needs --rate")
    if not 0 < args.open_duration <= 600 or not 0 <= args.open_warmup <= 60:
        ap.error("--open-duration must lie in (0, 600] s and --open-warmup in [0, 60] s")
    args.json_only = args.json == "-"
    return args


async def bench(args: argparse.Namespace, workdir: Path,
                meta: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(closed-loop results per backend, open-loop entries of every backend)."""
    meta["round_trips"] = await count_statements(workdir, worker_gpus=args.worker_gpus, host_gpus=args.host_gpus)
    runs = []
    for replicas in args.replicas:
        if not args.no_sqlite:
            runs.append(await bench_backend(args, "sqlite", workdir, "", replicas))
        if args.postgres:
            name = f"hz_bench_{os.getpid()}_{secrets.token_hex(4)}"
            await bench_api._pg_execute(args.postgres, f'CREATE DATABASE "{name}"')
            try:
                runs.append(await bench_backend(args, "postgres", workdir, bench_api._pg_url(args.postgres, name),
                                                replicas))
            finally:
                await bench_api._pg_execute(args.postgres, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return [closed for closed, _ in runs if closed is not None], [e for _, entries in runs for e in entries]


def time_limit(args: argparse.Namespace) -> float:
    """The whole run's hard deadline: the closed loop's 20 minutes, plus each open-loop run's own bound."""
    backends = ((0 if args.no_sqlite else 1) + (1 if args.postgres else 0)) * len(args.replicas)
    per_run = float(args.open_warmup + args.open_duration) + OPEN_DRAIN_S + OPEN_SETTLE_S + 15
    return 1200.0 * len(args.replicas) + backends * len(args.rate) * len(OPEN_SCENARIOS) * per_run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="hz-bench-neg-", dir=args.dir))
    httptools = importlib.util.find_spec("httptools") is not None
    meta: dict[str, Any] = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_line(),
        "uvicorn": package_version("uvicorn"), "fastapi": package_version("fastapi"),
        "sqlalchemy": package_version("SQLAlchemy"),
        "httpx": package_version("httpx"),
        "loop": f"{event_loop_choice()}/{'httptools' if httptools else 'h11'}",
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "replicas": args.replicas,
        "replica_cpu": args.replica_cpu,
        "loadavg": loadavg(),
        "git": git_state(),
    }
    started = time.monotonic()
    try:
        results, open_entries = asyncio.run(asyncio.wait_for(bench(args, workdir, meta), timeout=time_limit(args)))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    meta["seconds"] = round(time.monotonic() - started, 1)
    if not args.json_only:
        print(render_report(args, results, open_entries, meta))
        print(f"\n(total {meta['seconds']} s)")
    if args.json:
        payload = {"meta": meta, "args": {k: v for k, v in vars(args).items() if k != "dir"}, "results": results,
                   "open_loop": open_entries}
        write_json(args.json, clean_nan(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
