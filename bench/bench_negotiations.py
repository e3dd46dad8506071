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

Run from the repository root: `python bench/bench_negotiations.py` (~60-80 s), `--quick` (~15 s),
`--postgres [URL]` to repeat on PostgreSQL (a fresh database, dropped afterwards), `--replicas N` to serve each side
from N processes sharing one socket (scaling on PostgreSQL: compare runs at 1 and N), `--help` for sizes.
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
import secrets
import shutil
import sys
import tempfile
import time
from collections import Counter
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
from bench_api import (  # noqa: E402
    ADMIN_TOKEN,
    CLIENT_BOUND_CPU,
    DEFAULT_POSTGRES_URL,
    HOST_GPUS,
    LoadClients,
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
        await ok("POST", "/v1/hosts", {"id": f"h{i:03d}", "gpus": HOST_GPUS, "locality_group": f"rack-{i % 4}"}, admin)
    body = {"min_workers": 1, "max_workers": 4, "initial_workers": 1}
    for j in range(args.jobs):
        await ok("POST", "/v1/jobs", {"id": f"neg-{j:03d}", **body}, tenant)
    for w in range(args.concurrency):
        await ok("POST", "/v1/jobs", {"id": f"cyc-{w:03d}", **body}, tenant)
    # the replayed request: answered once here, then sent again with the same key in the replay scenario
    replay = scale_body("neg-000", 2)
    await ok("POST", "/v1/negotiations", replay, {**tenant, "Idempotency-Key": "bench-replay"})
    return {"tenant": tenant, "replay": replay}


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

    cpu0, own0 = server.cpu_seconds(), time.process_time()
    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - start
    cpu1, own1 = server.cpu_seconds(), time.process_time()
    return {
        "n": len(latencies),
        "cycles": cycles[0],
        "elapsed_s": elapsed,
        "rate": len(latencies) / elapsed if elapsed else 0.0,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "server_cpu": (cpu1 - cpu0) / elapsed if elapsed else math.nan,
        "client_cpu": (own1 - own0) / elapsed if elapsed else math.nan,
        "statuses": dict(statuses),
        "latencies": latencies,
    }


async def count_statements(workdir: Path, database_url: str = "") -> dict[str, int]:
    """Database round trips per request of each scenario (SQL statements incl. BEGIN, plus commits), counted once
    with a SQLAlchemy cursor listener on an in-process app (httpx.ASGITransport) with its own fresh SQLite file."""
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
            args = argparse.Namespace(hosts=1, jobs=1, concurrency=1)
            setup = await setup_ours(client, args)
            tenant = setup["tenant"]

            async def measure(name: str, method: str, path: str, body: Any, headers: dict[str, str]) -> Any:
                counts.clear()
                reply = await client.request(method, path, json=body, headers=headers)
                out[name] = counts["statements"] + counts["commits"]
                return reply.json()

            offer = await measure("ours_request", "POST", "/v1/negotiations", scale_body("cyc-000", 2),
                                  {**tenant, "Idempotency-Key": "count-1"})
            await measure("ours_replay", "POST", "/v1/negotiations", scale_body("cyc-000", 2),
                          {**tenant, "Idempotency-Key": "count-1"})
            await measure("ours_accept", "POST", f"/v1/negotiations/{offer['id']}/accept", {"option": 0}, tenant)
    return out


async def bench_backend(args: argparse.Namespace, backend: str, workdir: Path, database_url: str) -> dict[str, Any]:
    from api.migrate import upgrade_async

    data_dir = workdir / backend
    data_dir.mkdir(parents=True, exist_ok=True)
    ours = ServerProcess("ours", data_dir, database_url, replicas=args.replicas)
    base = ServerProcess("baseline", data_dir, database_url, replicas=args.replicas)
    clients: list[LoadClients] = []
    try:
        base.start()
        await upgrade_async(ours_settings(data_dir, database_url))
        ours.start()
        await ours.wait_ready("/v1/healthz")
        await base.wait_ready("/ping")
        async with httpx.AsyncClient(base_url=ours.url, timeout=30.0) as setup_client:
            setup = await setup_ours(setup_client, args)
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

        async def run(key: str, n: int) -> dict[str, Any]:
            if key == "ours_cycle":
                return await run_cycles(ours_clients, tenant, n, args.concurrency, args.cap, ours, cycle_state,
                                        f"{tag}-{next(keys)}")
            client, server = (ours_clients, ours) if SCENARIOS[key][0] == "ours" else (base_clients, base)
            return await run_load(client, makers[key], n, args.concurrency, args.cap, server)

        for key in SCENARIOS:  # warm-up, not recorded
            await run(key, args.warmup)
        keys_order = list(SCENARIOS)
        for r in range(args.rounds):
            order = keys_order[r % len(keys_order):] + keys_order[: r % len(keys_order)]
            for key in order:
                result = await run(key, args.requests)
                latencies[key] += result.pop("latencies")
                statuses[key].update(result["statuses"])
                results[key].append(result)
            if not args.json_only:
                print(f"  {backend}: round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
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
                "requests": len(latencies[key]),
                "statuses": dict(statuses[key]),
                "cycles": sum(x.get("cycles", 0) for x in results[key]) if key == "ours_cycle" else None,
            }
            for key in SCENARIOS
        }
        paired = {f"{a}/{b}": median(ratio(x["rate"], y["rate"]) for x, y in zip(results[a], results[b], strict=True))
                  for _, a, b in COMPARISONS}
        return {"backend": backend, "summary": summary, "paired_rate_ratios": paired, "rounds": results}
    finally:
        for c in clients:
            await c.aclose()
        ours.stop()
        base.stop()


def render_report(args: argparse.Namespace, results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"bench_negotiations  {meta['date']}  {meta['machine']}  code: {meta['git']}",
        f"uvicorn {meta['uvicorn']} ({meta['loop']}), fastapi {meta['fastapi']}, SQLAlchemy {meta['sqlalchemy']}, "
        f"httpx {meta['httpx']}; load: {args.client} client, concurrency {args.concurrency}; {args.rounds} rounds x "
        f"{args.requests} requests per scenario; {args.jobs} jobs for requests, {args.concurrency} for cycles, "
        f"{args.hosts} hosts; {args.replicas} server process(es) each, sharing one socket; load average at start "
        f"{meta['loadavg']}",
        "req/s: median over rounds (min-max), ratio: median of per-round ratios; latencies: percentiles over all "
        "rounds' samples; CPU: server process / load generator, in cores",
    ]
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
                f"{v['server_cpu']:.2f}/{v['client_cpu']:.2f}", codes,
            ])
        lines += ["", f"[{res['backend']}]",
                  table(["scenario", "req/s", "range", "p50 ms", "p99 ms", "CPU srv/cli", "status counts"], rows)]
        cyc = s["ours_cycle"]
        lines.append(f"cycles: {cyc['cycles']} request+accept pairs completed, "
                     f"~{cyc['rate'] / 2:,.0f} negotiations/s carried out (scale up, then down, per job)")
        ratio_rows = []
        for name, a, b in COMPARISONS:
            ratio_rows.append([name, fmt(res["paired_rate_ratios"][f"{a}/{b}"], "x"),
                               fmt(ratio(s[a]["p50_ms"], s[b]["p50_ms"]), "x"),
                               fmt(ratio(s[a]["p99_ms"], s[b]["p99_ms"]), "x")])
        lines += ["", table(["ours / baseline", "req/s", "p50", "p99"], ratio_rows)]
    if flagged:
        lines.append(f"* the load generator used >= {CLIENT_BOUND_CPU} of a core: that figure is bounded by the "
                     "client, not the server (try --client raw)")
    return "\n".join(lines)


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
    ap.add_argument("--hosts", type=int, default=2, help=f"hosts of {HOST_GPUS} GPUs (default 2)")
    ap.add_argument("--postgres", nargs="?", const=DEFAULT_POSTGRES_URL, metavar="URL",
                    help=f"also run on PostgreSQL: a fresh database hz_bench_<random> on the server of URL, dropped "
                         f"afterwards (default {DEFAULT_POSTGRES_URL})")
    ap.add_argument("--no-sqlite", action="store_true", help="skip SQLite (with --postgres)")
    ap.add_argument("--dir", type=Path, help="parent of the temp dir for SQLite files and logs")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (databases, server logs)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="server processes for ours and for the baseline, sharing one socket (as `harmonaize api "
                         "serve --replicas N`); for PostgreSQL (default 1)")
    ap.add_argument("--json", metavar="PATH", help="also write all figures as JSON to PATH ('-': stdout, no table)")
    args = ap.parse_args(argv)
    defaults = {"rounds": (5, 2), "requests": (100, 40), "warmup": (30, 10), "cap": (10.0, 4.0)}
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    for name in ("rounds", "requests", "concurrency", "jobs", "hosts", "replicas"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if args.no_sqlite and not args.postgres:
        ap.error("--no-sqlite needs --postgres")
    args.json_only = args.json == "-"
    return args


async def bench(args: argparse.Namespace, workdir: Path, meta: dict[str, Any]) -> list[dict[str, Any]]:
    meta["round_trips"] = await count_statements(workdir)
    results = []
    if not args.no_sqlite:
        results.append(await bench_backend(args, "sqlite", workdir, ""))
    if args.postgres:
        name = f"hz_bench_{os.getpid()}_{secrets.token_hex(4)}"
        await bench_api._pg_execute(args.postgres, f'CREATE DATABASE "{name}"')
        try:
            results.append(await bench_backend(args, "postgres", workdir, bench_api._pg_url(args.postgres, name)))
        finally:
            await bench_api._pg_execute(args.postgres, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return results


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
        "loadavg": loadavg(),
        "git": git_state(),
    }
    started = time.monotonic()
    try:
        results = asyncio.run(asyncio.wait_for(bench(args, workdir, meta), timeout=1200))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    meta["seconds"] = round(time.monotonic() - started, 1)
    if not args.json_only:
        print(render_report(args, results, meta))
        print(f"\n(total {meta['seconds']} s)")
    if args.json:
        payload = {"meta": meta, "args": {k: v for k, v in vars(args).items() if k != "dir"}, "results": results}
        write_json(args.json, clean_nan(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
