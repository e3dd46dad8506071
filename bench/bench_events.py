#!/usr/bin/env python
"""Macro-loop benchmark: provider agents' events to a tenant controller's handler, against raw nats-py, in one run.

What is measured is the path an event takes in production: a host agent hands a CloudEvent to its
`provider_agents.publisher.JetStreamPublisher` (one per agent: an in-order queue, `js.publish` with
`Nats-Msg-Id` = event id, retried until the PubAck), the broker stores it in the tenant's stream (our rendered
accounts; JetStream `sync_interval` from `--sync`, default `always` as shipped), and a `tenant_controllers.Controller`
running in a `ControllerRuntime` pulls it through the tenant account's imported JetStream API (`NatsEventSource`: a
continuous pull, `PullStream`; consumer created by the real API's `PUT /v1/event-consumers`), decodes it, routes it
to the job's lane, checks and records it in the `HandledStore` (SQLite on disk), calls the typed handler, and acks.

Processes (2 cores, loopback only; each Python one on the event loop the shipped processes choose, uvloop where
installed, `HZ_EVENT_LOOP=asyncio` for asyncio's own: the raw baseline shares them, so it runs on the same loop):

* fleet       a subprocess playing `--hosts` agents (default 100), one JetStreamPublisher and one provider
              connection each (like 100 agent processes, but in one Python process). It makes the events
              (`make_event(Congestion(...))`, ~390 B of JSON) and publishes them; the raw baseline's hosts publish
              the same bytes with `await js.publish` on their own connections to the plain server. Once
              connected it freezes its start-up heap (`harmonaize.heap`), as `harmonaize agent` does.
* this one    the consumers: two ControllerRuntimes on our broker (see targets) and a raw pull consumer per plain
              server (`fetch(batch)` + `ack()`, nothing else), each timing when an event reaches its handler; its
              start-up heap is frozen too, as `harmonaize controller run` does.
* api         the real control plane (`api.app.create_app` with a real `NatsTenantBroker`) under uvicorn: creates the
              tenant account and the consumers, and answers the runtime's `GET /v1/jobs/{id}`.
* nats        ours (`broker_config.server.NatsServer`, rendered accounts) and a plain single-account server with
              the same fsync policy (bench_broker.py's PlainServer): `--sync always` (default) or a period for both
              (`--sync 2m`: nats-server's own default, no fsync before the PubAck); with `always`, `--nosync` adds a
              plain server without it, as a reference for what the fsync costs.

Targets:

* ours (SDK + API)   the controller exactly as `harmonaize controller run` builds it; its handler takes the job
                     (the runtime reads it only for handlers that do), whose view is kept at most `job_max_age`
                     (5 s) old by `GET /v1/jobs/{id}` on the real API, read in the background while events flow.
* ours (job cached)  the same runtime, source, store and handler, but `ProviderApi.get_job` answers from memory (a
                     subclass in this file): the SDK's event path without that REST round trip, to attribute costs.
* raw                nats-py only, same stream and consumer configuration, same payload bytes.
* raw, our broker    (only with `--targets ...,raw_ours`) raw nats-py publish and fetch on *our* broker: the tenant
                     stream the API made, the provider's connections, a consumer filtered on its own job. Tells
                     what our broker's configuration (accounts, imports) costs apart from the SDK.

Latency is the handler's wall clock minus the event's scheduled time (the CloudEvent `time` for ours, a header for
raw; same machine clock). Each event carries the phase number (a CloudEvents extension for ours, a header for raw),
so late events from an earlier phase are not counted; after every phase the job's subject is purged, so backlog does
not spill into the next one. Phases, per round, every target back to back in a rotating order:

  1  throughput: every host publishes its next event as soon as the previous one is acknowledged (at most
     `--hosts` in flight), for `--tp-seconds`; rate = events reaching the handler per second, after a ramp.
  2  latency: open loop at `--rate` events/s in total (default 1000), spread evenly over the hosts (10/s each),
     for `--lat-seconds`; percentiles over every event published, an event not handled `--grace` s after the end
     counting as infinitely late (so a target that cannot keep up shows it instead of reporting only its survivors).

Run from the repository root: `python bench/bench_events.py` (~90 s), `--quick` (~25 s, no warm-up, no
no-sync server), `--help` for sizes. `--late-ms 8` also lists every event later than 8 ms with its stages (stderr): a
stall shows as a burst of such lines sharing one stage (how the blocking job read after a pause was found), and
each phase in which the fleet's publish attempts failed and were retried (checks: `fleet_failed_attempts`).
No timed assertions: it prints figures. Every loop is bounded in count and in time; only loopback addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime as dt
import importlib.metadata
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

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
    percentile,
    proc_cpu_seconds,
    ratio,
    table,
    write_json,
)

ensure_repo_on_path()

import nats  # noqa: E402
import nats.errors  # noqa: E402

from harmonaize import event_loop  # noqa: E402

HOST = "127.0.0.1"
TENANT = "acme"
PROVIDER_SECRET = "bench-provider-secret-0123456789abcdef"
ADMIN_TOKEN = "bench-admin-token-0123456789abcdef"
STREAM = "HZ_T_acme"  # broker_config.render.tenant_stream_name("acme"); the plain servers get the same name
PHASE_EXTENSION = "benchphase"  # CloudEvents extension carrying the phase number (ours)
PHASE_HEADER = "Bench-Phase"  # the same for raw
TIME_HEADER = "Bench-T"  # raw: the event's scheduled wall-clock time
MSG_ID_HEADER = "Nats-Msg-Id"  # raw with --raw-msg-id: JetStream's duplicate detection on, as ours always has it
JOBS = {"ours_api": "ev-api", "ours_cached": "ev-cached", "raw": "ev-raw", "raw_nosync": "ev-raw",
        "raw_ours": "ev-raw-ours"}
LABELS = {
    "ours_api": "ours (SDK + API)",
    "ours_cached": "ours (job cached)",
    "raw": "raw (sync always)",
    "raw_nosync": "raw (no sync)",
    "raw_ours": "raw, our broker (sync always)",
}
OPT_IN = {"raw_ours"}
"""Targets run only when named in --targets: raw nats-py on our broker's configuration (accounts, the tenant stream
in the provider's account) tells the broker's share of a gap from the SDK's."""
TIMEOUTS = (asyncio.TimeoutError, nats.errors.TimeoutError)


def label(args: argparse.Namespace, key: str) -> str:
    """A target's row label; the baseline's names the fsync policy both brokers run with."""
    if key == "raw" and args.sync != "always":
        return "raw (no sync)"
    if key == "raw_ours" and args.sync != "always":
        return "raw, our broker (no sync)"
    if key.startswith("ours") and args.sync != "always":
        return LABELS[key][:-1] + ", no sync)"
    return LABELS[key]


def _exit_with_parent() -> None:
    """A helper process never outlives the benchmark that started it (even if that one is killed)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


# ====================================================================================================================
# the API subprocess (`bench_events.py --serve-api ...`)


def serve_api(args: argparse.Namespace) -> int:
    import uvicorn

    from api.app import create_app
    from broker_config.provisioner import NatsTenantBroker, reload_by_pid_file

    _exit_with_parent()
    broker = NatsTenantBroker(
        servers=[args.nats_url], provider_secret=PROVIDER_SECRET.encode(), accounts_file=args.accounts_file,
        reload=reload_by_pid_file(args.pid_file),
    )
    app = create_app(api_settings(args.data_dir, args.nats_url), broker=broker)
    config = uvicorn.Config(app, host=HOST, port=args.port, log_level="warning", access_log=False, lifespan="on",
                            timeout_keep_alive=120, loop=event_loop_choice())
    uvicorn.Server(config).run()
    return 0


def api_settings(data_dir: Path, nats_url: str) -> Any:
    from harmonaize.settings import Settings

    return Settings(_env_file=None, data_dir=data_dir, admin_token=ADMIN_TOKEN, provider_secret=PROVIDER_SECRET,
                    nats_url=nats_url)


# ====================================================================================================================
# the fleet subprocess (`bench_events.py --fleet ...`): simulated agents, driven by JSON lines on stdin


class TimedJs:
    """The JetStream context a JetStreamPublisher gets, timing each publish until its PubAck (instrumentation)."""

    def __init__(self, js: Any, samples: list[float], failures: list[str]) -> None:
        self._js = js
        self._samples = samples
        self._failures = failures

    async def publish(self, subject: str, payload: bytes = b"", timeout: float | None = None,
                      stream: str | None = None, headers: dict[str, Any] | None = None) -> Any:
        t0 = time.perf_counter()
        try:
            ack = await self._js.publish(subject, payload, timeout=timeout, stream=stream, headers=headers)
        except Exception as exc:  # the publisher retries it; a failed attempt is what a stall can hide behind
            self._failures.append(f"{type(exc).__name__} after {(time.perf_counter() - t0) * 1e3:.0f} ms")
            raise
        self._samples.append(time.perf_counter() - t0)
        return ack


class Fleet:
    """`hosts` simulated agents per target: ours = one JetStreamPublisher each; raw = plain `js.publish` each."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.hosts = args.hosts
        self.conns: dict[str, list[Any]] = {}
        self.publishers: list[Any] = []
        self.puback: list[float] = []
        self.failed_attempts: list[str] = []  # ours: publish attempts that raised (and were retried)
        self.errors: list[str] = []
        secret = PROVIDER_SECRET.encode()
        from harmonaize.events import Congestion, CongestionLevel, CongestionScope, agent_source, make_event
        from harmonaize.pseudonyms import host_pseudonym, locality_pseudonym

        self.sources = [agent_source(host_pseudonym(secret, TENANT, f"host-{i:03d}")) for i in range(self.hosts)]
        self.group = locality_pseudonym(secret, TENANT, "rack-b")
        self._congestion, self._make_event = Congestion, make_event
        self._level, self._scope = CongestionLevel.MODERATE, CongestionScope.INTER_GROUP

    async def connect(self) -> None:
        from broker_config.keys import ProviderKeys
        from provider_agents.publisher import JetStreamPublisher

        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        seed = ProviderKeys(PROVIDER_SECRET.encode()).provider.seed
        n = min(self.args.connections, self.hosts)
        for key, url in (("ours", self.args.ours_url), ("raw", self.args.plain_url),
                         ("raw_nosync", self.args.nosync_url)):
            if not url:
                continue
            options: dict[str, Any] = {"error_cb": on_error, "allow_reconnect": False}
            if key == "ours":
                options["nkeys_seed_str"] = seed
            self.conns[key] = [await nats.connect(url, **options) for _ in range(n)]
        for i in range(self.hosts):
            nc = self.conns["ours"][i % n]
            publisher = JetStreamPublisher(TimedJs(nc.jetstream(), self.puback, self.failed_attempts),
                                           ack_timeout_s=2.0)
            publisher.start()
            self.publishers.append(publisher)

    def make(self, i: int, job: str, at: float, phase: int) -> Any:
        """One agent's event, as the projection would hand it over: a Congestion CloudEvent from this host."""
        when = dt.datetime.fromtimestamp(at, dt.UTC)
        data = self._congestion(level=self._level, slowdown=1.4, scope=self._scope, groups=(self.group,), since=when)
        return self._make_event(data, source=self.sources[i], subject=job, time=when,
                                extensions={PHASE_EXTENSION: phase})

    async def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from harmonaize.subjects import tenant_event_subject

        target, job, phase = cmd["target"], cmd["job"], int(cmd["phase"])
        mode, seconds = cmd["mode"], float(cmd["seconds"])
        subject = tenant_event_subject(TENANT, "congestion", job)
        ours = target.startswith("ours")
        template = self.make(0, job, time.time(), phase).to_json_bytes()  # raw: the same bytes, made once
        conns = self.conns["ours" if ours or target == "raw_ours" else target]
        self.puback.clear()
        self.failed_attempts.clear()
        raw_acks: list[float] = []
        published_before = sum(p.published for p in self.publishers)
        errors = [0]
        lag: list[float] = []
        offset = time.time() - time.monotonic()  # wall = monotonic + offset
        start = time.monotonic() + 0.05
        end = start + seconds

        async def raw_publish(i: int, at: float) -> None:
            headers = {TIME_HEADER: repr(at), PHASE_HEADER: str(phase)}
            if self.args.raw_msg_id:
                headers[MSG_ID_HEADER] = f"{i}-{phase}-{at!r}"  # unique, as our event ids are
            t0 = time.perf_counter()
            try:
                await conns[i % len(conns)].jetstream().publish(subject, template, timeout=2.0, headers=headers)
            except Exception:
                errors[0] += 1
                return
            raw_acks.append(time.perf_counter() - t0)

        async def host_open_loop(i: int) -> None:
            """`rate / hosts` events per second from host i, evenly interleaved with the other hosts."""
            period = self.hosts / cmd["rate"]
            due = start + i / cmd["rate"]
            while due < end:
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                else:
                    lag.append(-wait)
                at = due + offset
                if ours:
                    await self.publishers[i].submit(subject, self.make(i, job, at, phase))
                else:
                    await raw_publish(i, at)
                due += period

        async def host_closed_loop(i: int) -> None:
            """Publish, wait for the PubAck, publish the next, until the phase ends."""
            wait = start - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            while time.monotonic() < end:
                at = time.time()
                if ours:
                    publisher = self.publishers[i]
                    await publisher.submit(subject, self.make(i, job, at, phase))
                    await publisher.drain()
                else:
                    await raw_publish(i, at)

        cpu0 = time.process_time()
        loop = host_open_loop if mode == "rate" else host_closed_loop
        try:
            await asyncio.wait_for(asyncio.gather(*(loop(i) for i in range(self.hosts))), seconds + 30)
        except TimeoutError:
            errors[0] += 1
        if ours:  # what is still queued in the publishers is part of this phase: give it a bounded time to go out
            for p in self.publishers:
                if not await p.drain(max(0.1, end + 5 - time.monotonic())):
                    errors[0] += 1
                    break
        elapsed = time.monotonic() - start
        if ours:
            published = sum(p.published for p in self.publishers) - published_before
            acks = list(self.puback)
        else:
            published = len(raw_acks)
            acks = raw_acks
        return {
            "published": published,
            "errors": errors[0],
            "elapsed_s": elapsed,
            "publish_rate": published / seconds if seconds else math.nan,
            "puback_p50_ms": percentile(acks, 50) * 1e3,
            "puback_p99_ms": percentile(acks, 99) * 1e3,
            "late_p99_ms": percentile(lag, 99) * 1e3 if lag else 0.0,
            "late_n": len(lag),
            "fleet_cpu": (time.process_time() - cpu0) / elapsed if elapsed else math.nan,
            "bytes": len(template),
            "puback_max_ms": max(acks, default=math.nan) * 1e3,
            "failed_attempts": len(self.failed_attempts),
            "failures": sorted(collections.Counter(self.failed_attempts).items())[:5],
            "retries": sum(p.retries for p in self.publishers),
            "duplicates": sum(p.duplicates for p in self.publishers),
        }

    async def close(self) -> None:
        for p in self.publishers:
            await p.close(drain_timeout=1.0)
        for conns in self.conns.values():
            for nc in conns:
                try:
                    await asyncio.wait_for(nc.close(), 5)
                except Exception:
                    pass


async def fleet_main(args: argparse.Namespace) -> int:
    _exit_with_parent()
    fleet = Fleet(args)
    try:
        await fleet.connect()
        from harmonaize.heap import freeze_startup_heap

        freeze_startup_heap()  # as each `harmonaize agent` does once started (the raw hosts live here too)
        print(json.dumps({"ready": True}), flush=True)
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line or not line.strip():
                return 0
            cmd = json.loads(line)
            if cmd.get("cmd") == "quit":
                return 0
            result = await fleet.run(cmd)
            result["async_errors"] = len(fleet.errors)
            print(json.dumps(result), flush=True)
    finally:
        await fleet.close()


class FleetProcess:
    """The parent's handle on the fleet subprocess."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.argv = argv
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def start(self, timeout: float = 60.0) -> None:
        with open(self.log, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log,
                cwd=str(Path(__file__).resolve().parent.parent),
            )
        reply = await self._read(timeout)
        if not reply.get("ready"):
            raise RuntimeError(f"fleet did not start: {reply}")

    async def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            tail = " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-5:])
            raise RuntimeError(f"fleet exited: {tail}")
        return dict(json.loads(line))

    async def run(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        return await self._read(timeout)

    async def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"cmd": "quit"}\n')
                await self.proc.stdin.drain()
                await asyncio.wait_for(self.proc.wait(), 10)
            except Exception:
                if self.proc.returncode is None:
                    self.proc.kill()
                    await self.proc.wait()
        self.proc = None


# ====================================================================================================================
# consumers (this process)


@dataclass
class Recorder:
    """What reached one target's handler: per phase, latency samples and when each arrived."""

    key: str
    phase: int = -1
    latencies: list[float] = field(default_factory=list)
    handled_at: list[float] = field(default_factory=list)  # monotonic
    stages: list[tuple[float, float, float]] = field(default_factory=list)  # publish->stored, ->fetched, ->handler
    stale: int = 0
    last: float = 0.0  # monotonic time of the last handler call, any phase
    late_s: ClassVar[float | None] = None  # --late-ms: report events later than this, with their stages

    def begin(self, phase: int) -> None:
        self.phase = phase
        self.latencies, self.handled_at, self.stages = [], [], []

    def hit(self, phase: Any, at: float, stamps: tuple[float, float] | None) -> None:
        now = time.time()
        self.last = time.monotonic()
        if phase != self.phase:
            self.stale += 1
            return
        self.latencies.append(now - at)
        self.handled_at.append(self.last)
        if stamps is not None:
            stored, fetched = stamps
            self.stages.append((stored - at, fetched - stored, now - fetched))
        if self.late_s is not None and now - at > self.late_s:
            made_stored, stored_fetched, fetched_handler = (
                (stamps[0] - at, stamps[1] - stamps[0], now - stamps[1]) if stamps is not None else (math.nan,) * 3
            )
            print(f"late {self.key} phase {self.phase} at {at:.3f}: {(now - at) * 1e3:.1f} ms = made->stored "
                  f"{made_stored * 1e3:.1f} + stored->fetched {stored_fetched * 1e3:.1f} + fetched->handler "
                  f"{fetched_handler * 1e3:.1f}", file=sys.stderr)


def _event_id(data: bytes) -> str | None:
    """The CloudEvent id from structured JSON without decoding it all (instrumentation only)."""
    i = data.find(b'"id":"')
    if i < 0:
        return None
    j = data.find(b'"', i + 6)
    return data[i + 6:j].decode("ascii", "replace")


def _stamps_of(msg: Any) -> float:
    """The server's store time of a JetStream message, as a POSIX timestamp."""
    return float(msg.metadata.timestamp.timestamp())


def make_timed_source(**kwargs: Any) -> Any:
    """A NatsEventSource that notes, per event id, when the server stored it and when fetch returned it.

    Instrumentation only: it reads the nats-py message behind `NatsDelivery` (a private attribute); if that ever
    changes, the stage columns show '-' and nothing else is affected.
    """
    from tenant_controllers.nats_source import NatsEventSource

    class TimedNatsSource(NatsEventSource):
        stamps: dict[str, tuple[float, float]] = {}
        fetches = [0, 0, 0]  # calls that returned something, batch asked in those calls, messages returned

        async def fetch(self, *, batch: int, timeout: float) -> Any:
            deliveries = await super().fetch(batch=batch, timeout=timeout)
            now = time.time()
            if deliveries:
                self.fetches[0] += 1
                self.fetches[1] += batch
                self.fetches[2] += len(deliveries)
            for d in deliveries:
                try:
                    event_id = _event_id(d.data)
                    if event_id is not None:
                        self.stamps[event_id] = (_stamps_of(d._msg), now)
                except Exception:
                    pass
            return deliveries

    source = TimedNatsSource(**kwargs)
    source.stamps, source.fetches = {}, [0, 0, 0]
    return source


def timed_api(base_url: str, token: str) -> Any:
    """The real ProviderApi, noting how long each `get_job` (the runtime's `job.refresh()`) takes (instrumentation)."""
    from harmonaize.rest import JobPublic
    from tenant_controllers.api_client import ProviderApi

    class TimedApi(ProviderApi):
        get_job_s: list[float] = []

        async def get_job(self, job_id: str) -> JobPublic:
            t0 = time.perf_counter()
            try:
                return await super().get_job(job_id)
            finally:
                self.get_job_s.append(time.perf_counter() - t0)

    api = TimedApi(base_url=base_url, token=token)
    api.get_job_s = []
    return api


def cached_job_api(base_url: str, token: str, snapshot: dict[str, Any]) -> Any:
    """A ProviderApi whose `get_job` answers from memory; every other call goes to the real API."""
    from harmonaize.rest import JobPublic
    from tenant_controllers.api_client import ProviderApi

    job = JobPublic.model_validate(snapshot)  # parsed once, as the real get_job parses each reply (frozen: shared)

    class CachedJobApi(ProviderApi):
        async def get_job(self, job_id: str) -> JobPublic:
            return job

    return CachedJobApi(base_url=base_url, token=token)


@dataclass
class OursTarget:
    key: str
    job: str
    recorder: Recorder
    runtime: Any
    source: Any
    store: Any
    task: asyncio.Task[None] | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)


async def start_ours(key: str, job: str, *, nats_url: str, seed: str, api_real: Any, api_for_jobs: Any,
                     workdir: Path) -> OursTarget:
    from harmonaize.events import CloudEvent, Congestion
    from tenant_controllers import Controller, Job
    from tenant_controllers.runtime import ControllerRuntime
    from tenant_controllers.store import HandledStore

    recorder = Recorder(key)
    source = make_timed_source(servers=nats_url, seed=seed, api=api_real)
    ctl = Controller(tenant=TENANT, job=job, name=f"bench-{key.replace('_', '-')}")

    @ctl.on(Congestion, id="on_congestion")
    async def on_congestion(event: Congestion, envelope: CloudEvent[Congestion], job: Job) -> None:
        # Takes the job, as a controller deciding anything does (the runtime reads it only for handlers that can).
        if job.workers < 0:
            raise AssertionError("unreachable: a job view was read")
        stamps = source.stamps.pop(envelope.id, None)
        recorder.hit(envelope.extensions.get(PHASE_EXTENSION), envelope.time.timestamp(), stamps)

    store = HandledStore(workdir / f"handled-{key}.sqlite3")
    # As the runner builds it (tenant_controllers/runner.py), defaults included; no resync handler, so no resyncs.
    runtime = ControllerRuntime(ctl, source=source, api=api_for_jobs, store=store, drain_timeout=5.0)
    target = OursTarget(key, job, recorder, runtime, source, store)
    target.task = asyncio.create_task(runtime.run(target.stop), name=f"bench-{key}")
    ready = asyncio.create_task(runtime.ready.wait())
    await asyncio.wait({ready, target.task}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if not runtime.ready.is_set():
        ready.cancel()
        if target.task.done():
            target.task.result()
        raise RuntimeError(f"{key}: the controller runtime did not become ready")
    return target


@dataclass
class RawTarget:
    key: str
    job: str
    recorder: Recorder
    nc: Any
    sub: Any
    batch: int
    task: asyncio.Task[None] | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    acked: int = 0
    fetches: list[int] = field(default_factory=lambda: [0, 0])  # fetch calls that returned, messages returned

    async def loop(self) -> None:
        """`fetch(batch)` then, per message: note the time, ack (the runtime's fetch size and timeout)."""
        while not self.stop.is_set():
            try:
                msgs = await self.sub.fetch(self.batch, timeout=1.0)
            except TIMEOUTS:
                continue
            except nats.errors.Error:
                await asyncio.sleep(0.05)
                continue
            fetched = time.time()
            self.fetches[0] += 1
            self.fetches[1] += len(msgs)
            for msg in msgs:
                headers = msg.headers or {}
                try:
                    phase = int(headers.get(PHASE_HEADER, "-1"))
                    at = float(headers.get(TIME_HEADER, "nan"))
                    stored = _stamps_of(msg)
                except (ValueError, TypeError):
                    phase, at, stored = -1, math.nan, math.nan
                self.recorder.hit(phase, at, (stored, fetched))
                await msg.ack()
                self.acked += 1


async def start_raw(key: str, job: str, url: str, batch: int, *, seed: str | None = None) -> RawTarget:
    """A raw pull consumer; with `seed` (the provider's), on our broker, whose tenant stream the API created."""
    from broker_config.render import tenant_stream_name
    from broker_config.streams import tenant_events_stream, tenant_pull_consumer
    from harmonaize.subjects import tenant_events_filter

    nc = await nats.connect(url, allow_reconnect=False, **({"nkeys_seed_str": seed} if seed else {}))
    js = nc.jetstream()
    if seed is None:
        await js.add_stream(tenant_events_stream(TENANT))
    name = key.replace("_", "-")
    # on our broker the stream holds the other targets' jobs too: filter on this one, as the controllers do
    filters = [tenant_events_filter(TENANT, job=job)] if seed is not None else []
    await js.add_consumer(tenant_stream_name(TENANT), tenant_pull_consumer(TENANT, name, filter_subjects=filters))
    sub = await js.pull_subscribe_bind(name, stream=tenant_stream_name(TENANT))
    target = RawTarget(key, job, Recorder(key), nc, sub, batch)
    target.task = asyncio.create_task(target.loop(), name=f"bench-{key}")
    return target


# ====================================================================================================================
# phases


def summarise_phase(kind: str, rec: Recorder, fleet: dict[str, Any], started: float, seconds: float,
                    ramp: float, cpu: dict[str, float]) -> dict[str, Any]:
    published = fleet["published"]
    handled = len(rec.latencies)
    out: dict[str, Any] = {"published": published, "handled": handled, "fleet": fleet, "cpu": cpu}
    if kind == "tp":
        lo, hi = started + ramp, started + seconds
        window = [t for t in rec.handled_at if lo <= t <= hi]
        out["rate"] = len(window) / (hi - lo) if hi > lo else math.nan
        out["lat"] = rec.latencies
    else:
        missing = max(0, published - handled)
        out["missing"] = missing
        out["lat"] = rec.latencies + [math.inf] * missing  # not handled within the grace: infinitely late
        out["handled_rate"] = handled / seconds if seconds else math.nan
        out["stages"] = list(rec.stages)
    return out


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.pids: dict[str, int | None] = {}
        self.results: dict[str, dict[str, list[dict[str, Any]]]] = {}
        self.purgers: dict[str, Any] = {}

    def cpu_now(self) -> dict[str, float]:
        out = {name: proc_cpu_seconds(pid) for name, pid in self.pids.items()}
        out["ctl"] = time.process_time()
        return out

    async def phase(self, kind: str, key: str, target: Any, fleet: FleetProcess, phase_no: int) -> dict[str, Any]:
        from harmonaize.subjects import tenant_event_subject

        args = self.args
        seconds = args.tp_seconds if kind == "tp" else args.lat_seconds
        rec: Recorder = target.recorder
        rec.begin(phase_no)
        cmd = {"target": key, "job": target.job, "phase": phase_no, "seconds": seconds,
               "mode": "max" if kind == "tp" else "rate", "rate": args.rate}
        cpu0, t0 = self.cpu_now(), time.monotonic()
        started = t0 + 0.05  # the fleet starts 50 ms after it reads the command
        result = await fleet.run(cmd, timeout=seconds + 60)
        if result.get("failed_attempts") and args.late_ms is not None:
            print(f"phase {phase_no} {key}: {result['failed_attempts']} publish attempts failed and were retried: "
                  f"{result['failures']}", file=sys.stderr, flush=True)
        if kind == "lat":  # give the consumer `grace` seconds to catch up
            deadline = Deadline(args.grace)
            while len(rec.latencies) < result["published"] and not deadline.expired:
                await asyncio.sleep(0.02)
        elapsed = time.monotonic() - t0
        cpu1 = self.cpu_now()
        cpu_s = {name: cpu1[name] - cpu0[name] for name in cpu0}
        cpu = {name: used / elapsed for name, used in cpu_s.items()}
        summary = summarise_phase(kind, rec, result, started, seconds, min(args.ramp, seconds / 3), cpu)
        handled = len(rec.latencies)
        summary["ms_per_event"] = {  # CPU milliseconds per event: controller process, fleet, API
            "ctl": cpu_s["ctl"] / handled * 1e3 if handled else math.nan,
            "fleet": cpu_s["fleet"] / result["published"] * 1e3 if result["published"] else math.nan,
            "api": cpu_s["api"] / handled * 1e3 if handled else math.nan,
        }
        rec.phase = -1  # whatever arrives from now on is stale
        # Drop the backlog (a target that cannot keep up leaves one) and let handlers in flight finish.
        purger = self.purgers["ours" if key.startswith("ours") else key]
        await purger.purge_stream(STREAM, subject=tenant_event_subject(TENANT, "congestion", target.job))
        settle = Deadline(1.0 if args.quick else 5.0)
        while not settle.expired and time.monotonic() - rec.last < 0.25:
            await asyncio.sleep(0.05)
        return summary


async def bench(args: argparse.Namespace, workdir: Path, meta: dict[str, Any]) -> dict[str, Any]:
    import httpx
    from bench_api import ServerProcess
    from bench_broker import PlainServer

    from api.migrate import upgrade_async
    from broker_config.keys import ProviderKeys
    from broker_config.render import render_accounts
    from broker_config.server import NatsServer
    ours_server = NatsServer(workdir / "ours",
                             accounts_text=render_accounts(ProviderKeys(PROVIDER_SECRET.encode()), []),
                             host=HOST, server_name="bench-ours", sync_interval=args.sync)
    # The baseline gets the same fsync policy as our broker (a period: nats-server's own default, 2 minutes).
    plain = PlainServer(workdir / "plain", sync_always=args.sync == "always", name="bench-plain")
    nosync = PlainServer(workdir / "plain-nosync", sync_always=False, name="bench-nosync") if args.nosync else None
    servers: list[Any] = [s for s in (ours_server, plain, nosync) if s is not None]
    api_dir = workdir / "api"
    api_dir.mkdir(parents=True)

    class ApiProcess(ServerProcess):
        def start(self) -> None:
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--serve-api", "--port", str(self.port),
                     "--data-dir", str(self.data_dir), "--nats-url", ours_server.url,
                     "--accounts-file", str(ours_server.accounts_file), "--pid-file", str(ours_server.pid_file)],
                    stdout=log, stderr=subprocess.STDOUT, cwd=str(Path(__file__).resolve().parent.parent),
                )

    api = ApiProcess("api", api_dir, "")
    fleet: FleetProcess | None = None
    ours: list[OursTarget] = []
    raws: list[RawTarget] = []
    clients: list[Any] = []
    closers: list[Any] = []
    setup_t0 = time.monotonic()
    try:
        for s in servers:
            s.start()
        await upgrade_async(api_settings(api_dir, ours_server.url))
        api.start()
        await api.wait_ready("/v1/healthz")
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with httpx.AsyncClient(base_url=api.url, timeout=30.0) as client:
            reply = await client.post("/v1/tenants", json={"id": TENANT, "display_name": "Acme"}, headers=admin)
            if reply.status_code != 201:
                raise RuntimeError(f"create tenant: {reply.status_code} {reply.text[:300]}")
            created = reply.json()
            token, seed = created["api_token"], created["nats"]["seed"]
            tenant = {"Authorization": f"Bearer {token}"}
            snapshots = {}
            for job in ("ev-api", "ev-cached"):
                reply = await client.post("/v1/jobs", json={"id": job, "min_workers": 1, "max_workers": 4},
                                          headers=tenant)
                if reply.status_code != 201:
                    raise RuntimeError(f"create job: {reply.status_code} {reply.text[:300]}")
                snapshots[job] = (await client.get(f"/v1/jobs/{job}", headers=tenant)).json()
        api_real = timed_api(api.url, token)
        api_cached = cached_job_api(api.url, token, snapshots["ev-cached"])
        clients += [api_real, api_cached]
        ours.append(await start_ours("ours_api", "ev-api", nats_url=ours_server.url, seed=seed, api_real=api_real,
                                     api_for_jobs=api_real, workdir=workdir))
        ours.append(await start_ours("ours_cached", "ev-cached", nats_url=ours_server.url, seed=seed,
                                     api_real=api_real, api_for_jobs=api_cached, workdir=workdir))
        raws.append(await start_raw("raw", "ev-raw", plain.url, ours[0].runtime.batch))
        if nosync is not None:
            raws.append(await start_raw("raw_nosync", "ev-raw", nosync.url, ours[0].runtime.batch))
        if "raw_ours" in args.targets:
            raws.append(await start_raw("raw_ours", JOBS["raw_ours"], ours_server.url, ours[0].runtime.batch,
                                        seed=ProviderKeys(PROVIDER_SECRET.encode()).provider.seed))
        provider = await nats.connect(ours_server.url,
                                      nkeys_seed_str=ProviderKeys(PROVIDER_SECRET.encode()).provider.seed,
                                      allow_reconnect=False)
        closers.append(provider)
        b = Bench(args, workdir)
        b.purgers["ours"] = provider.jetstream()
        for raw in raws:
            b.purgers[raw.key] = raw.nc.jetstream()
        fleet_argv = [sys.executable, str(Path(__file__).resolve()), "--fleet", "--hosts", str(args.hosts),
                      "--connections", str(args.connections), "--ours-url", ours_server.url, "--plain-url", plain.url]
        if nosync is not None:
            fleet_argv += ["--nosync-url", nosync.url]
        if args.raw_msg_id:
            fleet_argv += ["--raw-msg-id"]
        fleet = FleetProcess(fleet_argv, workdir / "fleet.log")
        await fleet.start()
        from harmonaize.heap import freeze_startup_heap

        freeze_startup_heap()  # as `harmonaize controller run` does (this process also holds the raw consumers)
        b.pids = {"fleet": fleet.pid, "api": api.proc.pid if api.proc else None,
                  "nats": ours_server.pid, "nats_plain": plain._proc.pid if plain._proc else None}
        targets: dict[str, Any] = {**{t.key: t for t in ours}, **{t.key: t for t in raws}}
        tp_keys = [k for k in ("ours_api", "ours_cached", "raw", "raw_ours") if k in targets and k in args.targets]
        lat_keys = [k for k in ("ours_api", "ours_cached", "raw", "raw_nosync", "raw_ours")
                    if k in targets and k in args.targets]
        results: dict[str, dict[str, list[dict[str, Any]]]] = {
            "tp": {k: [] for k in tp_keys} if "tp" in args.phases else {},
            "lat": {k: [] for k in lat_keys} if "lat" in args.phases else {},
        }
        meta["setup_s"] = round(time.monotonic() - setup_t0, 1)
        phase_no = 0
        # warm-up (not with --quick): a short throughput phase per target, not recorded
        warm = argparse.Namespace(**{**vars(args), "tp_seconds": 0.4, "lat_seconds": 0.4, "grace": 0.3})
        b_warm = Bench(warm, workdir)
        b_warm.purgers, b_warm.pids = b.purgers, b.pids
        for key in dict.fromkeys([*results["tp"], *results["lat"]]) if not args.quick else ():
            phase_no += 1
            await b_warm.phase("tp", key, targets[key], fleet, phase_no)
        for r in range(args.rounds):
            for kind, per_key in results.items():
                keys = list(per_key)
                if not keys:
                    continue
                order = keys[r % len(keys):] + keys[: r % len(keys)]
                for key in order:
                    phase_no += 1
                    results[kind][key].append(await b.phase(kind, key, targets[key], fleet, phase_no))
            if not args.json_only:
                print(f"  round {r + 1}/{args.rounds} done ({time.monotonic() - setup_t0:.0f} s)", file=sys.stderr,
                      flush=True)
        used = set(results["tp"]) | set(results["lat"])
        checks: dict[str, Any] = {}
        if "ours_api" in used:
            checks["job_refresh"] = {"calls": len(api_real.get_job_s),
                                     "p50_ms": round(percentile(api_real.get_job_s, 50) * 1e3, 2),
                                     "p99_ms": round(percentile(api_real.get_job_s, 99) * 1e3, 2)}
        for t in ours:
            if t.key not in used:
                continue
            s = t.runtime.stats
            checks[t.key] = {"received": s.received, "handled": s.handled, "gave_up": s.gave_up,
                             "duplicates": s.duplicates, "terminated": s.terminated, "ignored": s.ignored,
                             "stale": t.recorder.stale, "broker_errors": list(t.source.errors)[:5],
                             "fleet_failed_attempts": sum(r["fleet"].get("failed_attempts", 0)
                                                          for per_key in results.values()
                                                          for r in per_key.get(t.key, [])),
                             "fetch_batch_asked": round(ratio(t.source.fetches[1], t.source.fetches[0]), 1),
                             "fetch_batch_got": round(ratio(t.source.fetches[2], t.source.fetches[0]), 1)}
        for raw in raws:
            if raw.key not in used:
                continue
            checks[raw.key] = {"acked": raw.acked, "stale": raw.recorder.stale,
                               "fetch_batch_got": round(ratio(raw.fetches[1], raw.fetches[0]), 1)}
        return {"results": results, "checks": checks, "event_bytes": _first_bytes(results)}
    finally:
        # the runtimes log their broker connection closing at shutdown as a warning: not news here
        logging.getLogger("tenant_controllers").setLevel(logging.ERROR)
        for t in ours:
            t.stop.set()
        for t in ours:
            if t.task is not None:
                try:
                    await asyncio.wait_for(t.task, 15)
                except Exception:
                    t.task.cancel()
            t.store.close()
        for raw in raws:
            raw.stop.set()
            if raw.task is not None:
                raw.task.cancel()
                await asyncio.gather(raw.task, return_exceptions=True)
            closers.append(raw.nc)
        for c in clients:
            await c.aclose()
        for nc in closers:
            try:
                await asyncio.wait_for(nc.close(), 5)
            except Exception:
                pass
        if fleet is not None:
            await fleet.stop()
        api.stop()
        for s in servers:
            s.stop()


def _first_bytes(results: dict[str, Any]) -> int | None:
    for kind in ("tp", "lat"):
        for phases in results[kind].values():
            for p in phases:
                return int(p["fleet"]["bytes"])
    return None


# ====================================================================================================================
# report


def _pct(values: list[float], q: float) -> float:
    """`percentile` that ignores NaN and treats infinity (never handled) as larger than anything."""
    data = sorted(v for v in values if not math.isnan(v))
    if not data:
        return math.nan
    rank = (len(data) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(data) - 1)
    if math.isinf(data[high]):
        return data[high] if rank > low or math.isinf(data[low]) else data[low]
    return percentile(data, q)


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"tp": {}, "lat": {}}
    for key, phases in results["tp"].items():
        lat = [x for p in phases for x in p["lat"]]
        out["tp"][key] = {
            "rate": median(p["rate"] for p in phases),
            "rate_min": min(p["rate"] for p in phases),
            "rate_max": max(p["rate"] for p in phases),
            "publish_rate": median(p["fleet"]["publish_rate"] for p in phases),
            "p50_ms": _pct(lat, 50) * 1e3,
            "p99_ms": _pct(lat, 99) * 1e3,
            "cpu": {name: median(p["cpu"][name] for p in phases) for name in phases[0]["cpu"]},
            "ms_per_event": {name: median(p["ms_per_event"][name] for p in phases) for name in ("ctl", "fleet", "api")},
            "published": sum(p["published"] for p in phases),
        }
    for key, phases in results["lat"].items():
        lat = [x for p in phases for x in p["lat"]]
        stages = [s for p in phases for s in p["stages"]]
        out["lat"][key] = {
            "published": sum(p["published"] for p in phases),
            "missing": sum(p["missing"] for p in phases),
            "handled_rate": median(p["handled_rate"] for p in phases),
            "publish_rate": median(p["fleet"]["publish_rate"] for p in phases),
            "p50_ms": _pct(lat, 50) * 1e3,
            "p90_ms": _pct(lat, 90) * 1e3,
            "p99_ms": _pct(lat, 99) * 1e3,
            "max_ms": max(lat) * 1e3 if lat else math.nan,
            "p99_by_round_ms": [_pct(p["lat"], 99) * 1e3 for p in phases],
            "puback_p50_ms": median(p["fleet"]["puback_p50_ms"] for p in phases),
            "puback_p99_ms": median(p["fleet"]["puback_p99_ms"] for p in phases),
            "stage_p50_ms": [_pct([s[i] for s in stages], 50) * 1e3 for i in range(3)],
            "stage_p99_ms": [_pct([s[i] for s in stages], 99) * 1e3 for i in range(3)],
            "fleet_late_p99_ms": median(p["fleet"]["late_p99_ms"] for p in phases),
            "cpu": {name: median(p["cpu"][name] for p in phases) for name in phases[0]["cpu"]},
        }
    paired = {}
    for key in out["tp"]:
        if key != "raw" and "raw" in results["tp"]:
            paired[key] = median(ratio(a["rate"], b["rate"])
                                 for a, b in zip(results["tp"][key], results["tp"]["raw"], strict=True))
    out["tp_ratio"] = paired
    return out


def _ms(value: float) -> str:
    return "inf" if math.isinf(value) else fmt(value, "ms")


def _cpu(c: dict[str, float]) -> str:
    return "/".join(f"{c.get(k, math.nan):.2f}" for k in ("fleet", "nats", "ctl", "api"))


def render_report(args: argparse.Namespace, s: dict[str, Any], meta: dict[str, Any], checks: dict[str, Any],
                  event_bytes: int | None) -> str:
    lines = [
        f"bench_events  {meta['date']}  {meta['machine']}  code: {meta['git']}",
        f"nats-server {meta['nats_server']}, nats-py {meta['nats_py']}, event loop {meta['event_loop']} in every "
        f"process (HZ_EVENT_LOOP); event: Congestion CloudEvent, {event_bytes} B "
        f"JSON; {args.hosts} simulated hosts = {args.hosts} JetStreamPublishers on {min(args.connections, args.hosts)} "
        f"provider connections in one fleet process; controller: ControllerRuntime defaults (batch 16, "
        f"max_in_flight 64), HandledStore on disk; brokers' JetStream sync_interval: {args.sync}; {args.rounds} "
        f"rounds; raw publishes {'with' if args.raw_msg_id else 'without'} Nats-Msg-Id; load average at start "
        f"{meta['loadavg']}",
        "rates: median over rounds (min-max); ratio: median of per-round ratios; latencies: percentiles over all "
        "rounds' events; CPU in cores: fleet / nats-server (ours, or plain for raw) / controller process / API",
    ]
    if s["tp"]:
        lines += [
        "",
        f"1  throughput: each host publishes its next event when the previous one is acknowledged "
        f"({args.tp_seconds:g} s per target per round, rate counted after {min(args.ramp, args.tp_seconds / 3):.2g} s)",
        ]
    rows = []
    for key, v in s["tp"].items():
        cpu = dict(v["cpu"])
        if key.startswith("raw") and key != "raw_ours":
            cpu["nats"] = cpu.get("nats_plain", math.nan)
        per = v["ms_per_event"]
        rows.append([label(args, key), fmt(v["rate"], "/s"), f"{v['rate_min']:,.0f}-{v['rate_max']:,.0f}",
                     fmt(s["tp_ratio"].get(key, math.nan), "x") if key != "raw" else "1.00x",
                     fmt(v["publish_rate"], "/s"), _ms(v["p50_ms"]), _ms(v["p99_ms"]), _cpu(cpu),
                     f"{per['fleet']:.2f}/{per['ctl']:.2f}/{per['api']:.2f}"])
    if rows:
        lines.append(table(["target", "events/s", "range", "vs raw", "published/s", "p50 ms", "p99 ms",
                            "CPU fl/nats/ctl/api", "CPU ms/event fl/ctl/api"], rows))
        lines.append("   p50/p99 here are queueing at saturation (the stream holds a backlog), not the latency figure.")
    if not s["lat"]:
        return "\n".join(lines + _footer(args, s, checks))
    per_host = args.rate / args.hosts
    lines += [
        "",
        f"2  latency at {args.rate:,.0f} events/s offered, from {args.hosts} hosts ({per_host:g}/s each), "
        f"{args.lat_seconds:g} s per target per round (~{args.lat_seconds * args.rounds:g} s each); "
        f"not handled {args.grace:g} s after the end = infinitely late",
    ]
    rows = []
    for key, v in s["lat"].items():
        cpu = dict(v["cpu"])
        if key.startswith("raw") and key != "raw_ours":
            cpu["nats"] = cpu.get("nats_plain", math.nan) if key == "raw" else math.nan
        handled = v["published"] - v["missing"]
        rows.append([label(args, key), f"{handled:,}/{v['published']:,}", fmt(v["handled_rate"], "/s"),
                     _ms(v["p50_ms"]), _ms(v["p90_ms"]), _ms(v["p99_ms"]), _ms(v["max_ms"]),
                     " ".join(_ms(x) for x in v["p99_by_round_ms"]), _cpu(cpu)])
    lines.append(table(["target", "handled", "handled/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "p99 per round",
                        "CPU fl/nats/ctl/api"], rows))
    rows = []
    for key, v in s["lat"].items():
        st50, st99 = v["stage_p50_ms"], v["stage_p99_ms"]
        rows.append([label(args, key), _ms(v["puback_p50_ms"]), _ms(v["puback_p99_ms"]),
                     f"{_ms(st50[0])} / {_ms(st99[0])}", f"{_ms(st50[1])} / {_ms(st99[1])}",
                     f"{_ms(st50[2])} / {_ms(st99[2])}", _ms(v["fleet_late_p99_ms"])])
    lines += ["", "   where the time goes (p50 / p99 ms, handled events only):",
              table(["   target", "PubAck p50", "PubAck p99", "made -> stored", "stored -> fetched",
                     "fetched -> handler", "fleet late p99"], rows),
              "   PubAck: the fleet's publish call until its ack (ours: each JetStreamPublisher attempt). made -> "
              "stored: the event's time to the server's store timestamp (queue in the publisher, network); stored -> "
              "fetched: fsync, delivery, the pull cycle; fetched -> handler: decode, lane, store, job read (ours). "
              "fleet late: how far behind schedule the fleet itself ran."]
    return "\n".join(lines + _footer(args, s, checks))


def _footer(args: argparse.Namespace, s: dict[str, Any], checks: dict[str, Any]) -> list[str]:
    verdicts = []
    if s["tp_ratio"]:
        verdicts.append("throughput >= 50% of raw: " + ", ".join(
            f"{label(args, k)} {fmt(r, 'x')} ({'met' if r >= 0.5 else 'MISSED'})" for k, r in s["tp_ratio"].items()))
    if s["lat"]:
        verdicts.append(f"p99 <= 5 ms at {args.rate:,.0f}/s: " + ", ".join(
            f"{label(args, k)} {_ms(v['p99_ms'])} ms ({'met' if v['p99_ms'] <= 5 else 'MISSED'})"
            for k, v in s["lat"].items()))
    lines = ["", "targets: " + "; ".join(verdicts)] if verdicts else []
    parts = []
    for key, c in checks.items():
        parts.append(f"{key}: " + ", ".join(f"{k} {v}" for k, v in c.items()))
    lines += ["checks: " + "; ".join(parts)]
    return lines


# ====================================================================================================================


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, no warm-up, ~25 s")
    ap.add_argument("--rounds", type=int, help="rounds (default 3, quick 2)")
    ap.add_argument("--hosts", type=int, default=100, help="simulated agents (default 100)")
    ap.add_argument("--connections", type=int, help="provider connections the agents share (default: one per host)")
    ap.add_argument("--rate", type=float, default=1000.0, help="offered events/s in the latency phase (default 1000)")
    ap.add_argument("--tp-seconds", type=float, help="throughput phase length per target (default 2, quick 0.7)")
    ap.add_argument("--lat-seconds", type=float, help="latency phase length per target (default 3.3, quick 1)")
    ap.add_argument("--ramp", type=float, default=0.5, help="throughput: seconds not counted at the start (0.5)")
    ap.add_argument("--grace", type=float,
                    help="latency: seconds after the phase for the consumer to catch up (default 1, quick 0.4)")
    ap.add_argument("--nosync", action=argparse.BooleanOptionalAction, default=None,
                    help="add a plain server without sync_interval: always to the latency phase "
                         "(default on, off with --quick or --sync PERIOD)")
    ap.add_argument("--sync", default="always",
                    help="JetStream sync_interval of our broker and of the raw baseline: always (default: fsync "
                         "before every PubAck, as shipped) or a period such as 2m (HZ_BROKER_SYNC_INTERVAL)")
    ap.add_argument("--targets", default=",".join(k for k in LABELS if k not in OPT_IN),
                    help=f"comma-separated subset of {','.join(LABELS)} (default: all but {','.join(sorted(OPT_IN))}; "
                         "raw_nosync needs --nosync; raw_ours: raw nats-py on our broker)")
    ap.add_argument("--phases", default="tp,lat", help="tp (throughput), lat (latency) or both (default)")
    ap.add_argument("--dir", type=Path, help="parent of the temp dir (stores, logs); fsync cost depends on it")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--json", metavar="PATH", help="also write all figures as JSON to PATH ('-': stdout, no table)")
    ap.add_argument("--raw-msg-id", action="store_true",
                    help="raw targets publish with a unique Nats-Msg-Id too (JetStream's duplicate detection, which "
                         "ours always uses): tells its share of a gap from the SDK's")
    ap.add_argument("--late-ms", type=float, metavar="MS",
                    help="print every event handled later than MS after it was made, with its stages, to stderr "
                         "(what sets the tail: a stall shows as a burst of lines with one stage in common)")
    ap.add_argument("--serve-api", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fleet", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--nats-url", help=argparse.SUPPRESS)
    ap.add_argument("--accounts-file", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--pid-file", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--ours-url", help=argparse.SUPPRESS)
    ap.add_argument("--plain-url", help=argparse.SUPPRESS)
    ap.add_argument("--nosync-url", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    defaults = {"rounds": (3, 2), "tp_seconds": (2.0, 0.7), "lat_seconds": (3.3, 1.0), "grace": (1.0, 0.4),
                "nosync": (True, False)}
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    if args.connections is None:
        args.connections = args.hosts
    for name in ("rounds", "hosts", "connections"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if args.rate <= 0 or args.tp_seconds <= 0 or args.lat_seconds <= 0:
        ap.error("--rate, --tp-seconds and --lat-seconds must be positive")
    from harmonaize.broker_sync import check_sync_interval

    try:
        check_sync_interval(args.sync)
    except ValueError as exc:
        ap.error(f"--sync: {exc}")
    if args.sync != "always":
        args.nosync = False  # the baseline itself runs without fsync then
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = sorted(set(args.targets) - set(LABELS))
    if unknown:
        ap.error(f"unknown target(s) {', '.join(unknown)}")
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not args.phases or set(args.phases) - {"tp", "lat"}:
        ap.error("--phases takes tp, lat or tp,lat")
    args.json_only = args.json == "-"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    Recorder.late_s = args.late_ms / 1e3 if args.late_ms is not None else None
    if args.serve_api:
        return serve_api(args)
    if args.fleet:
        return event_loop.run(fleet_main(args), choice=event_loop_choice())
    from bench_broker import nats_server_version

    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="hz-bench-events-", dir=args.dir))
    meta: dict[str, Any] = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_line(),
        "nats_server": nats_server_version(),
        "nats_py": importlib.metadata.version("nats-py"),
        "event_loop": event_loop_choice(),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "loadavg": loadavg(),
        "git": git_state(),
    }
    started = time.monotonic()
    try:
        results = event_loop.run(asyncio.wait_for(bench(args, workdir, meta), timeout=900), choice=event_loop_choice())
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    meta["seconds"] = round(time.monotonic() - started, 1)
    summary = summarise(results["results"])
    if not args.json_only:
        print(render_report(args, summary, meta, results["checks"], results["event_bytes"]))
        print(f"\n(total {meta['seconds']} s, of which setup {meta.get('setup_s', '?')} s)")
    if args.json:
        rounds = {kind: {key: [{k: v for k, v in p.items() if k not in ("lat", "stages")} for p in phases]
                         for key, phases in per.items()} for kind, per in results["results"].items()}
        payload = {"meta": meta, "args": {k: v for k, v in vars(args).items() if k != "dir"},
                   "summary": summary, "rounds": rounds, "checks": results["checks"],
                   "event_bytes": results["event_bytes"]}
        write_json(args.json, clean_nan(_no_inf(payload)))
    return 0


def _no_inf(value: Any) -> Any:
    """Infinity is not JSON either: an event never handled is written as null, like NaN."""
    if isinstance(value, float) and math.isinf(value):
        return None
    if isinstance(value, dict):
        return {k: _no_inf(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_no_inf(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
