#!/usr/bin/env python
"""Elastic-job benchmark: how fast a running torchrun job re-forms after an agreement or a host failure, under the
whole provider, beside torchrun alone on the same job, in one run.

The job is the example MLP (`-m workloads.examples.mlp`, one worker per host, `--step-delay-ms` so the 2 cores are
not saturated, `--log-every 1`). Every figure is the time from a trigger to the **first training step at the new
world size**, read from the timestamp (ms) of rank 0's `step=N ... world=W` log line, so ours and the baseline are
timed by the same clock at the same point.

* **ours**: a whole provider as tests/elastic/harness.py starts one (written again here, nothing imported from
  tests/): nats-server with our rendered accounts, the API with its outbox relay (`serve_api`, in this process), the
  provider's central loops (`provider_agents.cli fleet-monitor`: outages, per-job rendezvous stores, micro loop) and
  one `provider_agents.cli agent` per simulated host (4 hosts, 1 GPU each, 2 locality groups), each launching its
  host's node. DDP jobs run in place (`workloads.elastic`): one single-node torchrun per host, the workers form the
  job's group on the provider's store and stay alive across every change. One job runs through, in order: launch on
  2 hosts; **(a)** a negotiated scale 2 -> 3 (trigger: the accept response); 3 -> 2; **(b) node kill**: SIGKILL of
  the job's node on one of the 2 hosts (every process carrying the host's marker; its agent lives and reports it);
  a negotiated 1 -> 2; **(b) node freeze**: SIGSTOP of the node (agent alive: it sees the processes stopped); 1 -> 2;
  **(b) kill**: SIGKILL of a whole host (its agent too); 1 -> 2; **(b) frozen**: SIGSTOP of a whole host (sockets
  stay open). For host failures the time is also split at the **failure event**: the host's `down_at` in
  `GET /v1/hosts`, set when the fleet monitor reports the host down (it publishes the tenant's `failure` event in the
  same check). For agreements, `gap_s`: the running ranks' longest time between two logged steps around the change.
* **torchrun alone**: plain `torch.distributed.run` nodes, `--rdzv-backend=c10d`, default rendezvous settings
  (`last_call_timeout` 30 s, keep-alive 5 s x 3, join 600 s), `--max-restarts=3` (the launcher's; torchrun's default 0
  ends the job at the first worker failure instead of recovering), `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`
  (docs/building-blocks.md, torchrun trap 1).
  The first node started hosts the rendezvous store, and is never the victim (torchrun trap 4: killing it ends the
  job), so the baseline gets its favourable case. Job 1 (`--nnodes=1:3`): 2 nodes, then **(a)** a third node
  started. Job 2 (`--nnodes=1:2`, so that its launch does not wait out the 30 s last call; the survivor of a failure
  waits the same with 1:2 or 1:3, since 1 < max either way): 2 nodes; **(b) kill** of the second node; a node
  started again (1 -> 2); **(b) frozen** of that node, waited for at most `--freeze-cap` s: the survivor blocks in a
  gloo collective until the process group timeout (`torch.distributed.constants.default_pg_timeout`, 30 min), which
  is reported instead of waited for.

Breakdown columns come from the same logs (torchrun's agents run with `LOGLEVEL=INFO` in both, so their
"Starting worker group" lines mark the rendezvous completing; our launcher's "started ... epoch N" lines mark a node
(re)started; rank 0's "ready at step" marks the worker's start-up done: process, `import torch`, process group,
checkpoint load).

Every process started here carries an `HZ_NODE_ID` marker beginning with `hzb<pid>-`, or, for our nodes, with the id
of this run's provider (`<cloud>.hzb<pid>-hN.`, the cloud id derived from its fresh secret and data dir); on exit,
error, SIGINT or SIGTERM every process carrying either is sent SIGCONT and SIGKILL.

Run from the repository root: `python bench/bench_elastic.py` (~4.5 min quiet, ~5.5 busy), `--repeat N` (each repeat
as long again), `--json PATH`. No timed assertions: it prints figures.

* **torchft** (when installed: `pip install torchft==0.2.0`, not a project dependency; otherwise one line says so and
  the column is skipped): bench/torchft_side.py, first in each repeat, or alone with `--only torchft`. 3
  replica groups of 1 process on a torchft lighthouse; scale-up 2 -> 3, graceful scale-down 3 -> 2, kill -9 and
  SIGSTOP of 1 of 3 groups (-> 2); also the survivors' longest step gap (`torchft_gap_s`). A torchft "node" is a
  replica group, so `node_freeze` (summary only) is the same case as `freeze`.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import datetime as dt
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torchft_side  # noqa: E402 - the torchft baseline, importing torchft only when it runs
from _benchutil import (
    ROOT,
    clean_nan,
    ensure_repo_on_path,
    git_state,
    loadavg,
    machine_line,
    median,
    package_version,
    table,
    write_json,
)

ensure_repo_on_path()

import httpx  # noqa: E402

from harmonaize.job_runtime import ENV_NODE_MARKER  # noqa: E402
from provider_agents.markers import cloud_id, host_prefix  # noqa: E402
from provider_agents.processes import marked_processes  # noqa: E402

TAG = f"hzb{os.getpid()}"
"""Prefix of the `HZ_NODE_ID` marker of every process this run starts but our nodes (theirs: `CLOUDS`), and of our
simulated hosts' ids."""
ADMIN_TOKEN = "bench-elastic-admin-" + secrets.token_hex(12)
TENANT = "acme"
JOB = "train"
TARGET_AFTER_EVENT_S = 5.0
PG_TIMEOUT_S = 1800.0  # torch.distributed.constants.default_pg_timeout (checked at start, see pg_timeout_s)

# -- logs: every figure is read from log lines, on the wall clock -----------------------------------------------------

STEP_RE = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) workloads\.examples INFO step=(\d+) loss=\S+ world=(\d+)")
READY_RE = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) workloads INFO \[rank 0/(\d+)\] ready at step (\d+)")
STANDBY_TEXT = "standing by for an open offer"
TORCHRUN_RE = re.compile(
    r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d{6}) +\d+ \S+\] \[default\] "
    r"(Rendezvous'ing worker group|Starting worker group|Worker group FAILED|Detected \d+ new nodes)"
)
LAUNCHER_RE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ provider_agents\.node_launcher: host (\S+): "
    r"(?:started \S+/\S+ epoch (\d+)|\S+/\S+ epoch \d+ -> (\d+))"
)
MONITOR_RE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ provider_agents\.fleet_monitor: host (\S+) missed its heartbeats"
)
TORCHRUN_KINDS = {
    "Rendezvous'ing worker group": "rdzv_begin",
    "Starting worker group": "rdzv_done",
    "Worker group FAILED": "group_failed",
}


def _clock_time(text: str, ref: float) -> float:
    """`HH:MM:SS.fff` (local time, no date) -> epoch seconds, on the day that puts it nearest to `ref`."""
    hms, _, frac = text.partition(".")
    h, m, s = (int(x) for x in hms.split(":"))
    base = dt.datetime.fromtimestamp(ref).astimezone()
    best = math.inf
    for shift in (-1, 0, 1):
        day = base + dt.timedelta(days=shift)
        stamp = day.replace(hour=h, minute=m, second=s, microsecond=0).timestamp() + float("0." + (frac or "0"))
        if abs(stamp - ref) < abs(best - ref):
            best = stamp
    return best


def _full_time(text: str) -> float:
    """`YYYY-MM-DD HH:MM:SS,fff` (Python logging's default asctime, local time) -> epoch seconds."""
    return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").astimezone().timestamp()


@dataclass(frozen=True)
class LogEvent:
    ts: float
    kind: str  # step | ready | rdzv_begin | rdzv_done | group_failed | new_nodes | node_started | epoch_change | down
    source: str  # the log file, relative to the watcher's root
    world: int = 0
    step: int = 0
    host: str = ""
    epoch: int = 0


def parse_line(line: str, source: str, ref: float) -> LogEvent | None:
    if (m := STEP_RE.match(line)) is not None:
        return LogEvent(_clock_time(m[1], ref), "step", source, world=int(m[3]), step=int(m[2]))
    if (m := READY_RE.match(line)) is not None:
        return LogEvent(_clock_time(m[1], ref), "ready", source, world=int(m[2]), step=int(m[3]))
    if (m := TORCHRUN_RE.match(line)) is not None:
        kind = TORCHRUN_KINDS.get(m[3], "new_nodes")
        return LogEvent(_clock_time(m[2], ref), kind, source)
    if (m := LAUNCHER_RE.match(line)) is not None:
        if m[3] is not None:
            return LogEvent(_full_time(m[1]), "node_started", source, host=m[2], epoch=int(m[3]))
        return LogEvent(_full_time(m[1]), "epoch_change", source, host=m[2], epoch=int(m[4]))
    if (m := MONITOR_RE.match(line)) is not None:
        return LogEvent(_full_time(m[1]), "down", source, host=m[2])
    return None


class LogWatcher:
    """Reads what was appended to every log under `root` matching `patterns` since the last poll, parsed."""

    def __init__(self, root: Path, patterns: tuple[str, ...]) -> None:
        self.root = root
        self.patterns = patterns
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self.events: list[LogEvent] = []

    def poll(self) -> None:
        ref = time.time()
        for pattern in self.patterns:
            for path in sorted(self.root.glob(pattern)):
                try:
                    with open(path, "rb") as handle:
                        handle.seek(self._offsets.get(path, 0))
                        data = handle.read()
                except OSError:
                    continue
                if not data:
                    continue
                self._offsets[path] = self._offsets.get(path, 0) + len(data)
                data = self._partial.pop(path, b"") + data
                lines = data.split(b"\n")
                if lines[-1]:
                    self._partial[path] = lines[-1]
                source = str(path.relative_to(self.root))
                for raw in lines[:-1]:
                    event = parse_line(raw.decode(errors="replace"), source, ref)
                    if event is not None:
                        self.events.append(event)

    def first(self, kind: str, *, after: float, world: int | None = None, before: float = math.inf) -> LogEvent | None:
        found = [e for e in self.events
                 if e.kind == kind and after < e.ts <= before and (world is None or e.world == world)]
        return min(found, key=lambda e: e.ts) if found else None

    def last_per_source(self, kind: str, *, after: float, before: float) -> float | None:
        """The latest of each source's first `kind` event in (after, before]: when the last node got there."""
        firsts: dict[str, float] = {}
        for e in self.events:
            if e.kind == kind and after < e.ts <= before:
                firsts[e.source] = min(firsts.get(e.source, math.inf), e.ts)
        return max(firsts.values()) if firsts else None

    def steps_at(self, world: int, *, after: float) -> int:
        return sum(1 for e in self.events if e.kind == "step" and e.world == world and e.ts > after)


# -- processes --------------------------------------------------------------------------------------------------------


CLOUDS: list[str] = []
"""The cloud ids of this run's providers: their nodes' markers begin with `<cloud>.` instead of the run's tag."""


def reap(signal_first: bool = True) -> list[int]:
    """SIGCONT + SIGKILL every process carrying this run's marker or its providers' (never this process)."""
    prefixes = [f"{TAG}-", *(f"{cloud}." for cloud in CLOUDS)]
    pids = sorted({pid for prefix in prefixes for pid in marked_processes(prefix, prefix=True) if pid != os.getpid()})
    for sig in (signal.SIGCONT, signal.SIGKILL) if signal_first else (signal.SIGKILL,):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return pids


def signal_pids(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def job_args(args: argparse.Namespace) -> list[str]:
    return ["-m", "workloads.examples.mlp", "--step-delay-ms", f"{args.step_delay_ms:g}", "--checkpoint-interval",
            str(args.checkpoint_interval), "--log-every", "1"]


def child_env(marker: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HZ_")}
    env.update({ENV_NODE_MARKER: marker, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO"})
    return env


# -- measurement records ----------------------------------------------------------------------------------------------


@dataclass
class Transition:
    """One trigger -> first step at `world`; stage times are seconds after the trigger (None: not seen)."""

    name: str
    world: int
    trigger: float
    first_step: float | None = None
    stages: dict[str, float | None] = field(default_factory=dict)
    note: str = ""
    capped_at: float | None = None
    gap_s: float | None = None
    """The running ranks' longest time between two steps around the change (ours, agreements only)."""

    @property
    def seconds(self) -> float | None:
        return None if self.first_step is None else self.first_step - self.trigger

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "world": self.world, "seconds": self.seconds, "stages": self.stages,
                "note": self.note, "capped_at": self.capped_at, "trigger_unix": self.trigger, "gap_s": self.gap_s}


def since(trigger: float, ts: float | None) -> float | None:
    return None if ts is None else round(ts - trigger, 3)


async def wait_first_step(
    watcher: LogWatcher, world: int, after: float, timeout: float,
    also: Callable[[], Awaitable[None]] | None = None, interval: float = 0.05,
) -> LogEvent | None:
    deadline = time.monotonic() + timeout
    while True:
        watcher.poll()
        if also is not None:
            await also()
        event = watcher.first("step", after=after, world=world)
        if event is not None:
            return event
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(interval)


async def wait_steps(watcher: LogWatcher, world: int, after: float, count: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        watcher.poll()
        if watcher.steps_at(world, after=after) >= count:
            return True
        await asyncio.sleep(0.1)
    return False


def common_stages(watcher: LogWatcher, t: Transition) -> None:
    """Rendezvous complete (last node), rank 0 ready, from the node logs, between the trigger and the first step."""
    if t.first_step is None:
        return
    t.stages["rendezvous begins"] = since(
        t.trigger, watcher.last_per_source("rdzv_begin", after=t.trigger, before=t.first_step))
    t.stages["rendezvous complete"] = since(
        t.trigger, watcher.last_per_source("rdzv_done", after=t.trigger, before=t.first_step))
    ready = watcher.first("ready", after=t.trigger, world=t.world, before=t.first_step)
    t.stages["workers ready"] = since(t.trigger, None if ready is None else ready.ts)


# -- ours: a whole provider -------------------------------------------------------------------------------------------

GROUPS = ("g1", "g1", "g2", "g2")


class Provider:
    """nats-server, the API (in this process, with its outbox relay), fleet-monitor and one agent per host."""

    def __init__(self, data_dir: Path, hosts: int) -> None:
        self.data_dir = data_dir
        self.hosts = {f"{TAG}-h{i + 1}": GROUPS[i % len(GROUPS)] for i in range(hosts)}
        self.secret = secrets.token_hex(24).encode()
        self.cloud = cloud_id(self.secret, data_dir)  # what its agents derive from HZ_PROVIDER_SECRET and HZ_DATA_DIR
        CLOUDS.append(self.cloud)
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.others: list[subprocess.Popen[bytes]] = []
        self.frozen: set[str] = set()
        self.killed: set[str] = set()

    async def __aenter__(self) -> Provider:
        from api.app import create_app
        from api.migrate import upgrade_async
        from api.serving import serve_api
        from broker_config.keys import ProviderKeys
        from broker_config.provider_bus import NatsProviderBus
        from broker_config.provisioner import NatsTenantBroker
        from broker_config.render import render_accounts
        from broker_config.server import NatsServer
        from harmonaize.settings import Settings

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.nats = NatsServer(self.data_dir / "nats", accounts_text=render_accounts(ProviderKeys(self.secret), []))
        self.nats.start()
        self.bus = None
        self.serving = None
        self.admin: httpx.AsyncClient | None = None
        self.tenant: httpx.AsyncClient | None = None
        self.offered_at: float | None = None
        self.warmed_at: float | None = None
        try:
            broker = NatsTenantBroker(servers=[self.nats.url], provider_secret=self.secret,
                                      accounts_file=self.nats.accounts_file, reload=self.nats.reload)
            settings = Settings(_env_file=None, data_dir=self.data_dir, admin_token=ADMIN_TOKEN,
                                provider_secret=self.secret.decode(), nats_url=self.nats.url)
            await upgrade_async(settings)
            self.bus = NatsProviderBus([self.nats.url], provider_secret=self.secret)
            self.serving = await serve_api(create_app(settings, broker=broker, bus=self.bus), host="127.0.0.1", port=0)
            install_signal_handlers()  # uvicorn took SIGINT/SIGTERM while it serves
            self.api_url = f"http://127.0.0.1:{self.serving.port}"
            self.admin = httpx.AsyncClient(base_url=self.api_url, timeout=30,
                                           headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            created = await self.admin.post("/v1/tenants", json={"id": TENANT, "display_name": "Acme"})
            created.raise_for_status()
            for host, group in self.hosts.items():
                (await self.admin.post("/v1/hosts", json={"id": host, "gpus": 1, "locality_group": group})
                 ).raise_for_status()
            self.tenant = httpx.AsyncClient(base_url=self.api_url, timeout=30,
                                            headers={"Authorization": f"Bearer {created.json()['api_token']}"})
            self.others.append(self._spawn("fleet-monitor", f"{TAG}-monitor", "fleet-monitor", "--log-level", "INFO"))
            for host, group in self.hosts.items():
                self.agents[host] = self._spawn(
                    f"agent-{host}", f"{TAG}-agent-{host}", "agent", "--host-id", host, "--locality-group", group,
                    "--gpus", "1", "--tick", "0.2", "--grace", "20",
                    "--checkpoint-root", str(self.data_dir / "checkpoints"),
                )
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def env(self, marker: str) -> dict[str, str]:
        return {
            **child_env(marker),
            "HZ_PROVIDER_SECRET": self.secret.decode(),
            "HZ_NATS_URL": self.nats.url,
            "HZ_ADMIN_TOKEN": ADMIN_TOKEN,
            "HZ_API_URL": self.api_url,
            "HZ_DATA_DIR": str(self.data_dir),
        }

    def _spawn(self, name: str, marker: str, *args: str) -> subprocess.Popen[bytes]:
        with open(self.data_dir / f"{name}.log", "ab") as log:
            return subprocess.Popen([sys.executable, "-m", "provider_agents.cli", *args], cwd=ROOT,
                                    env=self.env(marker), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def host_pids(self, host: str) -> list[int]:
        """The agent and every process carrying the host's marker (its node, its warm torchrun agent)."""
        agent = self.agents[host]
        nodes = marked_processes(host_prefix(self.cloud, host), prefix=True)
        return ([agent.pid] if agent.poll() is None else []) + nodes

    def kill_host(self, host: str) -> float:
        """The machine dies: SIGKILL the agent and every process of its node; returns the moment it began."""
        pids = self.host_pids(host)
        began = time.time()
        signal_pids(pids, signal.SIGKILL)
        signal_pids(marked_processes(host_prefix(self.cloud, host), prefix=True), signal.SIGKILL)  # forked meanwhile
        self.killed.add(host)
        return began

    def freeze_host(self, host: str) -> float:
        pids = self.host_pids(host)
        began = time.time()
        signal_pids(pids, signal.SIGSTOP)
        self.frozen.add(host)
        return began

    def node_pids(self, host: str) -> list[int]:
        """The job's node on `host`: its torchrun agent and workers (by the markers its launcher recorded), not the
        host's agent nor its warm spare torchrun."""
        state = json.loads((self.data_dir / "hosts" / host / "jobs" / f"{TENANT}.{JOB}" / "node.json").read_text())
        markers = [state["marker"], *([state["agent_marker"]] if state.get("agent_marker") else [])]
        return sorted({pid for marker in markers for pid in marked_processes(marker)})

    def kill_node(self, host: str) -> float:
        """The job's node dies, its host's agent lives (and reports it)."""
        pids = self.node_pids(host)
        began = time.time()
        signal_pids(pids, signal.SIGKILL)
        return began

    def freeze_node(self, host: str) -> float:
        """The job's node hangs (SIGSTOP), its host's agent lives (and finds it stopped)."""
        pids = self.node_pids(host)
        began = time.time()
        signal_pids(pids, signal.SIGSTOP)
        return began

    async def close(self) -> None:
        # nodes first (no graceful checkpoint wanted), then the processes, then the API, the bus and the broker
        for host in self.hosts:
            pids = marked_processes(host_prefix(self.cloud, host), prefix=True)
            signal_pids(pids, signal.SIGCONT)
            signal_pids(pids, signal.SIGKILL)
        procs = [*self.agents.values(), *self.others]
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.tenant is not None:
            await self.tenant.aclose()
        if self.admin is not None:
            await self.admin.aclose()
        if self.serving is not None:
            await self.serving.stop()
        if self.bus is not None:
            await self.bus.close()
        self.nats.stop()

    # -- API helpers --

    async def negotiate(self, workers: int, *, warm_timeout: float = 0.0) -> float:
        """Request a scale to `workers` and accept the first option; returns when the accept response arrived.

        `warm_timeout` > 0: accept only once the offer's warm joiner stands by (its node log says so), as a tenant
        that takes a moment to decide would; when it did is `self.warmed_at` (None: not in time), when the
        negotiation was opened `self.offered_at`.
        """
        assert self.tenant is not None
        opened_at = time.time()
        opened = await self.tenant.post("/v1/negotiations", headers={"Idempotency-Key": secrets.token_hex(8)},
                                        json={"job": JOB, "kind": "scale", "terms": {"desired_workers": workers}})
        if opened.status_code != 201 or opened.json().get("state") != "offered":
            raise RuntimeError(
                f"negotiation to {workers} workers not offered: {opened.status_code} {opened.text[:300]}")
        self.offered_at, self.warmed_at = opened_at, None
        deadline = time.monotonic() + warm_timeout
        while time.monotonic() < deadline:
            if self.standing_by(after=opened_at):
                self.warmed_at = time.time()
                break
            await asyncio.sleep(0.05)
        accepted = await self.tenant.post(f"/v1/negotiations/{opened.json()['id']}/accept", json={"option": 0})
        done = time.time()
        if accepted.status_code != 200:
            raise RuntimeError(f"accept failed: {accepted.status_code} {accepted.text[:300]}")
        return done

    def standing_by(self, *, after: float) -> bool:
        """Whether a node of the job started after `after` stands by for an offer, model built."""
        for path in self.data_dir.glob(f"hosts/*/jobs/{TENANT}.{JOB}/node-e*.log"):
            try:
                if path.stat().st_mtime >= after and STANDBY_TEXT in path.read_text(errors="replace"):
                    return True
            except OSError:
                continue
        return False

    async def status(self) -> dict[str, Any]:
        assert self.tenant is not None
        reply = await self.tenant.get(f"/v1/jobs/{JOB}/status")
        reply.raise_for_status()
        return dict(reply.json())

    async def down_at(self, host: str) -> float | None:
        assert self.admin is not None
        reply = await self.admin.get("/v1/hosts")
        reply.raise_for_status()
        for item in reply.json():
            if item["id"] == host and item.get("down_at"):
                return dt.datetime.fromisoformat(item["down_at"].replace("Z", "+00:00")).timestamp()
        return None


class ApiProbe:
    """Polls, at most every `interval` s, what the tenant sees (progress at a world size) and a host's `down_at`."""

    def __init__(self, provider: Provider, world: int, epoch_above: int, down_host: str | None = None,
                 interval: float = 0.1) -> None:
        self.p = provider
        self.world = world
        self.epoch_above = epoch_above
        self.down_host = down_host
        self.interval = interval
        self._next = 0.0
        self.seen: float | None = None
        self.down: float | None = None
        self.errors = 0

    async def __call__(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval
        try:
            if self.seen is None:
                progress = (await self.p.status())["progress"]
                if (progress and progress["world_size"] == self.world and progress["epoch"] > self.epoch_above
                        and progress["step"] > (progress["resumed_from_step"] or 0)):
                    self.seen = time.time()
            if self.down_host is not None and self.down is None:
                self.down = await self.p.down_at(self.down_host)
        except httpx.HTTPError:
            self.errors += 1


def rank0_host(watcher: LogWatcher) -> str | None:
    """The host whose node logged the latest step (rank 0 logs them; in place, rank 0 can move between hosts)."""
    for e in reversed(watcher.events):
        if e.kind == "step":
            return e.source.split("/")[1]
    return None


def hosts_of_epoch(provider: Provider, epoch: int) -> list[str]:
    """Hosts whose node is in `epoch` (in place a node keeps its log from the epoch it started in)."""
    hosts = []
    for h in provider.hosts:
        state = provider.data_dir / "hosts" / h / "jobs" / f"{TENANT}.{JOB}" / "node.json"
        try:
            if json.loads(state.read_text())["spec"]["epoch"] == epoch and h not in provider.killed:
                hosts.append(h)
        except (OSError, ValueError, KeyError):
            continue
    return sorted(hosts)


def longest_gap(watcher: LogWatcher, trigger: float, first_step: float | None) -> float | None:
    """The longest time between two consecutive steps (any world size) from just before `trigger` to a second
    after the first step at the new size: how long the running ranks stood still for the change."""
    if first_step is None:
        return None
    stamps = sorted(e.ts for e in watcher.events if e.kind == "step" and trigger - 1.0 <= e.ts <= first_step + 1.0)
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return round(max(gaps), 4) if gaps else None


async def run_ours(
    args: argparse.Namespace, workdir: Path, log: Callable[[str], None], out: dict[str, Transition]
) -> None:
    async with Provider(workdir, hosts=4) as p:
        watcher = LogWatcher(p.data_dir, ("hosts/*/jobs/*/node-e*.log", "agent-*.log", "fleet-monitor.log"))
        assert p.tenant is not None
        await asyncio.sleep(1.0)  # agents connected and heartbeating before the job exists
        body = {
            "id": JOB, "min_workers": 1, "max_workers": 4, "initial_workers": 2, "entrypoint": job_args(args),
            # ranges pinned to the job's own settings: the micro loop can change nothing, as under torchrun alone
            "checkpoint_interval_steps": {"min": args.checkpoint_interval, "max": args.checkpoint_interval},
        }

        async def epoch_now() -> int:
            return int((await p.status())["placement_epoch"])

        async def transition(name: str, world: int, trigger: float, probe: ApiProbe, timeout: float) -> Transition:
            t = Transition(name, world, trigger)
            event = await wait_first_step(watcher, world, trigger, timeout, also=probe)
            if event is None:
                t.note = f"no step at world {world} within {timeout:.0f} s"
                log(f"  ours: {name}: {t.note}")
                return t
            t.first_step = event.ts
            for _ in range(30):  # the tenant's view and the outage record, if not seen yet
                if probe.seen is not None and (probe.down_host is None or probe.down is not None):
                    break
                probe._next = 0.0
                await probe()
                await asyncio.sleep(0.1)
            watcher.poll()
            epoch = await epoch_now()
            started = [e.ts for e in watcher.events
                       if e.kind == "node_started" and e.epoch == epoch and trigger < e.ts <= event.ts]
            if probe.down_host is not None:
                t.stages["failure event (down_at)"] = since(trigger, probe.down)
                mon = watcher.first("down", after=trigger - 1)
                t.stages["monitor: host down"] = since(trigger, None if mon is None else mon.ts)
            t.stages["nodes (re)started"] = since(trigger, max(started) if started else None)
            common_stages(watcher, t)
            t.stages["tenant sees it (API)"] = since(trigger, probe.seen)
            log(f"  ours: {name}: {t.seconds:.2f} s")
            return t

        created_at = time.time()
        reply = await p.tenant.post("/v1/jobs", json=body)
        if reply.status_code != 201:
            raise RuntimeError(f"job not created: {reply.status_code} {reply.text[:300]}")
        out["launch"] = await transition("launch on 2 hosts", 2, created_at, ApiProbe(p, 2, -1), args.timeout)

        async def settle(world: int, after: float) -> None:
            if not await wait_steps(watcher, world, after, args.settle_steps, args.timeout):
                raise RuntimeError(f"ours: the job did not run {args.settle_steps} steps at world {world}")

        await settle(2, created_at)

        async def agreement(key: str, workers: int, world_before: int) -> None:
            epoch = await epoch_now()
            accepted = await p.negotiate(workers, warm_timeout=args.warm_timeout if workers > world_before else 0.0)
            out[key] = t = await transition(f"agreement {world_before} -> {workers}", workers, accepted,
                                            ApiProbe(p, workers, epoch), args.timeout)
            if workers > world_before:
                t.stages["negotiation opened (before the accept)"] = since(accepted, p.offered_at)
                t.stages["joiner standing by (before the accept)"] = since(accepted, p.warmed_at)
                if p.warmed_at is None:
                    t.note = f"the warm joiner was not standing by within {args.warm_timeout:.0f} s: accepted cold"
            await settle(workers, accepted)
            watcher.poll()
            t.gap_s = longest_gap(watcher, accepted, t.first_step)

        await agreement("scale_up", 3, 2)
        await agreement("scale_down", 2, 3)

        async def fail_a_follower(key: str, verb: str, fail: Callable[[str], float], *, host: bool) -> None:
            """Fail one host (or only its node) of the job that is not rank 0's (so the survivor's log keeps timing
            the steps), then grow back to 2."""
            epoch = await epoch_now()
            watcher.poll()
            leader = rank0_host(watcher)
            victim = next(h for h in hosts_of_epoch(p, epoch) if h != leader)
            failed = fail(victim)
            probe = ApiProbe(p, 1, epoch, victim if host else None)
            out[key] = await transition(f"{verb} {victim}", 1, failed, probe, args.timeout)
            out[key].note = f"victim {victim} (not rank 0), survivor {leader}"
            if out[key].first_step is not None:
                await settle(1, failed)

        await fail_a_follower("node_kill", "kill -9 of the node on", p.kill_node, host=False)
        await agreement("grow", 2, 1)
        await fail_a_follower("node_freeze", "SIGSTOP of the node on", p.freeze_node, host=False)
        await agreement("grow_2", 2, 1)
        await fail_a_follower("kill", "kill -9 of host", p.kill_host, host=True)
        await agreement("grow_3", 2, 1)
        await fail_a_follower("freeze", "SIGSTOP of host", p.freeze_host, host=True)
        directives = await p.tenant.get(f"/v1/jobs/{JOB}/directives")
        out["launch"].note = f"directives issued during the run: {len(directives.json())}"


# -- torchrun alone ---------------------------------------------------------------------------------------------------


class TorchrunJob:
    """Plain torchrun nodes of one job on one c10d endpoint, each node its own session and marker."""

    def __init__(self, directory: Path, name: str, nnodes: str, args: argparse.Namespace) -> None:
        self.dir = directory
        self.name = name
        self.nnodes = nnodes
        self.args = args
        self.port = free_port()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}

    def marker(self, node: str) -> str:
        return f"{TAG}-{self.name}.{node}"

    def start_node(self, node: str) -> float:
        env = child_env(self.marker(node))
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nnodes}", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.name}",
            "--max-restarts=3", f"--log-dir={self.dir / 'torchelastic'}", *job_args(self.args),
            "--checkpoint-dir", str(self.dir / "checkpoints"),
        ]
        began = time.time()
        with open(self.dir / f"node-{node}.log", "ab") as log:
            self.nodes[node] = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True)
        return began

    async def start_store_host(self, node: str, timeout: float = 60.0) -> float:
        """Start `node` and wait until it hosts the rendezvous store (it binds the endpoint's port)."""
        began = self.start_node(node)
        deadline = time.monotonic() + timeout
        while not port_open(self.port):
            if time.monotonic() > deadline or self.nodes[node].poll() is not None:
                raise RuntimeError(f"torchrun {self.name}/{node} did not open its rendezvous store")
            await asyncio.sleep(0.05)
        return began

    def pids(self, node: str) -> list[int]:
        return marked_processes(self.marker(node))

    def kill(self, node: str) -> float:
        pids = self.pids(node)
        began = time.time()
        signal_pids(pids, signal.SIGKILL)
        signal_pids(self.pids(node), signal.SIGKILL)
        return began

    def freeze(self, node: str) -> float:
        pids = self.pids(node)
        began = time.time()
        signal_pids(pids, signal.SIGSTOP)
        return began

    def stop(self) -> None:
        for node in self.nodes:
            pids = self.pids(node)
            signal_pids(pids, signal.SIGCONT)
            signal_pids(pids, signal.SIGKILL)
        for proc in self.nodes.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


async def run_torchrun(
    args: argparse.Namespace, workdir: Path, log: Callable[[str], None], out: dict[str, Transition]
) -> None:

    def finish(watcher: LogWatcher, t: Transition, event: LogEvent | None, timeout: float) -> Transition:
        if event is None:
            t.note = f"no step at world {t.world} within {timeout:.0f} s"
            t.capped_at = timeout
            log(f"  torchrun: {t.name}: {t.note}")
            return t
        t.first_step = event.ts
        seen = [e.ts for e in watcher.events
                if e.kind in ("group_failed", "new_nodes") and t.trigger < e.ts <= event.ts]
        t.stages["torchrun: change seen"] = since(t.trigger, min(seen) if seen else None)
        common_stages(watcher, t)
        log(f"  torchrun: {t.name}: {t.seconds:.2f} s")
        return t

    job = TorchrunJob(workdir / "job1", "tr1", "1:3", args)
    watcher = LogWatcher(job.dir, ("node-*.log",))
    try:
        began = await job.start_store_host("a")
        job.start_node("b")
        t = Transition("launch on 2 nodes (1:3)", 2, began)
        out["launch"] = finish(watcher, t, await wait_first_step(watcher, 2, began, args.timeout + 60), args.timeout)
        if not await wait_steps(watcher, 2, began, args.settle_steps, args.timeout):
            raise RuntimeError("torchrun job 1 did not run at world 2")
        began = job.start_node("c")
        t = Transition("third node started (1:3)", 3, began)
        out["scale_up"] = finish(watcher, t, await wait_first_step(watcher, 3, began, args.timeout), args.timeout)
    finally:
        job.stop()

    job = TorchrunJob(workdir / "job2", "tr2", "1:2", args)
    watcher = LogWatcher(job.dir, ("node-*.log",))
    try:
        began = await job.start_store_host("a")
        job.start_node("b")
        t = Transition("launch on 2 nodes (1:2)", 2, began)
        out["launch_max"] = finish(watcher, t, await wait_first_step(watcher, 2, began, args.timeout), args.timeout)
        if not await wait_steps(watcher, 2, began, args.settle_steps, args.timeout):
            raise RuntimeError("torchrun job 2 did not run at world 2")
        failed = job.kill("b")
        t = Transition("kill -9 node b", 1, failed, note="victim b (not the store host)")
        out["kill"] = finish(watcher, t, await wait_first_step(watcher, 1, failed, args.timeout), args.timeout)
        if out["kill"].first_step is not None:
            await wait_steps(watcher, 1, failed, args.settle_steps, args.timeout)
            began = job.start_node("c")
            t = Transition("second node started again (1:2)", 2, began)
            out["grow"] = finish(watcher, t, await wait_first_step(watcher, 2, began, args.timeout), args.timeout)
            if out["grow"].first_step is not None:
                await wait_steps(watcher, 2, began, args.settle_steps, args.timeout)
                failed = job.freeze("c")
                t = Transition("freeze node c", 1, failed, note="victim c (not the store host)")
                event = await wait_first_step(watcher, 1, failed, args.freeze_cap, interval=0.2)
                out["freeze"] = finish(watcher, t, event, args.freeze_cap)
                watcher.poll()
                last = max((e.ts for e in watcher.events if e.kind == "step"), default=failed)
                out["freeze"].stages["last step before the freeze"] = since(failed, last)
    finally:
        job.stop()


# -- report -----------------------------------------------------------------------------------------------------------

MAIN_ROWS: list[tuple[str, str | None, str, str]] = [
    ("scale_up", "scale_up", "(a) agreement 2 -> 3: accept -> first step at 3",
     "third node started -> first step at 3"),
    ("node_kill", "kill", "(b) kill -9 of a node (its host's agent lives) -> first step at 1",
     "kill -9 of node b (agent + worker)"),
    ("node_freeze", "freeze", "(b) SIGSTOP of a node (its host's agent lives) -> first step at 1",
     "SIGSTOP of node c"),
    ("kill", "kill", "(b) kill -9 of 1 of 2 hosts -> first step at 1", "same (node b: agent + worker)"),
    ("freeze", "freeze", "(b) frozen host (SIGSTOP) -> first step at 1", "same (node c)"),
]
CONTEXT_ROWS: list[tuple[str, str | None, str, str]] = [
    ("launch", "launch", "launch on 2 hosts -> first step at 2", "2 of max 3 nodes: waits last call"),
    ("launch", "launch_max", "launch on 2 hosts -> first step at 2", "2 of max 2 nodes: closes at once"),
    ("grow", "grow", "agreement 1 -> 2: accept -> first step at 2", "node started, 1 -> 2 of max 2"),
    ("scale_down", None, "agreement 3 -> 2: accept -> first step at 2",
     "(none: a torchrun node leaves only by failing)"),
]
NODE_ROWS = ("node_kill", "node_freeze")
"""Rows compared with another scenario's baseline but keyed by their own name in the summary."""
GAP_ROWS = ("scale_up", "scale_down", "grow")
"""Agreements: the running ranks' longest step gap is reported (`ours_gap_s`)."""


def row_id(ours_key: str, tr_key: str | None) -> str:
    """The summary's key of a row: ours' transition, plus the torchrun case where it is another name."""
    return ours_key if tr_key in (ours_key, None) or ours_key in NODE_ROWS else f"{ours_key}_vs_{tr_key}"


def _values(reps: list[dict[str, Any]], side: str, key: str | None, stage: str | None = None) -> list[float | None]:
    vals: list[float | None] = []
    for rep in reps:
        t = rep.get(side, {}).get(key) if key else None
        if t is None:
            continue
        vals.append(t["seconds"] if stage is None else t["stages"].get(stage))
    return vals


def _fmt_s(vals: list[float | None], capped: float | None = None) -> str:
    got = [v for v in vals if v is not None]
    if not vals:
        return "-"
    if not got:
        return f"none in {capped:.0f} s" if capped else "none"
    text = f"{median(got):.2f}"
    if len(got) > 1:
        text += f" ({min(got):.1f}-{max(got):.1f})"
    if len(got) < len(vals):
        text += f" [{len(vals) - len(got)} none]"
    return text


def summarize(reps: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for ours_key, tr_key, _, _ in MAIN_ROWS + CONTEXT_ROWS:
        ours = [v for v in _values(reps, "ours", ours_key) if v is not None]
        base = [v for v in _values(reps, "torchrun", tr_key) if v is not None] if tr_key else []
        entry: dict[str, Any] = {"ours_s": median(ours) if ours else None, "torchrun_s": median(base) if base else None}
        entry["ratio"] = (entry["ours_s"] / entry["torchrun_s"]
                          if entry["ours_s"] is not None and entry["torchrun_s"] else None)
        if tr_key == "freeze" and ours and not base:
            entry["ratio_upper_bound"] = median(ours) / args.freeze_cap
        entry["torchrun_case"] = tr_key
        if ours_key in GAP_ROWS:
            gaps = [t["gap_s"] for rep in reps if (t := rep.get("ours", {}).get(ours_key)) and t.get("gap_s")]
            entry["ours_gap_s"] = median(gaps) if gaps else None
        summary[row_id(ours_key, tr_key)] = entry
    tf = {key: [t for rep in reps if (t := rep.get("torchft", {}).get(key))] for key in torchft_side.SCENARIOS}
    if any(tf.values()):
        for key, runs in tf.items():
            summary[key]["torchft_s"] = median([t["seconds"] for t in runs]) if runs else None
            summary[key]["torchft_gap_s"] = median([t["gap_s"] for t in runs]) if runs else None
        for node_key, same in (("node_freeze", "freeze"), ("node_kill", "kill")):
            summary[node_key]["torchft_s"] = summary[same]["torchft_s"]
            summary[node_key]["torchft_gap_s"] = summary[same]["torchft_gap_s"]
            summary[node_key]["torchft_note"] = f"torchft: a node is a replica group, the same case as {same}"
    for key in ("kill", "freeze"):
        after = [t["seconds"] - t["stages"]["failure event (down_at)"] for rep in reps
                 if (t := rep.get("ours", {}).get(key)) and t["seconds"] is not None
                 and t["stages"].get("failure event (down_at)") is not None]
        summary[f"{key}_after_event_s"] = median(after) if after else None
        summary[f"{key}_target_met"] = (median(after) <= TARGET_AFTER_EVENT_S) if after else None
    return summary


def render(reps: list[dict[str, Any]], summary: dict[str, Any], meta: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"bench_elastic  {meta['date']}  {meta['machine']}  code: {meta['git']}",
        f"torch {meta['torch']} (gloo, CPU), nats-server {meta['nats_server']}; job: {' '.join(job_args(args))}, "
        f"1 worker per host; {args.repeat} repeat(s); load average at start {meta['loadavg']}, "
        f"at end {meta.get('loadavg_end', '?')}",
        "seconds from the trigger to rank 0's first logged training step at the new world size (log timestamps); "
        "median over repeats (min-max)",
        "torchrun alone: c10d, default rendezvous settings, --max-restarts=3, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, "
        "victims never host the store",
        "",
    ]
    rows = []
    for ours_key, tr_key, label, _base_label in MAIN_ROWS:
        ours = _values(reps, "ours", ours_key)
        base = _values(reps, "torchrun", tr_key)
        entry = summary[row_id(ours_key, tr_key)]
        if entry["ratio"] is not None:
            ratio_text = f"{entry['ratio']:.2f}x"
        elif entry.get("ratio_upper_bound") is not None:
            ratio_text = f"< {entry['ratio_upper_bound']:.2f}x"
        else:
            ratio_text = "-"
        base_text = _fmt_s(base, args.freeze_cap if tr_key == "freeze" else args.timeout)
        frozen_forever = tr_key == "freeze" and bool(base) and not [v for v in base if v is not None]
        if frozen_forever:
            base_text = f"none in {args.freeze_cap:.0f} s *"
        tf = entry.get("torchft_s")
        rows.append([label, _fmt_s(ours), "-" if tf is None else f"{tf:.2f}", base_text, ratio_text])
        if ours_key in GAP_ROWS:
            gap, tf_gap = entry.get("ours_gap_s"), entry.get("torchft_gap_s")
            rows.append(["    the running ranks' longest step gap", "-" if gap is None else f"{gap:.3f}",
                         "-" if tf_gap is None else f"{tf_gap:.3f}", "(all restart)", ""])
        if ours_key in ("kill", "freeze"):
            rows.append(["    failure -> failure event (host down_at)",
                         _fmt_s(_values(reps, "ours", ours_key, "failure event (down_at)")), "", "", ""])
            after = [t["seconds"] - t["stages"]["failure event (down_at)"] for rep in reps
                     if (t := rep.get("ours", {}).get(ours_key)) and t["seconds"] is not None
                     and t["stages"].get("failure event (down_at)") is not None]
            met = summary[f"{ours_key}_target_met"]
            verdict = "-" if met is None else "met" if met else "MISSED"
            rows.append(["    failure event -> first step", _fmt_s(after), "", "",
                         f"target <= {TARGET_AFTER_EVENT_S:.0f} s: " + verdict])
    footnote = (f"* torchrun alone: the survivor blocks in a gloo collective until the process-group timeout "
                f"({meta['pg_timeout_s'] / 60:.0f} min, torch's default), then fails and re-rendezvouses (~45 s as "
                f"after a kill): ~{(meta['pg_timeout_s'] + 45) / 60:.0f} min. Ratio: ours / the cap, an upper bound.")
    lines.append(table(["scenario", "ours s", "torchft s (3 -> 2)", "torchrun alone s", "ours/torchrun"], rows))
    if any(r[3].endswith("*") for r in rows):
        lines.append(footnote)

    rows = []
    for ours_key, tr_key, label, base_label in CONTEXT_ROWS:
        entry = summary[row_id(ours_key, tr_key)]
        base_text = _fmt_s(_values(reps, "torchrun", tr_key), args.timeout) if tr_key else "-"
        rows.append([label, _fmt_s(_values(reps, "ours", ours_key)), base_text, base_label,
                     "-" if entry["ratio"] is None else f"{entry['ratio']:.2f}x"])
    lines += ["", "context", table(["transition", "ours s", "torchrun s", "torchrun case", "ratio"], rows)]

    stage_order = ["torchrun: change seen", "monitor: host down", "failure event (down_at)", "nodes (re)started",
                   "rendezvous begins", "rendezvous complete", "workers ready", "tenant sees it (API)"]
    rows = []
    for side, key, label in [("ours", "scale_up", "ours (a) 2 -> 3"), ("torchrun", "scale_up", "torchrun (a) 2 -> 3"),
                             ("ours", "kill", "ours kill"), ("torchrun", "kill", "torchrun kill"),
                             ("ours", "freeze", "ours frozen"), ("torchrun", "freeze", "torchrun frozen"),
                             ("ours", "grow", "ours 1 -> 2"), ("torchrun", "grow", "torchrun 1 -> 2")]:
        cells = []
        for stage in stage_order:
            vals = [v for v in _values(reps, side, key, stage) if v is not None]
            cells.append(f"{median(vals):.2f}" if vals else "-")
        total = [v for v in _values(reps, side, key) if v is not None]
        rows.append([label, *cells, f"{median(total):.2f}" if total else "-"])
    short = ["change seen", "host down (log)", "down_at", "node started", "rdzv begins", "rdzv done", "rank0 ready",
             "tenant (API)", "first step"]
    lines += ["", "where the time goes (median s after the trigger; '-': no such stage or not reached)",
              table(["", *short], rows)]
    if any(rep.get("torchft") for rep in reps):
        lines += ["", render_torchft(reps)]
    reaped = {side: sum(rep.get("reaped", {}).get(side, 0) for rep in reps)
              for side in ("ours", "torchrun", "torchft")}
    lines += ["", f"checks: processes left after a side and reaped by marker: ours {reaped['ours']}, "
                  f"torchrun {reaped['torchrun']}"
              + (f", torchft {reaped['torchft']}" if any("torchft" in rep.get("reaped", {}) for rep in reps) else "")]
    for rep in reps:
        for side, error in rep.get("errors", {}).items():
            lines.append(f"ERROR in repeat {rep['repeat']}, {side}: {error} (the figures after it are missing)")
    notes = [f"{side} {t['name']}: {t['note']}" for rep in reps for side in ("ours", "torchrun")
             for t in rep.get(side, {}).values() if t.get("note")]
    if notes:
        lines += ["", "notes: " + "; ".join(dict.fromkeys(notes))]
    return "\n".join(lines)


def render_torchft(reps: list[dict[str, Any]]) -> str:
    """The torchft column: its own table, since its failures are 3 -> 2 groups (ours and torchrun's: 2 -> 1)."""
    s = torchft_side.settings()
    rows = []
    for key, label in [("scale_up", "scale-up 2 -> 3 (3rd group started)"),
                       ("scale_down", "scale-down 3 -> 2 (SIGTERM: leaves after its step)"),
                       ("kill", "kill -9 of 1 of 3 groups -> first step at 2"),
                       ("freeze", "SIGSTOP of 1 of 3 groups (= node_freeze) -> first step at 2")]:
        runs = [t for rep in reps if (t := rep.get("torchft", {}).get(key))]
        rows.append([label, _fmt_s([t["seconds"] for t in runs]), _fmt_s([t["gap_s"] for t in runs]),
                     ", ".join(str(t["steps_lost"]) for t in runs) or "-",
                     "yes" if any(t["survivors_restarted"] for t in runs) else "no"])
    return "\n".join([
        f"torchft {s['torchft']} (bench/torchft_side.py): 3 replica groups x 1 process, lighthouse join timeout "
        f"{s['join_timeout_ms']} ms, heartbeat {s['heartbeat_s']:.0f} s (timeout {s['heartbeat_timeout_ms']} ms), "
        f"gloo/manager timeout {s['timeout_s']:.0f} s, {s['wrapper']}",
        table(["torchft transition", "torchft s", "survivors' longest step gap s", "steps lost", "survivor restarted"],
              rows)])


# -- main -------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeat", type=int, default=1, help="repeats, each running ours and torchrun alone (default 1,"
                                                          " ~5 min each); the side that goes first alternates")
    ap.add_argument("--only", choices=["ours", "torchrun", "torchft"], help="run one side only (no ratios)")
    ap.add_argument("--step-delay-ms", type=float, default=50.0, help="the job's sleep after each step (default 50)")
    ap.add_argument("--checkpoint-interval", type=int, default=20, help="the job's checkpoint interval (default 20)")
    ap.add_argument("--settle-steps", type=int, default=25,
                    help="steps run at a world size before the next trigger (default 25)")
    ap.add_argument("--warm-timeout", type=float, default=30.0,
                    help="seconds a scale-up waits for the offer's warm joiner before accepting (default 30; 0: "
                         "accept at once, cold)")
    ap.add_argument("--freeze-cap", type=float, default=120.0,
                    help="seconds torchrun alone is given to recover from a frozen host (default 120)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds any other transition may take (120)")
    ap.add_argument("--dir", type=Path, help="parent of the temp dir (logs, checkpoints, broker store)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (every process's log)")
    ap.add_argument("--json", metavar="PATH", help="also write all figures as JSON to PATH ('-': stdout, no table)")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.settle_steps < 1 or args.freeze_cap <= 0 or args.timeout <= 0:
        ap.error("--repeat, --settle-steps, --freeze-cap and --timeout must be positive")
    args.json_only = args.json == "-"
    return args


async def bench(args: argparse.Namespace, workdir: Path, log: Callable[[str], None]) -> list[dict[str, Any]]:
    reps: list[dict[str, Any]] = []
    with_torchft = args.only in (None, "torchft") and torchft_side.available()
    if args.only in (None, "torchft") and not with_torchft:
        log(torchft_side.INSTALL_HINT)
    for r in range(args.repeat):
        sides = [args.only] if args.only else (["ours", "torchrun"] if r % 2 == 0 else ["torchrun", "ours"])
        rep: dict[str, Any] = {"repeat": r + 1, "loadavg": {}}
        sides = [s for s in sides if s != "torchft"]
        if with_torchft:
            rep["loadavg"]["torchft"] = loadavg()
            log(f"repeat {r + 1}/{args.repeat}: torchft (load average {loadavg()})")
            try:
                got = await asyncio.to_thread(
                    torchft_side.run_scenarios, 1, marker=f"{TAG}-tf{r + 1}-",
                    step_delay_ms=int(args.step_delay_ms), timeout=min(args.timeout, 60.0), workdir=workdir,
                    keep=args.keep, progress=lambda m: log("  " + m))
                rep["torchft"] = {k: v["runs"][0] for k, v in got.items() if k != "node_freeze" and v["runs"]}
            except Exception as exc:  # report what was measured, and why the rest was not
                log(f"  torchft stopped: {exc!r}")
                rep.setdefault("errors", {})["torchft"] = repr(exc)
            finally:
                rep.setdefault("reaped", {})["torchft"] = len(reap())
        for side in sides:
            log(f"repeat {r + 1}/{args.repeat}: {side} (load average {loadavg()})")
            rep["loadavg"][side] = loadavg()
            run = run_ours if side == "ours" else run_torchrun
            result: dict[str, Transition] = {}
            try:
                await run(args, workdir / f"r{r + 1}-{side}", log, result)
            except Exception as exc:  # report what was measured, and why the rest was not
                log(f"  {side} stopped: {exc!r}")
                rep.setdefault("errors", {})[side] = repr(exc)
            finally:
                leftovers = reap()
                rep.setdefault("reaped", {})[side] = len(leftovers)
                if leftovers:
                    log(f"  reaped {len(leftovers)} leftover process(es) after {side}")
            rep[side] = {k: t.as_dict() for k, t in result.items()}
        reps.append(rep)
    return reps


def pg_timeout_s() -> float:
    try:
        from torch.distributed.constants import default_pg_timeout

        return float(default_pg_timeout.total_seconds())
    except Exception:  # noqa: BLE001 - only for the report
        return PG_TIMEOUT_S


_CLEANUP: dict[str, Any] = {"workdir": None, "keep": False}


def _on_signal(signum: int, frame: object) -> None:
    """SIGTERM/SIGINT: stop every process of this run at once and leave (a half-done run has no figures to print)."""
    print(f"\nbench_elastic: signal {signum}: stopping every process of this run", file=sys.stderr, flush=True)
    reap()
    if _CLEANUP["workdir"] is not None and not _CLEANUP["keep"]:
        shutil.rmtree(_CLEANUP["workdir"], ignore_errors=True)
    os._exit(128 + signum)


def install_signal_handlers() -> None:
    """Ours and only ours: also called after the in-process API started, since uvicorn takes SIGINT/SIGTERM for
    itself while it serves (it would stop the API and leave the run going)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ[ENV_NODE_MARKER] = f"{TAG}-bench"  # inherited by every child (nats-server included)
    atexit.register(reap)
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="hz-bench-elastic-", dir=args.dir))
    _CLEANUP.update(workdir=workdir, keep=args.keep)
    install_signal_handlers()
    from broker_config.server import nats_server_binary

    nats_version = subprocess.run([str(nats_server_binary()), "--version"], capture_output=True, text=True,
                                  timeout=10).stdout.strip().removeprefix("nats-server: ")
    meta = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_line(),
        "torch": package_version("torch"),
        "nats_server": nats_version,
        "pg_timeout_s": pg_timeout_s(),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "loadavg": loadavg(),
        "git": git_state(),
        "workdir": str(workdir),
    }

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    started = time.monotonic()
    try:
        reps = asyncio.run(bench(args, workdir, log))
    finally:
        reap()
        if args.keep:
            log(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    meta["seconds"] = round(time.monotonic() - started, 1)
    meta["loadavg_end"] = loadavg()
    summary = summarize(reps, args)
    if not args.json_only:
        print(render(reps, summary, meta, args))
        print(f"\n(total {meta['seconds']} s)")
    if args.json:
        payload = {"meta": meta, "args": {k: v for k, v in vars(args).items() if k != "dir"}, "summary": summary,
                   "repeats": reps}
        write_json(args.json, clean_nan(json.loads(json.dumps(payload, default=str))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
