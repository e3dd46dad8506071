"""The O5 reliability scenario's two arms, one round (one job through its seeded failures) each: plain torchrun
(`status_quo`: no provider signal, failures found by torchrun) and the local cloud with the tenant's failure guard
(`cooperative`: events, predictions and in-place re-formation)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import logging
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from harmonaize_cli.evaluation.results import COOPERATIVE, STATUS_QUO
from harmonaize_cli.evaluation.runtime.cloud import EvalContext
from harmonaize_cli.evaluation.runtime.job_log import (
    LogWatcher,
    recovery_step,
)
from harmonaize_cli.evaluation.runtime.reliability_events import EventOutcome, Round, RoundRun
from harmonaize_cli.evaluation.runtime.torchrun_job import TorchrunJob
from harmonaize_cli.local_cloud.tenant_probe import inject_scenario
from provider_agents.markers import host_prefix
from provider_agents.processes import marked_processes
from provider_agents.telemetry.scenario import PredictedFailureSpec, Scenario

_log = logging.getLogger(__name__)
TENANT = "demo"
WORKERS = 3
STEP_DELAY_MS = 100
CHECKPOINT_INTERVAL = 100
"""The status quo's fixed interval, and the cooperative job's first one (its script's default inside its range)."""
CHECKPOINT_RANGE = (50, 200)
"""The cooperative tenant's allowed checkpoint interval (the provider's micro loop may move it inside)."""
ENTRYPOINT = ("-m", "workloads.examples.mlp", "--step-delay-ms", str(STEP_DELAY_MS), "--log-every", "1",
              "--checkpoint-interval", str(CHECKPOINT_INTERVAL))
FAILURE_GUARD = Path(str(importlib.resources.files("tenant_controllers") / "examples" / "failure_guard.py"))

WARMUP_STEPS = 10
START_TIMEOUT_S = 240.0
RECOVERY_TIMEOUT_S = {STATUS_QUO: 180.0, COOPERATIVE: 90.0}
HOST_TIMEOUT_S = 60.0
REGROW_TIMEOUT_S = 90.0
STANDBY_WAIT_S = 30.0
QUIET_TIMEOUT_S = 90.0

# -- waiting on a job's log -----------------------------------------------------------------------------------------


async def _wait_log(watcher: LogWatcher, check: Callable[[LogWatcher], bool], *, timeout: float, what: str,
                    also: Callable[[], None] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        watcher.poll()
        if check(watcher):
            return
        if also is not None:
            also()
        if time.monotonic() > deadline:
            last = watcher.last()
            seen = "no step logged yet" if last is None else f"last logged: step {last.step} at world {last.world}"
            raise TimeoutError(f"{what}: not within {timeout:g} s ({seen})")
        await asyncio.sleep(0.05)


def _reached(step: int, world: int | None = None) -> Callable[[LogWatcher], bool]:
    def check(watcher: LogWatcher) -> bool:
        last = watcher.last()
        return last is not None and last.step >= step and (world is None or last.world == world)

    return check


def _recovered(failed: float) -> Callable[[LogWatcher], bool]:
    return lambda watcher: recovery_step(watcher.steps, failed) is not None


def _steps_timeout(watcher: LogWatcher, step: int) -> float:
    last = watcher.last()
    return 90.0 + max(0, step - (last.step if last else 0)) * 1.0


def _pick(candidates: list[str], fraction: float) -> str:
    if not candidates:
        raise RuntimeError("no candidate host for the failure: the job runs nowhere")
    return candidates[min(len(candidates) - 1, int(fraction * len(candidates)))]


async def _sleep_until(ts: float, watcher: LogWatcher) -> None:
    while (left := ts - time.time()) > 0:
        watcher.poll()
        await asyncio.sleep(min(0.05, left))


# -- status quo: plain torchrun -------------------------------------------------------------------------------------


async def status_quo_round(workdir: Path, prefix: str, rnd: Round, *, repeat: int, seed: int, index: int,
                            log: Callable[[str], None]) -> RoundRun:
    run = RoundRun(arm=STATUS_QUO, repeat=repeat, seed=seed, index=index, target_step=rnd.target_step)
    job = TorchrunJob(workdir / f"r{repeat}-k{index}", name=f"o5-r{repeat}-k{index}", entrypoint=ENTRYPOINT,
                      marker_prefix=prefix, nnodes=f"1:{WORKERS}", max_restarts=3)
    watcher = job.watcher
    names = (f"n{i}" for i in range(1, 100))
    try:
        await job.start_store_host(next(names))
        for _ in range(WORKERS - 1):
            job.start_node(next(names))
        await _wait_log(watcher, _reached(WARMUP_STEPS, WORKERS), timeout=START_TIMEOUT_S,
                        what=f"status quo: the torchrun job training at world {WORKERS}")
        store_host = next(iter(job.nodes))
        for event in rnd.events:
            await _wait_log(watcher, _reached(event.at_step), timeout=_steps_timeout(watcher, event.at_step),
                            what=f"status quo: the job reaching step {event.at_step} (the next event)")
            last = watcher.last()
            fired = last.step if last else 0
            notice = None
            if event.kind == "announced":
                notice = time.time()  # nobody is told: the job trains on until the host dies
                await _sleep_until(notice + event.lead_s, watcher)
            victim = _pick([node for node in job.running() if node != store_host], event.victim)
            failed = job.kill(victim)
            replacement = next(names)
            job.start_node(replacement)  # an auto-restarting scheduler: a new node at once
            outcome = EventOutcome(kind=event.kind, channel=event.channel, lead_s=event.lead_s, at_step=event.at_step,
                                   victim=victim, notice_ts=notice, fail_ts=failed, fired_at_step=fired,
                                   note=f"replacement node {replacement} started at once")
            run.events.append(outcome)
            log(f"  status quo r{repeat} k{index}: {event.kind} failure of node {victim} at step {fired}")
            await _wait_log(watcher, _recovered(failed), timeout=RECOVERY_TIMEOUT_S[STATUS_QUO],
                            what=f"status quo: a step after the failure of node {victim}")
            first = recovery_step(watcher.steps, failed)
            outcome.recovered_ts = first.ts if first else None
            await _wait_log(watcher, _reached(0, WORKERS), timeout=RECOVERY_TIMEOUT_S[STATUS_QUO],
                            what=f"status quo: the job back at world {WORKERS} with node {replacement}")
        await _wait_log(watcher, _reached(rnd.target_step), timeout=_steps_timeout(watcher, rnd.target_step),
                        what=f"status quo: the job reaching its target step {rnd.target_step}")
    finally:
        job.stop()
        shutil.rmtree(job.checkpoint_dir, ignore_errors=True)
    watcher.poll()
    run.steps = list(watcher.steps)
    run.account()
    return run


# -- cooperative: the local cloud ------------------------------------------------------------------------------------


class _Cloud:
    """The cooperative arm's hands on the cloud: the tenant's job and negotiations, the admin's hosts."""

    def __init__(self, ctx: EvalContext, job: str) -> None:
        self.ctx = ctx
        self.probe = ctx.probe
        self.job = job
        self.watcher = LogWatcher(ctx.info.data_dir, (f"hosts/*/jobs/{TENANT}.{job}/node-e*.log",))
        self.notes: list[str] = []

    async def job_hosts(self) -> list[str]:
        reply = await self.probe.admin.get("/v1/allocations", params={"tenant_id": TENANT, "job_id": self.job})
        reply.raise_for_status()
        return sorted({a["host_id"] for a in reply.json() if a.get("released_at") is None})

    def runs_on(self, host: str) -> bool:
        """Whether a process of the job's node still runs on `host` (the control plane may have moved the job off it
        while its workers still wait for the joiner that replaces them)."""
        fleet = self.ctx.fleet
        return bool(marked_processes(f"{host_prefix(fleet.cloud, host)}{TENANT}.{self.job}.", prefix=True))

    async def hosts(self) -> dict[str, dict[str, Any]]:
        reply = await self.probe.admin.get("/v1/hosts")
        reply.raise_for_status()
        return {host["id"]: host for host in reply.json()}

    async def wait_down(self, host: str) -> None:
        deadline = time.monotonic() + HOST_TIMEOUT_S
        while (state := (await self.hosts()).get(host)) is None or state.get("down_at") is None:
            self.watcher.poll()
            if time.monotonic() > deadline:
                raise TimeoutError(f"cooperative: host {host} not reported down within {HOST_TIMEOUT_S:g} s of its "
                                   "kill")
            await asyncio.sleep(0.2)

    async def host_up(self, host: str) -> None:
        """Start the host's agent if it is not running and wait until the control plane has the host up again."""
        fleet = self.ctx.fleet
        if not fleet.agent_running(host):
            fleet.start_agent(host)
        deadline = time.monotonic() + HOST_TIMEOUT_S
        while (state := (await self.hosts()).get(host)) is None or state.get("down_at") is not None:
            self.watcher.poll()
            if time.monotonic() > deadline:
                raise TimeoutError(f"cooperative: host {host} not reported up again within {HOST_TIMEOUT_S:g} s of "
                                   "its agent's restart")
            await asyncio.sleep(0.2)

    async def hosts_back(self) -> None:
        """Every host's agent running and every host reported up."""
        for host in self.ctx.fleet.hosts:
            await self.host_up(host)

    async def open_negotiations(self) -> list[dict[str, Any]]:
        reply = await self.probe.tenant.get("/v1/negotiations", params={"job": self.job, "state": "offered"})
        reply.raise_for_status()
        items: list[dict[str, Any]] = reply.json()["items"]
        return items

    async def regrow(self, workers: int) -> str:
        """As the tenant, ask for `workers` again (the cooperative counterpart of the status quo's replacement node),
        accept once the joiner stands by, and wait until the job trains at that size; what happened, in words."""
        deadline = time.monotonic() + 30
        while await self.open_negotiations():  # the failure guard's answer to the same failure, first
            if time.monotonic() > deadline:
                raise TimeoutError("cooperative: the failure guard's negotiation still open after 30 s")
            await asyncio.sleep(0.2)
        opened_at = time.time()
        reply = await self.probe.tenant.post(
            "/v1/negotiations", headers={"Idempotency-Key": secrets.token_hex(8)},
            json={"job": self.job, "kind": "scale", "terms": {"desired_workers": workers}},
        )
        body = reply.json()
        if reply.status_code != 201 or body.get("state") != "offered":
            reason = (body.get("rounds") or [{}])[-1].get("note") if isinstance(body, dict) else None
            return f"regrow to {workers} not offered ({reply.status_code} {body.get('state')}: {reason})"
        deadline = time.monotonic() + STANDBY_WAIT_S
        while time.monotonic() < deadline and not self.watcher.standby_after(opened_at):
            self.watcher.poll()
            await asyncio.sleep(0.05)
        accepted = await self.probe.tenant.post(f"/v1/negotiations/{body['id']}/accept", json={"option": 0})
        if accepted.status_code != 200:
            return f"regrow to {workers}: accept failed ({accepted.status_code} {accepted.text[:200]})"
        began = time.time()
        await _wait_log(self.watcher, _reached(0, workers), timeout=REGROW_TIMEOUT_S,
                        what=f"cooperative: the job training at {workers} workers after the regrow")
        return (f"regrown to {workers} ({began - opened_at:.1f} s from the request to the accept, "
                f"{time.time() - began:.1f} s more to the first step at {workers})")

    async def release_and_quiet(self) -> None:
        """Release the job, bring every host back, and wait until every host is up and free and the job's node
        processes are gone (the next round or scenario starts on a quiet fleet)."""
        await self.probe.release(self.job)
        await self.hosts_back()
        fleet = self.ctx.fleet
        deadline = time.monotonic() + QUIET_TIMEOUT_S
        while True:
            hosts = await self.hosts()
            busy = sorted(h for h, s in hosts.items() if s.get("down_at") or s.get("free_gpus") != s.get("gpus"))
            nodes = [h for h in fleet.hosts if self.runs_on(h)]
            if not busy and not nodes:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cooperative: the fleet not quiet within {QUIET_TIMEOUT_S:g} s after releasing "
                                   f"{self.job} (hosts down or busy: {busy}; job processes still on: {nodes})")
            await asyncio.sleep(0.5)


@contextlib.asynccontextmanager
async def _cleaned_up(cleanup: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
    """Run `cleanup` after the block; when the block failed, a failing cleanup is logged and the block's error
    raised (it says what did not happen), not the cleanup's."""
    try:
        yield
    except BaseException:
        try:
            await cleanup()
        except Exception as error:  # noqa: BLE001 - the first error is the one to report
            _log.warning("o5 reliability: cleaning up after a failure failed too: %r", error)
        raise
    await cleanup()


async def cooperative_round(ctx: EvalContext, rnd: Round, *, repeat: int, seed: int, index: int,
                             log: Callable[[str], None]) -> RoundRun:
    run = RoundRun(arm=COOPERATIVE, repeat=repeat, seed=seed, index=index, target_step=rnd.target_step)
    job = f"o5-s{seed}-r{repeat}-k{index}-{secrets.token_hex(2)}"
    cloud = _Cloud(ctx, job)
    watcher = cloud.watcher
    await ctx.probe.submit({
        "id": job, "min_workers": WORKERS - 1, "max_workers": WORKERS, "initial_workers": WORKERS,
        "gpus_per_worker": 4, "entrypoint": list(ENTRYPOINT),
        "checkpoint_interval_steps": {"min": CHECKPOINT_RANGE[0], "max": CHECKPOINT_RANGE[1]},
    })

    async def cleanup() -> None:
        await cloud.release_and_quiet()
        run.notes.extend(cloud.notes)

    async with _cleaned_up(cleanup):
        await _cooperative_events(ctx, rnd, run, cloud, log)
    watcher.poll()
    run.steps = list(watcher.steps)
    run.account()
    return run


async def _cooperative_events(ctx: EvalContext, rnd: Round, run: RoundRun, cloud: _Cloud,
                              log: Callable[[str], None]) -> None:
    job, watcher, repeat, index = cloud.job, cloud.watcher, run.repeat, run.index
    controller = None
    try:
        await _wait_log(watcher, _reached(WARMUP_STEPS), timeout=START_TIMEOUT_S,
                        what=f"cooperative: {job} training")
        last = watcher.last()
        if last is not None and last.world < WORKERS:
            # placed on WORKERS hosts but training on fewer: a host was reported down during the start (a fleet
            # monitor stalled while it started the job's rendezvous store once took one out); back to full size
            await cloud.hosts_back()
            regrown = await cloud.regrow(WORKERS)
            run.notes.append(f"the job started at world {last.world}, not {WORKERS} (a host reported down during "
                             f"its start): {regrown}")
            _log.warning("o5 reliability: %s started at world %d: %s", job, last.world, regrown)
        controller = ctx.probe.start_controller(FAILURE_GUARD, job)
        for event in rnd.events:
            await _wait_log(watcher, _reached(event.at_step), timeout=_steps_timeout(watcher, event.at_step),
                            what=f"cooperative: {job} reaching step {event.at_step} (the next event)")
            last = watcher.last()
            fired = last.step if last else 0
            victim = _pick(await cloud.job_hosts(), event.victim)
            notice = None
            outcome_note = ""
            left: bool | None = None
            injected: asyncio.Task[int] | None = None
            if event.kind == "announced":
                notice = time.time()
                at = datetime.now(UTC)
                spec = PredictedFailureSpec(host=victim, at=0.0, eta=event.lead_s, confidence=0.9, gpu=0,
                                            reason=f"notice:{event.channel}")
                injected = asyncio.create_task(
                    inject_scenario(ctx.probe.nats_url, ctx.probe.secret, Scenario(predicted_failures=(spec,)), at=at))
                await _sleep_until(notice + event.lead_s, watcher)
                left = not cloud.runs_on(victim)
            ctx.fleet.kill_host(victim)
            failed = time.time()  # its node's processes are dead from here on (found by marker, then killed)
            outcome = EventOutcome(kind=event.kind, channel=event.channel, lead_s=event.lead_s, at_step=event.at_step,
                                   victim=victim, notice_ts=notice, fail_ts=failed, fired_at_step=fired)
            if injected is not None:
                outcome.left_before = left
                applied = await injected
                outcome_note = (f"prediction applied by {applied} agent(s); "
                                + ("the job had left the host" if left else "a worker of the job still ran on the "
                                   "host") + " when it died")
            run.events.append(outcome)
            log(f"  cooperative r{repeat} k{index}: {event.kind} failure of {victim} at step {fired}"
                + (f" ({outcome_note})" if outcome_note else ""))
            await _wait_log(watcher, _recovered(failed), timeout=RECOVERY_TIMEOUT_S[COOPERATIVE],
                            what=f"cooperative: a step of {job} after the failure of {victim}")
            first = recovery_step(watcher.steps, failed)
            outcome.recovered_ts = first.ts if first else None
            await cloud.wait_down(victim)
            await cloud.host_up(victim)
            watcher.poll()
            last = watcher.last()
            if last is not None and last.world < WORKERS:
                regrown = await cloud.regrow(WORKERS)
                outcome_note = "; ".join(filter(None, [outcome_note, regrown]))
            outcome.note = outcome_note
        await _wait_log(watcher, _reached(rnd.target_step), timeout=_steps_timeout(watcher, rnd.target_step),
                        what=f"cooperative: {job} reaching its target step {rnd.target_step}")
    finally:
        if controller is not None:
            await ctx.probe.stop_controller(controller)
