#!/usr/bin/env python
"""Provider scale: `--hosts` simulated host agents (1,000) publishing at `--rate` Hz each (1) into `--tenants` tenants'
streams (100), each tenant's controller consuming its own events over its own account; then raw nats-py at the same
rate and fan-out on a plain nats-server, in the same run.

What runs (2 cores, loopback only):

* ours    `broker_config.server.NatsServer` with the rendered accounts (fsync as shipped), the control plane as a
          provider runs it (`harmonaize api serve`, SQLite) creating the tenants (an account, a stream and the
          imports each) and their jobs, `--fleet-procs` processes of agents (each host: its own
          `provider_agents.publisher.JetStreamPublisher`, `Nats-Msg-Id` = event id, retried until the PubAck; a
          Carbon CloudEvent for the job of tenant `host % tenants` every 1/rate s, open loop, hosts spread evenly over
          the second) and `--ctl-procs` processes of controllers (per tenant a `ControllerRuntime` exactly as
          `harmonaize controller run` builds it: its own NATS connection with the tenant's seed, its consumer created
          by the API and kept by the controller, in the broker's memory, as the SDK ships (`--position broker`: on
          the broker's disk), a SQLite `HandledStore`, one typed Carbon handler).
* raw     a plain nats-server (one account, a stream and a durable pull consumer per tenant on the broker's disk, as
          nats-py makes it, same configs, same fsync), the
          same fleet processes publishing the same bytes with `js.publish` (no publisher, no `Nats-Msg-Id`), and per
          tenant a raw pull consumer (`fetch` + `ack`) in the same controller processes.

Every Python process runs on the event loop the shipped ones choose (`harmonaize.event_loop`: uvloop where installed,
`HZ_EVENT_LOOP=asyncio` for asyncio's own), raw's publishers and consumers too, since they share the processes.

Figures per target: events published and delivered (unique ids at a handler; delivered / published must be 1),
duplicates, latency from the event's scheduled time to its handler (p50/p99/max over every event; an event not
delivered within `--grace` s counts as infinitely late), CPU in cores over the measured window of the broker, the
fleet, the controllers and the API, their resident memory at the end, and the broker's JetStream storage.

Run from the repository root: `python bench/bench_fleet_scale.py` (10 min of ours + 2 min of raw, ~15 min in all),
`--quick` (100 hosts, 10 tenants, 20 s each), `--help` for sizes, `--json PATH` for the figures as JSON.
No timed assertions: it prints figures. Every loop is bounded in count and in time; only loopback addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
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
    machine_line,
    proc_cpu_seconds,
    table,
    write_json,
)

ensure_repo_on_path()

import nats  # noqa: E402
from bench_broker import PlainServer  # noqa: E402
from bench_events import FleetProcess, _exit_with_parent  # noqa: E402

from harmonaize import event_loop  # noqa: E402
from harmonaize.broker_sync import check_sync_interval  # noqa: E402

HOST = "127.0.0.1"
ADMIN_TOKEN = "bench-fleet-scale-admin-token-0123456789"
PROVIDER_SECRET = "bench-fleet-scale-provider-secret-0123456789abcdef"
JOB = "train"
BUCKETS_PER_DECADE = 40
"""Latency histogram resolution: 40 log buckets per decade (~6 % wide), merged across processes."""


def bucket(seconds: float) -> int:
    return int(math.floor(math.log10(max(seconds, 1e-5)) * BUCKETS_PER_DECADE))


def percentile_of(histogram: dict[int, int], infinite: int, q: float) -> float:
    """The q-th percentile (seconds, bucket upper edge) of a merged histogram with `infinite` never-delivered."""
    total = sum(histogram.values()) + infinite
    if total == 0:
        return math.nan
    rank = q / 100 * total
    seen = 0
    for key in sorted(histogram):
        seen += histogram[key]
        if seen >= rank:
            return float(10 ** ((key + 1) / BUCKETS_PER_DECADE))
    return math.inf


def rss_mb(pid: int | None) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return math.nan


# ====================================================================================================================
# the fleet processes (`--role fleet`): agents publishing on a schedule, driven by JSON lines on stdin


async def fleet_role(args: argparse.Namespace) -> int:
    from broker_config.keys import ProviderKeys
    from harmonaize.events import agent_source
    from harmonaize.heap import freeze_startup_heap
    from harmonaize.pseudonyms import host_pseudonym
    from harmonaize.subjects import tenant_event_subject
    from provider_agents.publisher import JetStreamPublisher

    _exit_with_parent()
    spec = json.loads(Path(args.spec).read_text())
    tenants: list[str] = spec["tenants"]
    hosts = list(range(args.part, spec["hosts"], args.parts))
    secret = PROVIDER_SECRET.encode()
    seed = ProviderKeys(secret).provider.seed
    ours = [await nats.connect(spec["ours_url"], nkeys_seed_str=seed, allow_reconnect=False)
            for _ in range(args.connections)]
    plain = [await nats.connect(spec["raw_url"], allow_reconnect=False) for _ in range(args.connections)]
    publishers = {h: JetStreamPublisher(ours[i % len(ours)].jetstream(), ack_timeout_s=2.0)
                  for i, h in enumerate(hosts)}
    for publisher in publishers.values():
        publisher.start()
    sources = {h: agent_source(host_pseudonym(secret, tenants[h % len(tenants)], f"host-{h:04d}")) for h in hosts}
    subjects = {h: tenant_event_subject(tenants[h % len(tenants)], "carbon", JOB) for h in hosts}
    freeze_startup_heap()  # as each `harmonaize agent` does once started
    try:
        return await _serve_commands(lambda cmd: _play(cmd, hosts, spec["hosts"], publishers, plain, sources,
                                                       subjects))
    finally:
        for publisher in publishers.values():
            await publisher.close(drain_timeout=1.0)
        for nc in ours + plain:
            await nc.close()


async def _play(cmd: dict[str, Any], hosts: list[int], total_hosts: int, publishers: dict[int, Any],
                plain: list[Any], sources: dict[int, str], subjects: dict[int, str]) -> dict[str, Any]:
    """One target's publishing: every host of this process on its schedule for `seconds`, then the figures."""
    from harmonaize.events import CarbonIntensity, make_event

    target, seconds, period = cmd["target"], float(cmd["seconds"]), 1.0 / float(cmd["rate"])
    start = time.monotonic() + max(0.0, cmd["start_at"] - time.time())
    end = start + seconds
    offset = time.time() - time.monotonic()
    counts = {"published": 0, "errors": 0}
    late: list[float] = []

    async def host_loop(h: int) -> None:
        due = start + (h / total_hosts) * period  # the hosts spread evenly over each period
        conn = plain[h % len(plain)].jetstream()
        while due < end:
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)  # the schedule itself: publish at the host's next due time
            else:
                late.append(-wait)
            at = dt.datetime.fromtimestamp(due + offset, dt.UTC)
            event = make_event(CarbonIntensity(g_per_kwh=200.0, observed_at=at, region="DE"),
                               source=sources[h], subject=JOB, time=at)
            if target == "ours":
                await publishers[h].submit(subjects[h], event)
                counts["published"] += 1
            else:
                try:
                    await conn.publish(subjects[h], event.to_json_bytes(), timeout=2.0)
                    counts["published"] += 1
                except Exception:
                    counts["errors"] += 1
            due += period

    cpu0 = time.process_time()
    await asyncio.wait_for(asyncio.gather(*(host_loop(h) for h in hosts)), seconds + 60)
    if target == "ours":
        for publisher in publishers.values():
            if not await publisher.drain(max(0.1, end + 10 - time.monotonic())):
                counts["errors"] += 1
                break
    elapsed = max(1e-9, time.monotonic() - start)
    ours = target == "ours"
    return {
        **counts,
        "confirmed": sum(p.published for p in publishers.values()) if ours else counts["published"],
        "retries": sum(p.retries for p in publishers.values()) if ours else 0,
        "late_p99_ms": sorted(late)[int(0.99 * (len(late) - 1))] * 1e3 if late else 0.0,
        "cpu": (time.process_time() - cpu0) / elapsed,
    }


async def _serve_commands(answer: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> int:
    """Say ready, then answer each JSON command line on stdin with one JSON line, until `quit` or end of input."""
    print(json.dumps({"ready": True}), flush=True)
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line.strip():
            return 0
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            return 0
        print(json.dumps(await answer(cmd)), flush=True)


# ====================================================================================================================
# the controller processes (`--role controllers`): per tenant a ControllerRuntime (ours) and a raw pull consumer


class Tally:
    """What reached the handlers of one target: unique ids, duplicates, a latency histogram."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.duplicates = 0
        self.histogram: dict[int, int] = {}

    def hit(self, event_id: str, at: float) -> None:
        if event_id in self.ids:
            self.duplicates += 1
            return
        self.ids.add(event_id)
        key = bucket(time.time() - at)
        self.histogram[key] = self.histogram.get(key, 0) + 1

    def report(self) -> dict[str, Any]:
        return {"delivered": len(self.ids), "duplicates": self.duplicates, "histogram": self.histogram}


async def controllers_role(args: argparse.Namespace) -> int:
    from broker_config.render import tenant_stream_name
    from broker_config.streams import tenant_pull_consumer
    from harmonaize.events import CarbonIntensity, CloudEvent
    from harmonaize.heap import freeze_startup_heap
    from tenant_controllers import Controller
    from tenant_controllers.api_client import ProviderApi
    from tenant_controllers.nats_source import NatsEventSource
    from tenant_controllers.runtime import ControllerRuntime
    from tenant_controllers.store import HandledStore

    _exit_with_parent()
    spec = json.loads(Path(args.spec).read_text())
    mine = spec["credentials"][args.part::args.parts]
    tallies = {"ours": Tally(), "raw": Tally()}
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    closers: list[Any] = []
    workdir = Path(args.spec).parent

    for cred in mine:
        ctl = Controller(tenant=cred["tenant"], job=JOB, name="scale")

        @ctl.on(CarbonIntensity, id="on_carbon")
        async def on_carbon(event: CarbonIntensity, envelope: CloudEvent[CarbonIntensity]) -> None:
            tallies["ours"].hit(envelope.id, envelope.time.timestamp())

        api = ProviderApi(base_url=spec["api_url"], token=cred["token"])
        closers.append(api)
        source = NatsEventSource(servers=spec["ours_url"], seed=cred["seed"], api=api, position=spec["position"])
        store = HandledStore(workdir / f"handled-{cred['tenant']}.sqlite3")
        runtime = ControllerRuntime(ctl, source=source, api=api, store=store, drain_timeout=5.0)
        tasks.append(asyncio.create_task(runtime.run(stop)))
        deadline = Deadline(60)
        while not runtime.ready.is_set() and not deadline.expired:
            await asyncio.sleep(0.05)  # polling one runtime's readiness before starting the next
        if not runtime.ready.is_set():
            raise RuntimeError(f"{cred['tenant']}: the controller runtime did not become ready")

    raw = await nats.connect(spec["raw_url"], allow_reconnect=False)
    closers.append(raw)

    async def raw_consumer(tenant: str) -> None:
        sub = await raw.jetstream().pull_subscribe_bind("scale", stream=tenant_stream_name(tenant))
        while not stop.is_set():
            try:
                msgs = await sub.fetch(16, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            for msg in msgs:
                body = json.loads(msg.data)
                tallies["raw"].hit(body["id"], dt.datetime.fromisoformat(body["time"]).timestamp())
                await msg.ack()

    for cred in mine:
        await raw.jetstream().add_consumer(tenant_stream_name(cred["tenant"]),
                                           tenant_pull_consumer(cred["tenant"], "scale"))
        tasks.append(asyncio.create_task(raw_consumer(cred["tenant"])))
    freeze_startup_heap()  # as `harmonaize controller run` does
    async def report(cmd: dict[str, Any]) -> dict[str, Any]:
        return tallies[cmd["target"]].report()

    try:
        return await _serve_commands(report)
    finally:
        stop.set()
        await asyncio.wait(tasks, timeout=15)
        for closer in closers:
            await closer.close()


# ====================================================================================================================
# the orchestration (this process)


async def bench(args: argparse.Namespace, workdir: Path, meta: dict[str, Any]) -> dict[str, Any]:
    import httpx

    from broker_config.keys import ProviderKeys
    from broker_config.render import render_accounts
    from broker_config.server import NatsServer, free_port
    from broker_config.streams import tenant_events_stream

    secret = PROVIDER_SECRET.encode()
    ours_server = NatsServer(workdir / "ours", accounts_text=render_accounts(ProviderKeys(secret), []), host=HOST,
                             server_name="bench-ours", sync_interval=args.sync)
    plain = PlainServer(workdir / "plain", sync_interval=args.sync, name="bench-plain")
    api_port = free_port(HOST)
    api_url = f"http://{HOST}:{api_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HZ_")} | {
        "HZ_DATA_DIR": str(workdir / "api"), "HZ_NATS_URL": ours_server.url, "HZ_ADMIN_TOKEN": ADMIN_TOKEN,
        "HZ_PROVIDER_SECRET": PROVIDER_SECRET, "HZ_API_HOST": HOST, "HZ_API_PORT": str(api_port),
        "HZ_BROKER_CONFIG_FILE": str(ours_server.config_file), "HZ_BROKER_PID_FILE": str(ours_server.pid_file),
        "HZ_NEGOTIATION_RATE_PER_S": "0",
    }
    api: subprocess.Popen[bytes] | None = None
    fleets: list[FleetProcess] = []
    ctls: list[FleetProcess] = []
    results: dict[str, Any] = {}
    try:
        ours_server.start()
        plain.start()
        with open(workdir / "api.log", "ab") as log:
            api = subprocess.Popen(
                [sys.executable, "-m", "harmonaize_cli", "api", "serve", "--migrate", "--broker-reload", "pid-file",
                 "--log-level", "warning", "--no-json-logs"],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(Path(__file__).resolve().parent.parent))
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        credentials = []
        async with httpx.AsyncClient(base_url=api_url, timeout=60.0) as client:
            deadline = Deadline(120)
            while True:
                try:
                    if (await client.get("/v1/healthz")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if deadline.expired or api.poll() is not None:
                    raise RuntimeError(f"the API did not start: see {workdir / 'api.log'}")
                await asyncio.sleep(0.1)
            for i in range(args.tenants):
                tenant = f"t{i:03d}"
                reply = await client.post("/v1/tenants", json={"id": tenant, "display_name": tenant}, headers=admin)
                if reply.status_code != 201:
                    raise RuntimeError(f"create tenant {tenant}: {reply.status_code} {reply.text[:300]}")
                created = reply.json()
                credentials.append({"tenant": tenant, "token": created["api_token"], "seed": created["nats"]["seed"]})
                job = await client.post("/v1/jobs", json={"id": JOB, "min_workers": 1, "max_workers": 1},
                                        headers={"Authorization": f"Bearer {created['api_token']}"})
                if job.status_code != 201:
                    raise RuntimeError(f"create job of {tenant}: {job.status_code} {job.text[:300]}")
        plain_nc = await nats.connect(plain.url, allow_reconnect=False)
        for cred in credentials:
            await plain_nc.jetstream().add_stream(tenant_events_stream(cred["tenant"]))
        await plain_nc.close()
        spec = workdir / "spec.json"
        spec.write_text(json.dumps({"ours_url": ours_server.url, "raw_url": plain.url, "api_url": api_url,
                                    "hosts": args.hosts, "tenants": [c["tenant"] for c in credentials],
                                    "position": args.position,
                                    "credentials": credentials}))
        me = str(Path(__file__).resolve())
        for part in range(args.ctl_procs):
            ctls.append(FleetProcess([sys.executable, me, "--role", "controllers", "--spec", str(spec), "--part",
                                      str(part), "--parts", str(args.ctl_procs)], workdir / f"ctl-{part}.log"))
        for part in range(args.fleet_procs):
            fleets.append(FleetProcess([sys.executable, me, "--role", "fleet", "--spec", str(spec), "--part",
                                        str(part), "--parts", str(args.fleet_procs), "--connections",
                                        str(args.connections)], workdir / f"fleet-{part}.log"))
        for proc in ctls + fleets:
            await proc.start(timeout=300)
        pids: dict[str, list[int | None]] = {
            "broker": [ours_server.pid], "api": [api.pid], "fleet": [f.pid for f in fleets],
            "controllers": [c.pid for c in ctls],
        }
        for target, seconds in (("ours", args.seconds), ("raw", args.raw_seconds)):
            if target == "raw":
                pids["broker"] = [plain._proc.pid if plain._proc else None]
            cpu0 = {k: sum(proc_cpu_seconds(p) for p in v) for k, v in pids.items()}
            t0 = time.monotonic()
            start_at = time.time() + 2.0
            sent = await asyncio.gather(*(f.run({"target": target, "seconds": seconds, "rate": args.rate,
                                                 "start_at": start_at}, timeout=seconds + 120) for f in fleets))
            window = time.monotonic() - t0
            cpu = {k: (sum(proc_cpu_seconds(p) for p in v) - cpu0[k]) / window for k, v in pids.items()}
            published = sum(s["confirmed"] for s in sent)
            deadline = Deadline(args.grace)
            while True:
                got = await asyncio.gather(*(c.run({"target": target}, timeout=60) for c in ctls))
                delivered = sum(g["delivered"] for g in got)
                if delivered >= published or deadline.expired:
                    break
                await asyncio.sleep(0.5)  # the controllers catching up with what is still queued
            histogram: dict[int, int] = {}
            for g in got:
                for key, count in g["histogram"].items():
                    histogram[int(key)] = histogram.get(int(key), 0) + count
            missing = max(0, published - delivered)
            storage = await jetstream_storage(ours_server.url if target == "ours" else plain.url,
                                              ProviderKeys(secret).provider.seed if target == "ours" else None)
            results[target] = {
                "seconds": seconds, "published": published, "delivered": delivered,
                "delivered_ratio": delivered / published if published else math.nan,
                "duplicates": sum(g["duplicates"] for g in got), "missing": missing,
                "publish_errors": sum(s["errors"] for s in sent), "retries": sum(s["retries"] for s in sent),
                "fleet_late_p99_ms": max(s["late_p99_ms"] for s in sent),
                "p50_ms": percentile_of(histogram, missing, 50) * 1e3,
                "p99_ms": percentile_of(histogram, missing, 99) * 1e3,
                "max_ms": percentile_of(histogram, missing, 100) * 1e3,
                "cpu_cores": cpu,
                "rss_mb": {k: sum(rss_mb(p) for p in v) for k, v in pids.items()},
                "jetstream_storage_mb": storage / 2**20,
            }
            if not args.json_only:
                print(f"  {target}: {published} published, {delivered} delivered", file=sys.stderr, flush=True)
    finally:
        for proc in fleets + ctls:
            await proc.stop()
        if api is not None and api.poll() is None:
            api.terminate()
            try:
                api.wait(20)
            except subprocess.TimeoutExpired:
                api.kill()
        ours_server.stop()
        plain.stop()
    return results


async def jetstream_storage(url: str, seed: str | None) -> float:
    """Bytes the account's streams hold on disk (the provider's account on ours: every tenant's stream)."""
    nc = await nats.connect(url, allow_reconnect=False, **({"nkeys_seed_str": seed} if seed else {}))
    try:
        info = await nc.jetstream().account_info()
        return float(info.storage)
    finally:
        await nc.close()


def render(args: argparse.Namespace, results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        f"bench_fleet_scale  {meta['date']}  {meta['machine']}  code: {meta['git']}",
        f"{args.hosts} hosts at {args.rate:g} Hz into {args.tenants} tenants' streams ({args.hosts * args.rate:g} "
        f"events/s), {args.fleet_procs} fleet and {args.ctl_procs} controller processes; ours {args.seconds:g} s, "
        f"raw {args.raw_seconds:g} s; JetStream sync_interval {args.sync} on both brokers; ours' consumers kept by "
        f"the {'controller (broker memory)' if args.position == 'reader' else 'broker (its disk)'}; event loop "
        f"{meta['event_loop']} in every Python process; load average at start {meta['loadavg']}",
        "latency: the event's scheduled time to its handler, over every event (undelivered counts as infinite); "
        "CPU in cores over the window; memory: resident at the end",
        "",
    ]
    rows = []
    for target, r in results.items():
        cpu, rss = r["cpu_cores"], r["rss_mb"]
        rows.append([target, str(r["published"]), str(r["delivered"]), f"{r['delivered_ratio']:.4f}",
                     str(r["duplicates"]), fmt(r["p50_ms"], "ms"), fmt(r["p99_ms"], "ms"), fmt(r["max_ms"], "ms"),
                     f"{cpu['broker']:.2f}", f"{cpu['fleet']:.2f}", f"{cpu['controllers']:.2f}", f"{cpu['api']:.2f}",
                     f"{rss['broker']:.0f}/{rss['fleet']:.0f}/{rss['controllers']:.0f}/{rss['api']:.0f}",
                     f"{r['jetstream_storage_mb']:.1f}"])
    lines.append(table(["target", "published", "delivered", "ratio", "dup", "p50 ms", "p99 ms", "max ms",
                        "broker", "fleet", "ctl", "api", "RSS MB b/f/c/a", "JS MB"], rows))
    if "ours" in results:
        ours = results["ours"]
        cores = ours["cpu_cores"]["broker"] + ours["cpu_cores"]["fleet"]
        lines += ["", f"targets: broker + fleet < 1 core: {cores:.2f}; p99 < 50 ms: {fmt(ours['p99_ms'], 'ms')} ms; "
                  f"nothing lost: {ours['missing'] == 0}"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100 hosts, 10 tenants, 20 s per target")
    ap.add_argument("--hosts", type=int, help="simulated hosts (default 1000, quick 100)")
    ap.add_argument("--tenants", type=int, help="tenants, one job and one controller each (default 100, quick 10)")
    ap.add_argument("--rate", type=float, default=1.0, help="events per second per host (default 1)")
    ap.add_argument("--seconds", type=float, help="ours: seconds of publishing (default 600, quick 20)")
    ap.add_argument("--raw-seconds", type=float, help="raw: seconds of publishing (default 120, quick 20)")
    ap.add_argument("--grace", type=float, default=30.0, help="seconds the consumers get to catch up (default 30)")
    ap.add_argument("--fleet-procs", type=int, default=2, help="processes playing the hosts (default 2)")
    ap.add_argument("--ctl-procs", type=int, default=2, help="processes running the controllers (default 2)")
    ap.add_argument("--connections", type=int, default=8, help="NATS connections per fleet process (default 8)")
    ap.add_argument("--sync", default="always",
                    help="JetStream sync_interval of both brokers: always (default, as shipped: an fsync before every "
                         "PubAck and an fsync'd rewrite of a consumer's state file up to 10 times a second) or a "
                         "period such as 1s (HZ_BROKER_SYNC_INTERVAL), to see what that durability costs")
    ap.add_argument("--position", choices=["reader", "broker"], default="reader",
                    help="who keeps ours' consumer positions: reader (default, as the SDK ships: the broker holds "
                         "the consumer in memory, the controller records its ack floor) or broker (on its disk, as "
                         "raw's are)")
    ap.add_argument("--dir", type=Path, help="parent of the temp dir (stores, logs)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH ('-': stdout, no table)")
    ap.add_argument("--role", choices=["fleet", "controllers"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--part", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--parts", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name, (full, small) in {"hosts": (1000, 100), "tenants": (100, 10), "seconds": (600.0, 20.0),
                                "raw_seconds": (120.0, 20.0)}.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    for name in ("hosts", "tenants", "fleet_procs", "ctl_procs", "connections"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.rate <= 0 or args.seconds <= 0 or args.raw_seconds <= 0:
        ap.error("--rate, --seconds and --raw-seconds must be positive")
    try:
        check_sync_interval(args.sync)
    except ValueError as exc:
        ap.error(f"--sync: {exc}")
    args.json_only = args.json == "-"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loop = event_loop_choice()
    if args.role == "fleet":
        return event_loop.run(fleet_role(args), choice=loop)
    if args.role == "controllers":
        return event_loop.run(controllers_role(args), choice=loop)
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="hz-bench-scale-", dir=args.dir))
    meta: dict[str, Any] = {"date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                            "machine": machine_line(), "git": git_state(), "loadavg": loadavg(),
                            "event_loop": loop,
                            "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}
    started = time.monotonic()
    try:
        budget = args.seconds + args.raw_seconds + 2 * args.grace + 900
        results = event_loop.run(asyncio.wait_for(bench(args, workdir, meta), timeout=budget), choice=loop)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    meta["seconds"] = round(time.monotonic() - started, 1)
    if not args.json_only:
        print(render(args, results, meta))
        print(f"\n(total {meta['seconds']} s)")
    if args.json:
        write_json(args.json, clean_nan({"meta": meta, "args": {k: v for k, v in vars(args).items()
                                                                 if k not in ("role", "spec", "part", "parts")},
                                         "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
