"""`harmonaize demo`: the demo story told by the real system, in under three minutes.

A fresh local cloud (broker, API, four simulated hosts in two locality groups, the provider's loops) lives through a
scripted scenario while a real training job runs and the three example tenant controllers react to its events
(seconds into the run: what happens in the world -> what should follow):

* 0: a neighbour's batch job holds h4; our job gets 2 workers (h1, h2) -> training at world size 2.
* 40: carbon drops to 150 g/kWh -> the carbon-aware scaler asks for 4, the provider counters with 3 (h4 is taken),
  accepted; a third node joins.
* 50: a live migration of h1 is announced for 95-110 s -> the provider's micro loop, alone and inside the tenant's
  ranges: checkpoint now, then every step while it is pending (nothing to negotiate: the job keeps running).
* 60: the neighbour's batch job ends: h4 is free -> the scaler, carbon still low, gets its 4th worker.
* 75: a failure is predicted on h2 -> the failure guard asks to keep its size: the provider moves h2's worker to a
  healthy host, or, with none free, the job shrinks off h2; no step lost.
* 90: h2 dies, as predicted -> nothing to recover: the job left it.
* 100: h3 dies without warning -> outage reported, the survivors re-form at once; the steps since the last checkpoint
  are lost.
* 120: congestion between the locality groups -> the congestion repartitioner switches DDP -> HSDP (the micro loop
  proposes compression only while the job is still DDP).
* end: the negotiation history over REST, and a summary.

Nothing here fakes an outcome: the driver only creates the jobs, ends the neighbour's, kills the hosts at the
scripted times and watches.
The summary is what the control plane and the tenant's event feed report; `--summary-json` writes it for tests.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats
from nats.aio.client import Client
from rich.console import Console
from rich.live import Live
from rich.table import Table

from harmonaize.subjects import parse_tenant_event_subject, tenant_events_filter
from harmonaize_cli.local_cloud.fleet import LocalFleet
from harmonaize_cli.local_cloud.launcher import LocalCloudInfo

__all__ = ["DEMO_SCENARIO", "DemoStory", "JOB"]

JOB = "llm-finetune"
NEIGHBOUR = "neighbour"
NEIGHBOUR_JOB = "batch-eval"
EXAMPLES = ("carbon_aware_scaler", "failure_guard", "congestion_repartitioner")
EXAMPLES_DIR = Path(str(importlib.resources.files("tenant_controllers") / "examples"))
DEMO_SCENARIO = """\
version: 1
seed: 7
hosts:
  h1: {locality_group: g1, gpus: 4, region: US-CAL-CISO}
  h2: {locality_group: g1, gpus: 4, region: US-CAL-CISO}
  h3: {locality_group: g2, gpus: 4, region: US-CAL-CISO}
  h4: {locality_group: g2, gpus: 4, region: US-CAL-CISO}
fabric: {intra_group_gbps: 400, inter_group_gbps: 100}
carbon:
  US-CAL-CISO: {points: [{at: 0s, g_per_kwh: 290}, {at: 40s, g_per_kwh: 150}], forecast_points: 6}
predicted_failures:
  - {host: h2, at: 75s, eta: 90s, confidence: 0.9, gpu: 0, reason: ecc_uncorrectable_rising}
congestion:
  - {groups: [g1, g2], link: spine-1:eth7, start: 120s, duration: 600s, slowdown: 2.5}
maintenance:
  - {host: h1, notice: chg-demo-1, kind: live_migrate, announce: 50s, start: 95s, end: 110s}
"""
NEIGHBOUR_ENDS_AT_S = 60.0
PREDICTED_HOST = "h2"
PREDICTED_AT_S = 75.0
PREDICTED_FAILS_AT_S = 90.0
UNPLANNED_FAILS_AT_S = 100.0
UNPLANNED_HOST = "h3"
"""The host that fails without warning: the third node of the scale-up, so the survivors span both groups."""
HOST_RETURN_S = 60.0
"""How long a restarted agent may take to heartbeat and its host to be reported up again."""
DEADLINE_S = 170.0


@dataclass
class Summary:
    events: Counter[str] = field(default_factory=Counter)
    negotiations: list[dict[str, Any]] = field(default_factory=list)
    world_sizes: list[dict[str, Any]] = field(default_factory=list)
    directives: list[dict[str, Any]] = field(default_factory=list)
    steps_lost: int | None = None
    recovery_s: float | None = None
    moved_before_failure: bool = False
    move_steps_lost: int | None = None
    scale_up: bool = False
    recovered: bool = False
    repartitioned: bool = False
    history_complete: bool = False
    duration_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "events": dict(self.events),
            "negotiations": self.negotiations,
            "world_sizes": self.world_sizes,
            "directives": self.directives,
            "steps_lost": self.steps_lost,
            "recovery_s": self.recovery_s,
            "moved_before_failure": self.moved_before_failure,
            "move_steps_lost": self.move_steps_lost,
            "scale_up": self.scale_up,
            "recovered": self.recovered,
            "repartitioned": self.repartitioned,
            "history_complete": self.history_complete,
            "duration_s": round(self.duration_s, 1),
        }


class DemoStory:
    """Drives and watches the story inside a running local cloud (`run_local_cloud(story=...)`)."""

    def __init__(
        self,
        *,
        console: Console,
        summary_json: Path | None = None,
        live: bool | None = None,
        done_marker: Path | None = None,
        hand_over: bool = False,
    ) -> None:
        self.done_marker = done_marker
        self.hand_over = hand_over
        self.console = console
        self.summary_json = summary_json
        self.live = console.is_terminal if live is None else live
        self.summary = Summary()
        self.negotiation_rounds: dict[str, int] = {}
        self.last_line = ""
        self.started = time.monotonic()

    async def __call__(self, info: LocalCloudInfo, fleet: LocalFleet | None) -> None:
        assert fleet is not None, "the demo needs the simulated fleet"
        if self.done_marker is not None and self.done_marker.exists():
            self.console.print(f"The demo story already ran in this data dir (summary: {self.done_marker}); "
                               "the cloud keeps running.")
            return
        admin_token = _env_value(info.admin_env_file, "HZ_ADMIN_TOKEN")
        tenant_env = _read_env(info.tenant_env_file) if info.tenant_env_file else {}
        if not tenant_env:
            raise RuntimeError("the demo tenant's credentials are missing (use a fresh --data-dir)")
        async with (
            httpx.AsyncClient(base_url=info.api_url, headers=_bearer(admin_token), timeout=30) as admin,
            httpx.AsyncClient(
                base_url=info.api_url, headers=_bearer(tenant_env["HZ_TENANT_TOKEN"]), timeout=30
            ) as tenant,
        ):
            await self._occupy_neighbour_host(admin)
            await self._create_job(tenant)
            controllers = self._start_controllers(info, tenant_env)
            watcher = await self._watch_events(info.nats_url, tenant_env)
            try:
                await self._play(info, fleet, tenant, admin)
            finally:
                await watcher.close()
                for proc in controllers:
                    proc.terminate()
                for proc in controllers:
                    try:
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
            await self._collect(tenant)
            self._report()
            if self.hand_over:
                await self._give_the_cloud_back(admin, fleet)
                self._next_steps(info)

    # -- setting the stage ---------------------------------------------------------------------------------------

    async def _occupy_neighbour_host(self, admin: httpx.AsyncClient) -> None:
        """Another tenant's job holds h4, so the provider cannot grant all 4 workers: it counters with 3."""
        created = await admin.post("/v1/tenants", json={"id": NEIGHBOUR, "display_name": "Neighbour"})
        _expect(created, 201)
        token = created.json()["api_token"]
        async with httpx.AsyncClient(base_url=str(admin.base_url), headers=_bearer(token), timeout=30) as neighbour:
            _expect(await neighbour.post("/v1/jobs", json={"id": NEIGHBOUR_JOB, "min_workers": 1, "max_workers": 1,
                                                           "gpus_per_worker": 4}), 201)
        _expect(await admin.post("/v1/allocations", json={"tenant_id": NEIGHBOUR, "job_id": NEIGHBOUR_JOB, "gpus": 4,
                                                          "host_id": "h4"}), 201)

    async def _create_job(self, tenant: httpx.AsyncClient) -> None:
        body = {
            "id": JOB,
            "min_workers": 1,
            "max_workers": 4,
            "gpus_per_worker": 4,
            "initial_workers": 2,
            "entrypoint": ["-m", "workloads.examples.tiny_lm", "--step-delay-ms", "30", "--log-every", "1",
                           "--checkpoint-interval", "25"],
            "checkpoint_interval_steps": {"min": 1, "max": 100},
            "gradient_compression": {"allowed": ["none", "fp16"]},
            "batch_size": {"min": 4, "max": 32},
        }
        _expect(await tenant.post("/v1/jobs", json=body), 201)
        self._say("job llm-finetune submitted (1-4 workers); the provider placed 2")

    def _start_controllers(self, info: LocalCloudInfo, tenant_env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
        logs = info.logs_dir or info.data_dir
        env = {**os.environ, **tenant_env, "HZ_JOB": JOB, "PYTHONUNBUFFERED": "1"}
        procs = []
        for example in EXAMPLES:
            script = EXAMPLES_DIR / f"{example}.py"
            log = open(logs / f"controller-{example}.log", "ab")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "harmonaize_cli", "controller", "run", str(script),
                     "--state-dir", str(info.data_dir / "controllers"), "--resync-interval", "30"],
                    env=env, stdout=log, stderr=subprocess.STDOUT,
                )
            )
        self._say("tenant controllers running: " + ", ".join(EXAMPLES))
        return procs

    async def _watch_events(self, nats_url: str, tenant_env: dict[str, str]) -> Client:
        """Count what the tenant is told, as the tenant (its own credentials, its own live slice)."""
        nc = await nats.connect(nats_url, nkeys_seed_str=tenant_env["HZ_TENANT_NATS_SEED"], name="hz-demo-watch")

        async def on_event(msg: Any) -> None:
            kind = parse_tenant_event_subject(msg.subject).kind.value
            self.summary.events[kind] += 1
            if kind == "negotiation":
                data = json.loads(msg.data).get("data", {})
                key = str(data.get("negotiation_id"))
                self.negotiation_rounds[key] = max(self.negotiation_rounds.get(key, 0), int(data.get("round", 0)))

        await nc.subscribe(tenant_events_filter(tenant_env["HZ_TENANT"]), cb=on_event)
        return nc

    # -- the story -----------------------------------------------------------------------------------------------

    async def _play(self, info: LocalCloudInfo, fleet: LocalFleet, tenant: httpx.AsyncClient,
                    admin: httpx.AsyncClient) -> None:
        neighbour_done = predicted_done = False
        killed_at: float | None = None
        kill_epoch: int | None = None
        warned_epoch: int | None = None
        display = (
            Live(self._table(None), console=self.console, refresh_per_second=4, transient=False)
            if self.live
            else _Null()
        )
        with display as live:
            while (elapsed := time.monotonic() - self.started) < DEADLINE_S:
                status = (await tenant.get(f"/v1/jobs/{JOB}/status")).json()
                progress = status.get("progress")
                timeline = (await tenant.get(f"/v1/jobs/{JOB}/timeline")).json()
                self.summary.world_sizes = timeline
                self.summary.scale_up = any(entry["world_size"] >= 3 for entry in timeline)
                if not neighbour_done and elapsed >= NEIGHBOUR_ENDS_AT_S:
                    neighbour_done = True
                    await self._release(admin, NEIGHBOUR, NEIGHBOUR_JOB)
                    self._say("the neighbour's batch job ended: h4 is free")
                if progress is not None and elapsed < PREDICTED_AT_S:
                    warned_epoch = progress["epoch"]  # the epoch the prediction will find
                if not predicted_done and elapsed >= PREDICTED_FAILS_AT_S:
                    predicted_done = True
                    hosts = await self._hosts_of(admin, JOB)
                    self.summary.moved_before_failure = PREDICTED_HOST not in hosts
                    if self.summary.moved_before_failure and progress is not None and warned_epoch is not None:
                        self.summary.move_steps_lost = _steps_redone(info.data_dir, progress)
                    fleet.kill_host(PREDICTED_HOST)
                    self._say(f"{PREDICTED_HOST} failed as predicted; the job "
                              + ("had left it" if self.summary.moved_before_failure else f"was still on it ({hosts})"))
                if killed_at is None and elapsed >= UNPLANNED_FAILS_AT_S and progress is not None:
                    kill_epoch = progress["epoch"]
                    victim = await self._unplanned_victim(admin)
                    fleet.kill_host(victim)
                    killed_at = time.monotonic()
                    self._say(f"{victim} failed without warning (t={elapsed:.0f} s, job at step {progress['step']})")
                if killed_at is not None and not self.summary.recovered and progress is not None:
                    past_kill = progress["epoch"] > (kill_epoch or 0)
                    if past_kill and progress["step"] > (progress["resumed_from_step"] or 0):
                        self.summary.recovered = True
                        self.summary.recovery_s = round(time.monotonic() - killed_at, 1)
                        self.summary.steps_lost = _steps_redone(info.data_dir, progress)
                        how = ("in place" if progress.get("change") == "in_place"
                               else f"from the checkpoint of step {progress['resumed_from_step'] or 0}")
                        self._say(
                            f"recovered at world size {progress['world_size']} after {self.summary.recovery_s} s, "
                            f"{how} ({self.summary.steps_lost} step(s) lost)"
                        )
                self.summary.repartitioned = any(entry["parallel_plan"] == "hsdp" for entry in timeline)
                if self.live:
                    live.update(self._table(progress))
                else:
                    self._status_line(elapsed, progress)
                if (
                    self.summary.recovered
                    and self.summary.repartitioned
                    and progress
                    and progress["parallel_plan"] == "hsdp"
                ):
                    break
                await asyncio.sleep(0.5)
        self.summary.duration_s = time.monotonic() - self.started

    async def _hosts_of(self, admin: httpx.AsyncClient, job: str, tenant: str = "demo") -> list[str]:
        reply = await admin.get("/v1/allocations", params={"tenant_id": tenant, "job_id": job})
        _expect(reply, 200)
        return sorted({allocation["host_id"] for allocation in reply.json()})

    async def _unplanned_victim(self, admin: httpx.AsyncClient) -> str:
        """`UNPLANNED_HOST` if the job runs there (it does, unless the controllers chose otherwise), else a host of
        the job other than its first, so a failure without warning always hits the job."""
        hosts = await self._hosts_of(admin, JOB)
        if UNPLANNED_HOST in hosts or not hosts:
            return UNPLANNED_HOST
        return hosts[-1]

    async def _release(self, admin: httpx.AsyncClient, tenant: str, job: str) -> None:
        """Release every worker of a job (a job's end, as the provider sees it); the job and its history stay."""
        reply = await admin.get("/v1/allocations", params={"tenant_id": tenant, "job_id": job})
        _expect(reply, 200)
        for allocation in reply.json():
            released = await admin.delete(f"/v1/allocations/{allocation['id']}")
            if released.status_code != 409:  # 409: released meanwhile, which is the aim anyway
                _expect(released, 200)

    async def _collect(self, tenant: httpx.AsyncClient) -> None:
        items: list[dict[str, Any]] = []
        cursor = None
        while True:
            page = (await tenant.get("/v1/negotiations", params={"cursor": cursor} if cursor else {})).json()
            items += page["items"]
            cursor = page["next_cursor"]
            if not cursor:
                break
        complete = True
        for item in reversed(items):
            detail = (await tenant.get(f"/v1/negotiations/{item['id']}")).json()
            rounds = detail["rounds"]
            seen_round = self.negotiation_rounds.get(item["id"], 0)
            complete &= bool(rounds) and max(r["round"] for r in rounds) >= seen_round
            self.summary.negotiations.append(
                {"id": item["id"], "kind": item["kind"], "state": item["state"], "rounds": len(rounds),
                 "actions": [f"{r['actor']}:{r['action']}" for r in rounds]}
            )
        unknown = set(self.negotiation_rounds) - {n["id"] for n in self.summary.negotiations}
        self.summary.history_complete = complete and not unknown and bool(items)
        directives = (await tenant.get(f"/v1/jobs/{JOB}/directives")).json()
        self.summary.directives = [
            {"version": d["version"], "state": d["state"], "reason": d["reason"], "refusals": d["refusals"]}
            for d in reversed(directives)
        ]

    # -- after the story -----------------------------------------------------------------------------------------

    async def _give_the_cloud_back(self, admin: httpx.AsyncClient, fleet: LocalFleet) -> None:
        """Leave the cloud as a fresh one for the README's next steps: the story's jobs release their workers (the
        jobs and their history stay), and the host the story killed comes back once its agent heartbeats again."""
        for tenant, job in ((NEIGHBOUR, NEIGHBOUR_JOB), ("demo", JOB)):
            await self._release(admin, tenant, job)
        for host in fleet.hosts:
            if not fleet.agent_running(host):
                fleet.start_agent(host)
        deadline = time.monotonic() + HOST_RETURN_S
        while True:
            reply = await admin.get("/v1/hosts")
            _expect(reply, 200)
            hosts = {host["id"]: host for host in reply.json()}
            if all(host["down_at"] is None and host["free_gpus"] == host["gpus"] for host in hosts.values()):
                break
            if time.monotonic() > deadline:
                busy = sorted(h for h, host in hosts.items() if host["down_at"] or host["free_gpus"] != host["gpus"])
                raise RuntimeError(f"the demo could not give the cloud back within {HOST_RETURN_S:.0f} s: {busy}")
            await asyncio.sleep(0.5)
        self._say("the failed hosts are back and the story's jobs released their workers: every host is free")

    def _next_steps(self, info: LocalCloudInfo) -> None:
        tenant_env = info.tenant_env_file or info.data_dir / "tenant-demo.env"
        self.console.print(
            "\n[bold]Next[/] (README.md, \"Your first tenant controller\"), in another shell:\n"
            f"  source {tenant_env}\n"
            "  harmonaize jobs list                      # the demo's job, its timeline and negotiations stay\n"
            "  harmonaize negotiations list --job llm-finetune\n"
            "  curl -s -X POST \"$HZ_API_URL/v1/jobs\" ...     # submit your own job, then run a controller\n"
            f"  (source {info.admin_env_file} && harmonaize scenario run FILE.yaml)   # inject failures or congestion\n"
            "The cloud keeps running; Ctrl-C stops it."
        )

    # -- output --------------------------------------------------------------------------------------------------

    def _say(self, line: str) -> None:
        self.console.print(f"[bold cyan][t={time.monotonic() - self.started:5.0f} s][/] {line}")

    def _status_line(self, elapsed: float, progress: dict[str, Any] | None) -> None:
        if progress is None:
            line = "waiting for the job's first step"
        else:
            line = (f"world {progress['world_size']} {progress['parallel_plan']} step {progress['step']} "
                    f"compression {progress['compression']}")
        if line != self.last_line:
            self.last_line = line
            self.console.print(f"[t={elapsed:5.0f} s] {line}")

    def _table(self, progress: dict[str, Any] | None) -> Table:
        table = Table(title=f"HarmonAIze demo  t={time.monotonic() - self.started:.0f} s", show_header=False)
        if progress is None:
            table.add_row("job", "waiting for the first step")
            return table
        loss = progress.get("loss")
        table.add_row("world size / plan", f"{progress['world_size']} / {progress['parallel_plan']}")
        table.add_row("step / loss", f"{progress['step']} / {loss:.4f}" if loss is not None else str(progress["step"]))
        table.add_row(
            "compression / ckpt every", f"{progress['compression']} / {progress['checkpoint_interval_steps']}"
        )
        table.add_row("events seen", ", ".join(f"{k} {v}" for k, v in sorted(self.summary.events.items())))
        table.add_row("negotiations", str(len(self.negotiation_rounds)))
        return table

    def _report(self) -> None:
        summary = self.summary
        table = Table(title="Demo summary")
        table.add_column("what")
        table.add_column("result")
        table.add_row("events seen", ", ".join(f"{k}: {v}" for k, v in sorted(summary.events.items())))
        outcomes = Counter((item["kind"], item["state"], " -> ".join(item["actions"])) for item in summary.negotiations)
        for (kind, state, path), count in sorted(outcomes.items()):
            table.add_row(f"negotiations: {kind} {state}", f"{count} x  {path}")
        table.add_row("world size over time", " -> ".join(
            f"{entry['world_size']} {entry['parallel_plan']} (from step {entry['step']})"
            for entry in summary.world_sizes
        ))
        table.add_row("how each change went", "; ".join(_change_text(entry) for entry in summary.world_sizes[1:]))
        table.add_row("micro-loop directives", "; ".join(f"v{d['version']} {d['state']}" for d in summary.directives))
        table.add_row("predicted failure", f"left {PREDICTED_HOST} before it failed, "
                      f"{summary.move_steps_lost} step(s) lost" if summary.moved_before_failure
                      else f"still on {PREDICTED_HOST} when it failed")
        table.add_row("failure without warning", f"recovered in {summary.recovery_s} s, {summary.steps_lost} step(s) "
                      "lost" if summary.recovered else "not recovered")
        table.add_row(
            "scale-up / recovery / repartition / history",
            f"{summary.scale_up} / {summary.recovered} / {summary.repartitioned} / {summary.history_complete}",
        )
        table.add_row("duration", f"{summary.duration_s:.0f} s")
        self.console.print(table)
        for out in (self.summary_json, self.done_marker):
            if out is not None:
                out.write_text(json.dumps(summary.as_dict(), indent=2))


class _Null:
    def __enter__(self) -> _Null:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def update(self, *_: object) -> None:
        return None


def _steps_redone(data_dir: Path, progress: dict[str, Any]) -> int:
    """Steps the job did twice around its latest change: step numbers past the one its epoch began at that rank 0
    logged more than once (examples log `step=N loss=...` every step here; a step is logged once unless it was lost
    and redone, whether the job changed in place or resumed from a checkpoint)."""
    since = progress.get("epoch_step")
    if since is None:
        since = progress["resumed_from_step"] or 0
    seen: Counter[int] = Counter()
    for log in data_dir.glob(f"hosts/*/jobs/*.{JOB}/node-e*.log"):
        seen.update(int(match) for match in re.findall(r"step=(\d+) loss=", log.read_text(errors="replace")))
    return sum(1 for step, count in seen.items() if step > since and count > 1)


def _change_text(entry: dict[str, Any]) -> str:
    """One timeline entry's change: in place with the running ranks' pause, or a restart from a checkpoint."""
    if entry.get("change") == "in_place":
        pause = entry.get("pause_s")
        return f"e{entry['epoch']} in place" + (f", paused {pause * 1000:.0f} ms" if pause is not None else "")
    if entry.get("change") == "checkpoint":
        pause = entry.get("pause_s")
        return (f"e{entry['epoch']} restarted from the checkpoint of step {entry['resumed_from_step']}"
                + (f", paused {pause:.1f} s" if pause is not None else ""))
    return f"e{entry['epoch']} {entry.get('change') or 'unreported'}"


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _expect(reply: httpx.Response, status: int) -> None:
    if reply.status_code != status:
        raise RuntimeError(f"{reply.request.method} {reply.request.url.path}: {reply.status_code} {reply.text}")


def _read_env(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        values[key] = json.loads(value)
    return values


def _env_value(path: Path, key: str) -> str:
    return _read_env(path)[key]
