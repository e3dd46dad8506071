#!/usr/bin/env python
"""Broker benchmark: our tenant-isolated JetStream path against raw nats-py on a plain nats-server, in one run.

Three nats-servers from the same binary (`broker_config.server.nats_server_binary()`), each on a free loopback port:

* ours        `broker_config.server.NatsServer` with our rendered accounts (SYS, PROVIDER, T_acme, T_globex, applied
              by `NatsTenantBroker.apply`) and a tenant pull consumer from `ensure_consumer`, exactly as
              tests/conftest.py does. The provider publishes in PROVIDER; the tenant reads with its own nkey seed
              through the imported pull API (`nc.jetstream(prefix=creds.js_api_prefix)`).
* plain       a minimal config written here: no accounts, JetStream file store with `sync_interval: always` (the
              same store setting as ours), one account, raw nats-py. This is the baseline for the ratios.
* plain-nosync  the same without `sync_interval: always` (nats-server's default, fsync every 2 min): shows what the
              fsync on every write costs, nothing else.

All three get the same stream and consumer configuration (`tenant_events_stream("acme")`,
`tenant_pull_consumer("acme", "bench")`), the same subject and payload. Every round runs each phase on the three
servers back to back (so compared figures are taken seconds apart), rotating the order of the servers each round.
Rates are medians over rounds and their ratios medians of the per-round ratios; latency percentiles pool all rounds'
samples. Phases (per server, per round):

  a  publish one by one (`await js.publish`) and pipelined (`js.publish_async`, bounded window, then await all acks)
  b  consume what was just published: `fetch(batch)` + `ack()` each, until drained
  c  end-to-end: the consumer long-polls `fetch(1)`; time from the provider's publish to the fetch returning
  d  (after the rounds) control plane: `NatsTenantBroker.apply` adding one tenant at runtime and the time from
     apply's start to the new tenant's first successful fetch, against creating the same stream + consumer on the
     plain server (what one account without isolation would need).

Run from the repository root: `python bench/bench_broker.py` (~60 s), `--quick` (~10 s), `--help` for sizes.
No timed assertions: it prints figures. Every loop is bounded in count and in time; only loopback addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from _benchutil import (
    Deadline,
    clean_nan,
    ensure_repo_on_path,
    fmt,
    git_state,
    loadavg,
    machine_line,
    median,
    percentile,
    ratio,
    table,
    write_json,
)

ensure_repo_on_path()

import nats  # noqa: E402
import nats.errors  # noqa: E402
from nats.aio.client import Client  # noqa: E402
from nats.js.client import JetStreamContext  # noqa: E402

import broker_config.provisioner as provisioner  # noqa: E402
from broker_config.accounts import TenantAccount, UserKeys  # noqa: E402
from broker_config.keys import ProviderKeys  # noqa: E402
from broker_config.provisioner import NatsTenantBroker, connect_with_seed  # noqa: E402
from broker_config.render import render_accounts, tenant_stream_name  # noqa: E402
from broker_config.server import NatsServer, free_port, nats_server_binary  # noqa: E402
from broker_config.streams import tenant_events_stream, tenant_pull_consumer  # noqa: E402
from harmonaize.events import EventKind  # noqa: E402
from harmonaize.subjects import tenant_event_subject  # noqa: E402

HOST = "127.0.0.1"
PROVIDER_SECRET = b"bench-provider-secret-0123456789abcdef"
TENANT = "acme"
SUBJECT = tenant_event_subject(TENANT, EventKind.CARBON, "j1")
CONSUMER = "bench"
TIMEOUTS = (asyncio.TimeoutError, nats.errors.TimeoutError)


# --------------------------------------------------------------------------------------------------------------------
# servers


class PlainServer:
    """A nats-server with a minimal config written here: no accounts, JetStream file store, loopback only."""

    def __init__(
        self, directory: Path, *, name: str, sync_always: bool = False, sync_interval: str | None = None
    ) -> None:
        self.directory = directory
        self.sync_interval = "always" if sync_always else sync_interval
        """What goes into `sync_interval` (None: nats-server's default, 2 minutes)."""
        self.name = name
        self.port = free_port(HOST)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{HOST}:{self.port}"

    def config_text(self) -> str:
        store = json.dumps(str(self.directory / "jetstream"))
        sync = f"\n  sync_interval: {self.sync_interval}" if self.sync_interval else ""
        return (
            f'server_name: "{self.name}"\nhost: "{HOST}"\nport: {self.port}\nmax_payload: 1MB\n'
            f"jetstream {{\n  store_dir: {store}{sync}\n}}\n"
        )

    def start(self, timeout: float = 15.0) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "nats.conf"
        config.write_text(self.config_text())
        with open(self.directory / "nats.log", "ab") as log:
            self._proc = subprocess.Popen(
                [str(nats_server_binary()), "-c", str(config)], stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = Deadline(timeout)
        while not deadline.expired:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.name}: nats-server exited at start, see {self.directory / 'nats.log'}")
            try:
                with socket.create_connection((HOST, self.port), timeout=0.5) as s:
                    s.settimeout(0.5)
                    if s.recv(4).startswith(b"INFO"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.name}: nats-server did not accept clients within {timeout:.0f} s")

    def stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None


# --------------------------------------------------------------------------------------------------------------------
# one measured path: a publisher connection and a consumer connection on one server


@dataclass
class Target:
    key: str
    label: str
    url: str
    pub_nc: Client
    js: JetStreamContext
    js_async: JetStreamContext
    sub_nc: Client
    sub: Any  # JetStreamContext.PullSubscription
    errors: list[str] = field(default_factory=list)
    rounds: list[dict[str, Any]] = field(default_factory=list)

    async def close(self) -> None:
        for nc in (self.sub_nc, self.pub_nc):
            try:
                await asyncio.wait_for(nc.close(), 5)
            except Exception:
                pass


def _error_recorder(errors: list[str], who: str) -> Callable[[Exception], Awaitable[None]]:
    async def on_error(exc: Exception) -> None:
        errors.append(f"{who}: {exc}")

    return on_error


async def connect_ours(server: NatsServer, broker: NatsTenantBroker, keys: UserKeys, window: int) -> Target:
    errors: list[str] = []
    pub_nc = await broker.provider_connection(error_cb=_error_recorder(errors, "provider"), allow_reconnect=False)
    creds = broker.credentials(TENANT, keys)
    consumer = await broker.ensure_consumer(TENANT, CONSUMER)
    sub_nc = await nats.connect(
        creds.servers, nkeys_seed_str=creds.seed, error_cb=_error_recorder(errors, "tenant"), allow_reconnect=False
    )
    sub = await sub_nc.jetstream(prefix=creds.js_api_prefix).pull_subscribe_bind(consumer.name, stream=consumer.stream)
    return Target(
        key="ours",
        label="ours (accounts)",
        url=server.url,
        pub_nc=pub_nc,
        js=pub_nc.jetstream(),
        js_async=pub_nc.jetstream(publish_async_max_pending=window),
        sub_nc=sub_nc,
        sub=sub,
        errors=errors,
    )


async def connect_plain(server: PlainServer, key: str, label: str, window: int) -> Target:
    errors: list[str] = []
    pub_nc = await nats.connect(server.url, error_cb=_error_recorder(errors, "publisher"), allow_reconnect=False)
    js = pub_nc.jetstream()
    await js.add_stream(tenant_events_stream(TENANT))
    await js.add_consumer(tenant_stream_name(TENANT), tenant_pull_consumer(TENANT, CONSUMER))
    sub_nc = await nats.connect(server.url, error_cb=_error_recorder(errors, "consumer"), allow_reconnect=False)
    sub = await sub_nc.jetstream().pull_subscribe_bind(CONSUMER, stream=tenant_stream_name(TENANT))
    return Target(
        key=key,
        label=label,
        url=server.url,
        pub_nc=pub_nc,
        js=js,
        js_async=pub_nc.jetstream(publish_async_max_pending=window),
        sub_nc=sub_nc,
        sub=sub,
        errors=errors,
    )


# --------------------------------------------------------------------------------------------------------------------
# phases a-c


async def publish_one_by_one(t: Target, n: int, payload: bytes, cap_s: float) -> dict[str, Any]:
    deadline = Deadline(cap_s)
    lat: list[float] = []
    start = time.perf_counter()
    for _ in range(n):
        if deadline.expired:
            break
        t0 = time.perf_counter()
        await t.js.publish(SUBJECT, payload, timeout=5.0)
        lat.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    return {"n": len(lat), "rate": len(lat) / elapsed if elapsed else 0.0, "lat": lat}


async def publish_pipelined(t: Target, n: int, payload: bytes, cap_s: float) -> dict[str, Any]:
    """`publish_async` keeps at most `window` un-acked publishes in flight (nats-py's own semaphore)."""
    deadline = Deadline(cap_s)
    futures: list[asyncio.Future[Any]] = []

    async def issue() -> None:
        for i in range(n):
            if i % 128 == 0 and deadline.expired:
                break
            # No `wait_stall`: with one, nats-py wraps every call in asyncio.wait_for, which costs ~5x throughput
            # (measured: ~2.4 k/s instead of ~12 k/s). The stall is bounded by the wait_for around this loop instead.
            futures.append(await t.js_async.publish_async(SUBJECT, payload))

    start = time.perf_counter()
    try:
        await asyncio.wait_for(issue(), cap_s + 10)
    except TimeoutError:
        pass
    try:
        results = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), deadline.left + 10)
    except TimeoutError:
        # gather was cancelled, and with it every future still pending: count only the acks that had arrived
        results = [
            f.result() if f.done() and not f.cancelled() and f.exception() is None else RuntimeError("no ack")
            for f in futures
        ]
    elapsed = time.perf_counter() - start
    acked = sum(1 for r in results if not isinstance(r, BaseException))
    return {"n": acked, "failed": len(results) - acked, "rate": acked / elapsed if elapsed else 0.0}


async def consume(t: Target, expected: int, batch: int, cap_s: float) -> dict[str, Any]:
    deadline = Deadline(cap_s)
    got = 0
    start = time.perf_counter()
    while got < expected and not deadline.expired:
        want = min(batch, expected - got)
        try:
            msgs = await t.sub.fetch(want, timeout=max(0.05, min(1.0, deadline.left)))
        except TIMEOUTS:
            continue
        for msg in msgs:
            await msg.ack()
        got += len(msgs)
    await t.sub_nc.flush(timeout=5)
    elapsed = time.perf_counter() - start
    return {"n": got, "expected": expected, "rate": got / elapsed if elapsed else 0.0}


async def end_to_end(t: Target, n: int, payload: bytes, cap_s: float, settle_s: float) -> dict[str, Any]:
    """The consumer's `fetch(1)` is waiting at the server first (a tenant long-polling), then the provider publishes."""
    deadline = Deadline(cap_s)
    lat: list[float] = []
    lost = 0

    async def timed_fetch() -> tuple[float, list[Any]]:
        msgs = await t.sub.fetch(1, timeout=2.0)
        return time.perf_counter(), msgs

    for _ in range(n):
        if deadline.expired:
            break
        task = asyncio.create_task(timed_fetch())
        await asyncio.sleep(settle_s)
        t0 = time.perf_counter()
        try:
            await t.js.publish(SUBJECT, payload, timeout=5.0)
        except BaseException:
            task.cancel()
            raise
        try:
            t1, msgs = await task
        except TIMEOUTS:
            lost += 1
            continue
        lat.append(t1 - t0)
        for msg in msgs:
            await msg.ack()
    await t.sub_nc.flush(timeout=5)
    return {"n": len(lat), "lost": lost, "lat": lat}


async def drain(t: Target, cap_s: float = 3.0) -> int:
    """Fetch and ack whatever a previous phase left behind (only after a failure), so the next round starts empty."""
    left = 0
    deadline = Deadline(cap_s)
    while not deadline.expired:
        try:
            msgs = await t.sub.fetch(100, timeout=0.2)
        except TIMEOUTS:
            break
        for msg in msgs:
            await msg.ack()
        left += len(msgs)
    return left


async def run_round(targets: list[Target], args: argparse.Namespace, payload: bytes) -> list[dict[str, Any]]:
    """One round: each phase runs on every server back to back (in the given order) before the next phase starts,
    so the figures compared in a ratio are taken seconds apart, under the same background load."""
    seq = [await publish_one_by_one(t, args.seq, payload, args.phase_cap) for t in targets]
    pipe = [await publish_pipelined(t, args.async_n, payload, args.phase_cap) for t in targets]
    con = []
    for t, a, b in zip(targets, seq, pipe, strict=True):
        con.append(await consume(t, a["n"] + b["n"], args.batch, args.phase_cap))
        if con[-1]["n"] < con[-1]["expected"]:
            await drain(t)
    e2e = []
    for t in targets:
        e2e.append(await end_to_end(t, args.latency_n, payload, args.phase_cap, args.settle_ms / 1000))
        if e2e[-1]["lost"]:
            await drain(t)
    return [{"seq": a, "pipe": b, "consume": c, "e2e": d} for a, b, c, d in zip(seq, pipe, con, e2e, strict=True)]


# --------------------------------------------------------------------------------------------------------------------
# phase d: control plane


async def _config_load_time(system: Client) -> str:
    reply = await system.request("$SYS.REQ.SERVER.PING.VARZ", b"{}", timeout=2.0)
    return str(json.loads(reply.data)["data"]["config_load_time"])


async def one_reload(system: Client, server: NatsServer, cap_s: float = 5.0) -> float:
    """SIGHUP with an unchanged accounts file, until the server reports the reload done (what apply waits for)."""
    before = await _config_load_time(system)
    t0 = time.perf_counter()
    server.reload()
    deadline = Deadline(cap_s)
    while not deadline.expired:
        if await _config_load_time(system) != before:
            return time.perf_counter() - t0
        await asyncio.sleep(0.005)
    return float("nan")


async def first_fetch(url: str, seed: str | None, prefix: str | None, stream: str, cap_s: float) -> None:
    nc = await asyncio.wait_for(
        nats.connect(url, nkeys_seed_str=seed, allow_reconnect=False, error_cb=_error_recorder([], "cp")), cap_s
    )
    try:
        js = nc.jetstream(prefix=prefix) if prefix else nc.jetstream()
        sub = await js.pull_subscribe_bind("ctl", stream=stream)
        msgs = await sub.fetch(1, timeout=cap_s)
        await msgs[0].ack_sync(timeout=cap_s)
    finally:
        await nc.close()


class ApplyProbe:
    """Times the steps inside `NatsTenantBroker.apply` by wrapping the module functions it calls (timing only: each
    wrapper calls the original). Installed for phase d only, and removed afterwards."""

    STEPS = {
        "render_accounts": "render",
        "check_accounts_text": "validate",
        "_connect_until_accepted": "connect",
        "_reload_and_wait": "reload_wait",
        "ensure_stream": "stream",
    }

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._saved: dict[str, Any] = {}

    def reset(self) -> None:
        self.times = {v: 0.0 for v in self.STEPS.values()}
        self.calls = {v: 0 for v in self.STEPS.values()}

    def install(self) -> None:
        self.reset()
        for name, label in self.STEPS.items():
            original = getattr(provisioner, name)
            self._saved[name] = original
            setattr(provisioner, name, self._wrap(original, label))

    def remove(self) -> None:
        for name, original in self._saved.items():
            setattr(provisioner, name, original)
        self._saved.clear()

    def _wrap(self, original: Any, label: str) -> Any:
        probe = self
        if asyncio.iscoroutinefunction(original):
            async def timed_async(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return await original(*a, **k)
                finally:
                    probe.times[label] += time.perf_counter() - t0
                    probe.calls[label] += 1

            return timed_async

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                probe.times[label] += time.perf_counter() - t0
                probe.calls[label] += 1

        return timed


async def control_plane(
    args: argparse.Namespace,
    server: NatsServer,
    broker: NatsTenantBroker,
    tenants: list[TenantAccount],
    ours_provider: Client,
    plain: PlainServer,
    plain_nc: Client,
    payload: bytes,
) -> dict[str, Any]:
    keys = ProviderKeys(PROVIDER_SECRET)
    system = await connect_with_seed(broker.servers, keys.system.seed, timeout=5.0)
    ours: list[dict[str, float]] = []
    base: list[dict[str, float]] = []
    deadline = Deadline(args.cp_cap)
    probe = ApplyProbe()

    # each addition takes the tenant as arguments (not from the loop's scope), so a step always measures its own round
    async def ours_addition(
        tenant: str, subject: str, new_keys: UserKeys, wanted: list[TenantAccount], reload_s: float
    ) -> None:
        probe.reset()
        t0 = time.perf_counter()
        await broker.apply(wanted)
        t1 = time.perf_counter()
        inside = dict(probe.times)
        consumer = await broker.ensure_consumer(tenant, "ctl")
        t2 = time.perf_counter()
        await ours_provider.jetstream().publish(subject, payload, timeout=5.0)
        await first_fetch(server.url, new_keys.seed, consumer.js_api_prefix, consumer.stream, 5.0)
        t3 = time.perf_counter()
        ours.append({"apply": t1 - t0, "consumer": t2 - t1, "first_fetch": t3 - t2, "total": t3 - t0,
                     "reload_5ms_poll": reload_s, "reloads": probe.calls["reload_wait"],
                     **{f"in_{k}": v for k, v in inside.items()}})

    async def plain_addition(tenant: str, subject: str) -> None:
        js = plain_nc.jetstream()
        t0 = time.perf_counter()
        await js.add_stream(tenant_events_stream(tenant))
        t1 = time.perf_counter()
        await js.add_consumer(tenant_stream_name(tenant), tenant_pull_consumer(tenant, "ctl"))
        t2 = time.perf_counter()
        await js.publish(subject, payload, timeout=5.0)
        await first_fetch(plain.url, None, None, tenant_stream_name(tenant), 5.0)
        t3 = time.perf_counter()
        base.append({"apply": t1 - t0, "consumer": t2 - t1, "first_fetch": t3 - t2, "total": t3 - t0})

    probe.install()
    try:
        for i in range(args.tenants_add):
            if deadline.expired:
                break
            tenant = f"cp{i:03d}"
            subject = tenant_event_subject(tenant, EventKind.CARBON, "j1")
            new_keys = broker.new_user_keys()
            wanted = [*tenants, TenantAccount(tenant, new_keys.public_key)]
            # side measurement, outside apply: one reload of an unchanged file, polled every 5 ms
            reload_s = await one_reload(system, server)
            ours_step = partial(ours_addition, tenant, subject, new_keys, wanted, reload_s)
            plain_step = partial(plain_addition, tenant, subject)
            steps = (ours_step, plain_step) if i % 2 == 0 else (plain_step, ours_step)
            for step in steps:
                await asyncio.wait_for(step(), 30)
            tenants[:] = wanted
    finally:
        probe.remove()
        await system.close()
    return {"ours": ours, "plain": base}


# --------------------------------------------------------------------------------------------------------------------
# report


def summarise(targets: list[Target]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for t in targets:
        seq_lat = [x for r in t.rounds for x in r["seq"]["lat"]]
        e2e_lat = [x for r in t.rounds for x in r["e2e"]["lat"]]
        out[t.key] = {
            "publish_msgs_s": median(r["seq"]["rate"] for r in t.rounds),
            "publish_p50_ms": percentile(seq_lat, 50) * 1e3,
            "publish_p99_ms": percentile(seq_lat, 99) * 1e3,
            "publish_async_msgs_s": median(r["pipe"]["rate"] for r in t.rounds),
            "consume_msgs_s": median(r["consume"]["rate"] for r in t.rounds),
            "e2e_p50_ms": percentile(e2e_lat, 50) * 1e3,
            "e2e_p99_ms": percentile(e2e_lat, 99) * 1e3,
            "published": sum(r["seq"]["n"] + r["pipe"]["n"] for r in t.rounds),
            "publish_async_failed": sum(r["pipe"]["failed"] for r in t.rounds),
            "consumed": sum(r["consume"]["n"] for r in t.rounds),
            "consume_short": sum(r["consume"]["expected"] - r["consume"]["n"] for r in t.rounds),
            "e2e_samples": len(e2e_lat),
            "e2e_lost": sum(r["e2e"]["lost"] for r in t.rounds),
            "async_errors": len(t.errors),
        }
    return out


RATE_PHASES = {"publish_msgs_s": "seq", "publish_async_msgs_s": "pipe", "consume_msgs_s": "consume"}


def paired_ratios(targets: list[Target], a: str, b: str) -> dict[str, float]:
    """For each rate, the median over rounds of (a's rate / b's rate) in the same round: slow drift of the machine's
    load cancels out of each pair. Latency ratios are not paired (percentiles pool every round's samples)."""
    ta = next(t for t in targets if t.key == a)
    tb = next(t for t in targets if t.key == b)
    return {key: median(ratio(ra[phase]["rate"], rb[phase]["rate"])
                        for ra, rb in zip(ta.rounds, tb.rounds, strict=True))
            for key, phase in RATE_PHASES.items()}


def render_report(args: argparse.Namespace, summary: dict[str, dict[str, float]], cp: dict[str, Any],
                  meta: dict[str, Any], paired: dict[str, dict[str, float]]) -> str:
    o, p, n = summary["ours"], summary["plain"], summary["plain_nosync"]
    rows = []
    spec = [
        ("publish one-by-one  msgs/s", "publish_msgs_s", "/s"),
        ("publish one-by-one  p50 ms", "publish_p50_ms", "ms"),
        ("publish one-by-one  p99 ms", "publish_p99_ms", "ms"),
        (f"publish_async (window {args.window})  msgs/s", "publish_async_msgs_s", "/s"),
        (f"consume fetch({args.batch})+ack  msgs/s", "consume_msgs_s", "/s"),
        ("publish -> fetch  p50 ms", "e2e_p50_ms", "ms"),
        ("publish -> fetch  p99 ms", "e2e_p99_ms", "ms"),
    ]
    for name, key, unit in spec:
        ours_ratio = paired["ours/plain"].get(key, ratio(o[key], p[key]))
        sync_ratio = paired["plain/nosync"].get(key, ratio(p[key], n[key]))
        rows.append([name, fmt(o[key], unit), fmt(p[key], unit), fmt(ours_ratio, "x"),
                     fmt(n[key], unit), fmt(sync_ratio, "x")])
    lines = [
        f"bench_broker  {meta['date']}  {meta['machine']}  code: {meta['git']}",
        f"nats-server {meta['nats_server']}, nats-py {meta['nats_py']}; payload {args.payload} B; {args.rounds} rounds "
        f"x ({args.seq} one-by-one + {args.async_n} pipelined publishes, {args.latency_n} e2e samples) per server; "
        f"load average at start {meta['loadavg']}",
        "rates: median over rounds, rate ratios: median of the per-round ratios; latencies: percentiles over all "
        "rounds' samples",
        "",
        table(["a-c  JetStream, file store", "ours (accounts)", "plain (sync always)", "ours/plain",
               "plain (no sync)", "always/no-sync"], rows),
    ]
    checks = []
    for key, s in summary.items():
        checks.append(f"{key}: published {s['published']}, consumed {s['consumed']} (short {s['consume_short']}), "
                      f"async publish failures {s['publish_async_failed']}, e2e lost {s['e2e_lost']}, "
                      f"server async errors {s['async_errors']}")
    lines += ["", "checks: " + "; ".join(checks)]
    if cp["ours"]:
        ours, base = cp["ours"], cp["plain"]

        def m(rows: list[dict[str, float]], k: str) -> float:
            return median(r[k] * 1e3 for r in rows if k in r)

        def row(name: str, k: str, base_k: str | None = None) -> list[str]:
            b = m(base, base_k) if base_k else float("nan")
            return [name, fmt(m(ours, k), "ms"), fmt(b, "ms"), fmt(ratio(m(ours, k), b), "x")]

        inside = ["in_render", "in_validate", "in_connect", "in_reload_wait", "in_stream"]
        other = median((r["apply"] - sum(r[k] for k in inside)) * 1e3 for r in ours)
        cp_rows = [
            row("add tenant: apply() / add_stream", "apply", "apply"),
            row("  apply: render accounts", "in_render"),
            row("  apply: validate (nats-server -t)", "in_validate"),
            row("  apply: connect system + provider", "in_connect"),
            row(f"  apply: reload + wait, x{int(median(r['reloads'] for r in ours))}", "in_reload_wait"),
            row("  apply: create tenant stream", "in_stream"),
            ["  apply: other (file write, locks)", fmt(other, "ms"), "-", "-"],
            row("ensure_consumer() / add_consumer", "consumer", "consumer"),
            row("publish + connect + first fetch", "first_fetch", "first_fetch"),
            row("apply start -> first fetch", "total", "total"),
            row("(one reload + wait, polled every 5 ms)", "reload_5ms_poll"),
        ]
        lines += [
            "",
            f"d  control plane, median of {len(ours)} tenant additions (ours: {2 + len(ours)} tenants at the end)",
            table(["ms", "ours", "plain (one account)", "ours/plain"], cp_rows),
            "   'apply:' rows time the steps inside the apply above (wrapped module functions); the last row is a",
            "   separate reload of an unchanged file in the same loop, polled every 5 ms instead of apply's 20 ms.",
        ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------


def nats_server_version() -> str:
    try:
        out = subprocess.run([str(nats_server_binary()), "--version"], capture_output=True, text=True, timeout=10)
        return (out.stdout or out.stderr).strip().split()[-1]
    except Exception as exc:  # version is informative only
        return f"unknown ({exc})"


async def bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    payload = os.urandom(args.payload)
    ours_server = NatsServer(
        workdir / "ours", accounts_text=render_accounts(ProviderKeys(PROVIDER_SECRET), []), host=HOST,
        server_name="bench-ours",
    )
    plain = PlainServer(workdir / "plain", sync_always=True, name="bench-plain")
    nosync = PlainServer(workdir / "plain-nosync", sync_always=False, name="bench-plain-nosync")
    servers: list[Any] = [ours_server, plain, nosync]
    targets: list[Target] = []
    extra: list[Client] = []
    try:
        for s in servers:
            s.start()
        broker = NatsTenantBroker(
            servers=[ours_server.url], provider_secret=PROVIDER_SECRET, accounts_file=ours_server.accounts_file,
            reload=ours_server.reload,
        )
        tenant_keys = {name: broker.new_user_keys() for name in ("acme", "globex")}
        tenants = [TenantAccount(name, k.public_key) for name, k in tenant_keys.items()]
        t0 = time.perf_counter()
        await broker.apply(tenants)
        initial_apply_s = time.perf_counter() - t0
        targets = [
            await connect_ours(ours_server, broker, tenant_keys["acme"], args.window),
            await connect_plain(plain, "plain", "plain (sync always)", args.window),
            await connect_plain(nosync, "plain_nosync", "plain (no sync)", args.window),
        ]
        # warm-up: a few of each operation on every server, not recorded
        await run_round(targets, argparse.Namespace(**{**vars(args), "seq": 50, "async_n": 200, "latency_n": 5}),
                        payload)
        for r in range(args.rounds):
            order = targets[r % len(targets):] + targets[: r % len(targets)]
            for t, result in zip(order, await run_round(order, args, payload), strict=True):
                t.rounds.append(result)
            if not args.json_only:
                print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        cp: dict[str, Any] = {"ours": [], "plain": []}
        if args.tenants_add > 0:
            ours_provider = await broker.provider_connection(allow_reconnect=False)
            plain_nc = await nats.connect(plain.url, allow_reconnect=False)
            extra += [ours_provider, plain_nc]
            cp = await control_plane(args, ours_server, broker, tenants, ours_provider, plain, plain_nc, payload)
        summary = summarise(targets)
        paired = {"ours/plain": paired_ratios(targets, "ours", "plain"),
                  "plain/nosync": paired_ratios(targets, "plain", "plain_nosync")}
        return {"summary": summary, "paired_ratios": paired, "control_plane": cp, "initial_apply_s": initial_apply_s,
                "rounds": {t.key: [_strip(r) for r in t.rounds] for t in targets},
                "errors": {t.key: t.errors[:20] for t in targets}}
    finally:
        for nc in extra:
            try:
                await asyncio.wait_for(nc.close(), 5)
            except Exception:
                pass
        for t in targets:
            await t.close()
        for s in servers:
            s.stop()


def _strip(round_: dict[str, Any]) -> dict[str, Any]:
    """Per-round figures for the JSON output, without the raw latency samples."""
    out: dict[str, Any] = {}
    for phase, values in round_.items():
        v = {k: x for k, x in values.items() if k != "lat"}
        if "lat" in values:
            v["p50_ms"] = percentile(values["lat"], 50) * 1e3
            v["p99_ms"] = percentile(values["lat"], 99) * 1e3
        out[phase] = v
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, ~10 s")
    ap.add_argument("--rounds", type=int, help="rounds; each runs every phase on every server (default 8, quick 3)")
    ap.add_argument("--seq", type=int, help="one-by-one publishes per server per round (default 400, quick 200)")
    ap.add_argument("--async-n", type=int, help="pipelined publishes per server per round (default 2000, quick 1000)")
    ap.add_argument("--window", type=int, default=1000, help="publish_async max in flight (default 1000)")
    ap.add_argument("--batch", type=int, default=100, help="fetch batch size (default 100)")
    ap.add_argument("--latency-n", type=int, help="end-to-end samples per server per round (default 120, quick 40)")
    ap.add_argument("--settle-ms", type=float, default=2.0,
                    help="wait after issuing the long-poll fetch before publishing (default 2 ms)")
    ap.add_argument("--payload", type=int, default=256, help="payload bytes (default 256)")
    ap.add_argument("--tenants-add", type=int,
                    help="tenants added at runtime in phase d (default 10, quick 3; 0 skips)")
    ap.add_argument("--phase-cap", type=float, help="seconds cap on each phase (default 10, quick 4)")
    ap.add_argument("--cp-cap", type=float, default=60.0, help="seconds cap on phase d (default 60)")
    ap.add_argument("--dir", type=Path, help="where the servers keep their stores (default: a temp dir on disk, "
                                             "removed afterwards); fsync cost depends on this file system")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, configs)")
    ap.add_argument("--json", metavar="PATH", help="also write all figures as JSON to PATH ('-': stdout, no table)")
    args = ap.parse_args(argv)
    quick = args.quick
    defaults = {"rounds": (8, 3), "seq": (400, 200), "async_n": (2000, 1000), "latency_n": (120, 40),
                "tenants_add": (10, 3), "phase_cap": (10.0, 4.0)}
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    for name in ("rounds", "seq", "async_n", "latency_n", "window", "batch", "payload"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    args.json_only = args.json == "-"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = args.dir if args.dir else None
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="hz-bench-broker-", dir=base))
    meta: dict[str, Any] = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_line(),
        "nats_server": nats_server_version(),
        "nats_py": importlib.metadata.version("nats-py"),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "store_dir": str(workdir),
        "loadavg": loadavg(),
        "git": git_state(),
    }
    started = time.monotonic()
    try:
        results = asyncio.run(asyncio.wait_for(bench(args, workdir), timeout=900))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    meta["seconds"] = round(time.monotonic() - started, 1)
    if not args.json_only:
        print(render_report(args, results["summary"], results["control_plane"], meta, results["paired_ratios"]))
        print(f"\n(total {meta['seconds']} s; initial apply of 2 tenants {results['initial_apply_s'] * 1e3:.0f} ms)")
    if args.json:
        payload = {"meta": meta, "args": {k: v for k, v in vars(args).items() if k != "dir"}, **results}
        write_json(args.json, clean_nan(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
