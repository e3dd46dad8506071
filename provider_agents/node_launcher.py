"""The node launcher: each host agent runs its host's torchrun node for every job the desired state places there.

It owns the middle of the chain agreement -> epoch -> desired state -> launcher -> trainer resume. Before it, the
control plane: whatever changes a job's node set or plan (an accepted negotiation, a host down, a hung node)
bumps the job's placement *epoch* in the same transaction and writes the desired state of every host the job uses
or used. Here, every host of the job sees a new `NodeSpec` (keyed by epoch, size, plan, entrypoint and rendezvous
endpoint), stops its old node and starts one into a fresh rendezvous (`--rdzv-id <tenant>.<job>.e<epoch>`) sized
exactly to the job's node count (`--nnodes=N:N`), so the rendezvous closes as soon as the N nodes arrive instead of
waiting out torchrun's last-call and keep-alive timeouts. The store is the provider's (`rendezvous_host`), reached as
a client (`is_host=0`), so no worker host's death can take it down. After it, the trainer (`workloads`) resumes from
the job's latest checkpoint, resharded to the new world size and plan.

Level-triggered, like the rest of the agent: every pass compares what runs with what the host's assignment asks
for and converges, so a restarted agent adopts the nodes that are still healthy instead of restarting them (each
node's pid and spec are kept in `<work_dir>/jobs/<tenant>.<job>/node.json`; a process is only adopted if it still
carries the node's environment marker, so a recycled pid is never mistaken for a node, and only if that marker is
this cloud's: another cloud on the machine may run nodes of the same host, tenant and job names). Each node's record
changes state only through `node_lifecycle`'s transition table, and every transition is logged.

How a node leaves an epoch depends on why (`AssignedJob.restart`): `graceful` (agreements) sends SIGTERM to torchrun,
which forwards it; the job's runtime agrees on a step, checkpoints and exits 0; after `grace_s` whatever is left is
killed. `immediate` (a peer host died) kills every process of the node at once: the survivors could not finish a
collective checkpoint with a dead peer, and would hang in a collective if it was frozen rather than dead.

A *standby* (`HostAssignment.standby`: an open offer would grow a job onto this host) is started like an in-place node
but without a membership: its workers build the model and wait. If the accept places the job here, the node is
announced its epoch like any in-place node that stays; otherwise it is killed when the offer closes, or at the
offer's expiry by the launcher's own clock. A standby is never reported as a node failure: it is not in the job yet.

Directives reach the job as a file (`directives.json` in the node's control directory), rewritten atomically when
the assignment's directives version changes; the job applies them at a step boundary, without a restart. Progress
goes the other way: the job's global rank 0 writes `progress.json`, and the launcher of the host it runs on relays
each new version to the control plane.

A node can fail while its host is fine, which no heartbeat shows: it hangs, or it keeps exiting with an error. Every
worker beats into a liveness file; `watch` judges each running node with a `hang_detector` (frozen: no beat; stalled:
no step back from the script's own code, each against a bound from the job's step time), kills a hung node at once
(SIGKILL: a stopped process takes no other signal, and its peers are stuck until it is gone) and reports it to the
control plane, which takes the node out of the job like a failed host's. A node out of restarts is reported the same
way, so the job's status and the tenant's events say why its step no longer moves.

Traps handled here (docs/building-blocks.md): `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (scale-up deadlock in torch
2.13), keep-alive attempts >= 3 (split brain), workers found by marker (orphans), the store hosted outside the worker
hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from harmonaize.desired_state import AssignedJob, HostAssignment, RestartMode
from harmonaize.job_runtime import (
    CONTROL_DIRECTIVES_FILE,
    CONTROL_MEMBERSHIP_FILE,
    CONTROL_PROGRESS_FILE,
    ENV_NODE_MARKER,
    ENV_RUN_SPEC,
    JobProgress,
    Membership,
    WorkerSpec,
    read_model,
    write_model_atomically,
)
from harmonaize.jobs import ParallelPlan
from harmonaize.node_failures import NodeFailureReason, NodeFailureReport
from harmonaize.pseudonyms import locality_pseudonym
from provider_agents.hang_detector import HangBounds, HangDetector
from provider_agents.markers import host_prefix, node_marker
from provider_agents.node_lifecycle import NodeEvent, NodeState, next_state
from provider_agents.node_watch import clear_liveness, read_liveness
from provider_agents.processes import alive, marked_processes, signal_marked, stopped
from provider_agents.warm_torchrun import WarmTorchrun, node_env

__all__ = ["LauncherConfig", "NodeLauncher", "NodeSpec", "RDZV_CONF", "TORCHRUN_LOG_DIR"]

log = logging.getLogger(__name__)

RDZV_CONF = "is_host=0,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120"
"""Nodes are clients of the provider's store; short timeouts, but never fewer than 3 keep-alive attempts (split
brain)."""

TORCHRUN_LOG_DIR = "torchelastic"
"""Under a job's control directory: torchrun's `--log-dir`. Without one, every start makes a new directory in the
system's temp dir that nothing removes, outside this cloud's own files."""

EndpointLookup = Callable[[str, str], Awaitable[str | None]]
ProgressSink = Callable[[JobProgress], Awaitable[object]]
"""Relays a node's progress; whatever it returns is ignored."""
FailureSink = Callable[[NodeFailureReport], Awaitable[None]]
"""Takes a node failure to the control plane; raises to have it retried on the next `watch` pass."""


@dataclass(frozen=True)
class LauncherConfig:
    host: str
    work_dir: Path
    checkpoint_root: Path
    cloud: str
    """This cloud's id (`markers.cloud_id`): every marker begins with it, so no other cloud's processes are touched."""
    python: str = sys.executable
    grace_s: float = 30.0
    max_restarts: int = 3
    monitor_interval_s: float = 0.5
    extra_env: Mapping[str, str] = field(default_factory=dict)
    warm: bool = True
    """Keep a torchrun agent with torch already imported, ready to become the next node (`warm_torchrun`)."""
    hang_bounds: HangBounds = HangBounds()
    """When a running node counts as hung (`hang_detector`)."""
    in_place: bool = True
    """Run DDP jobs in place (`workloads.elastic`): an epoch change that keeps a node keeps its processes."""
    local_addr: str | None = None
    """The address peers reach this host's workers at, for a restarted node's torchrun (`--local-addr`); None: what
    its host name resolves to. A testbed host sets its data address: its host name is the machine's."""


@dataclass(frozen=True)
class NodeSpec:
    """Everything that, when it changes, needs a new torchrun node."""

    tenant: str
    job: str
    epoch: int
    nodes: int
    workers: int
    plan: str
    entrypoint: tuple[str, ...]
    endpoint: str
    in_place: bool = False
    """Its workers form the job's group on the provider's store and follow `membership.json` across epochs."""
    standby: bool = False
    """A warm joiner for an open offer: started, model built, no membership yet (see `AssignedJob.standby_until`)."""

    @property
    def marker_suffix(self) -> str:
        return f"{self.tenant}.{self.job}.e{self.epoch}"

    def moves_in_place(self, new: NodeSpec) -> bool:
        """`new` can be reached without restarting this node: both in place, only the epoch and node count differ
        (and whether it still stands by: the accept of its offer makes a standby a member without a restart)."""
        same = dataclasses.replace(new, epoch=self.epoch, nodes=self.nodes, standby=self.standby)
        return self.in_place and new.in_place and self == same


@dataclass
class _Node:
    spec: NodeSpec
    pid: int
    marker: str
    process: asyncio.subprocess.Process | None = None
    returncode: int | None = None
    failures: int = 0
    agent_marker: str | None = None
    """The marker in the torchrun agent's own environment when it was a warm process (its workers carry `marker`)."""
    state: NodeState = NodeState.PLACED
    """Where the node is in its lifecycle; changed only by `advance` (a record replacing another starts from the
    other's state, so one job's node on this host follows one path through the table)."""
    detector: HangDetector | None = None
    failure: NodeFailureReport | None = None
    """Why the node failed in its epoch (hung and killed, or out of restarts); sent until the control plane has it."""
    failure_sent: bool = False
    started_epoch: int = -1
    """The epoch its processes started in (their marker and liveness carry it); `spec.epoch` moves on in place."""

    def __post_init__(self) -> None:
        if self.started_epoch < 0:
            self.started_epoch = self.spec.epoch

    def running(self) -> bool:
        if self.process is not None:
            return self.process.returncode is None
        return alive(self.pid)

    def advance(self, event: NodeEvent, host: str, detail: str) -> None:
        """Move to the state the transition table gives for `event`, or raise (InvalidNodeTransitionError)."""
        state = next_state(self.state, event)
        log.info("host %s: %s/%s epoch %d: %s -> %s (%s: %s)", host, self.spec.tenant, self.spec.job,
                 self.spec.epoch, self.state.value, state.value, event.value, detail)
        self.state = state


class NodeLauncher:
    """Runs, adopts and stops this host's torchrun nodes. `converge()` is one level-triggered pass."""

    def __init__(
        self,
        config: LauncherConfig,
        *,
        secret: bytes,
        endpoints: EndpointLookup,
        on_progress: ProgressSink | None = None,
        on_failure: FailureSink | None = None,
    ) -> None:
        self.config = config
        self._secret = secret
        self._endpoints = endpoints
        self._on_progress = on_progress
        self._on_failure = on_failure
        self._nodes: dict[tuple[str, str], _Node] = {}
        self._busy: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._directives_written: dict[tuple[str, str], int] = {}
        self._progress_seen: dict[tuple[str, str], int] = {}
        self.starts = 0
        self.adopted = 0
        self.warm_starts = 0
        self._warm: WarmTorchrun | None = None
        self._warming: asyncio.Task[None] | None = None
        self._warm_count = 0
        self._adopt_existing()

    # -- state on disk -------------------------------------------------------------------------------------------

    def control_dir(self, tenant: str, job: str) -> Path:
        return self.config.work_dir / "jobs" / f"{tenant}.{job}"

    def _marker(self, spec: NodeSpec) -> str:
        return node_marker(self.config.cloud, self.config.host, spec.marker_suffix)

    def _adopt_existing(self) -> None:
        jobs_dir = self.config.work_dir / "jobs"
        if not jobs_dir.is_dir():
            return
        for state_file in sorted(jobs_dir.glob("*/node.json")):
            try:
                state = json.loads(state_file.read_text())
                spec = NodeSpec(**{**state["spec"], "entrypoint": tuple(state["spec"]["entrypoint"])})
                pid, marker = int(state["pid"]), str(state["marker"])
                agent_marker = state.get("agent_marker")
                started_epoch = int(state.get("started_epoch", spec.epoch))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring unreadable node state %s: %r", state_file, exc)
                continue
            mine = host_prefix(self.config.cloud, self.config.host)
            if not all(isinstance(m, str) and m.startswith(mine) for m in (marker, agent_marker or marker)):
                log.warning("not adopting node %s of %s: its marker is not this cloud's host's (%s...)",
                            marker, state_file, mine)
                continue
            if pid in marked_processes(agent_marker or marker):
                node = _Node(spec=spec, pid=pid, marker=marker, agent_marker=agent_marker,
                             started_epoch=started_epoch)
                node.advance(NodeEvent.ADOPT, self.config.host, f"adopted running node {marker} (pid {pid})")
                self._nodes[(spec.tenant, spec.job)] = node
                self.adopted += 1

    def _save_state(self, node: _Node) -> None:
        path = self.control_dir(node.spec.tenant, node.spec.job) / "node.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {"pid": node.pid, "marker": node.marker, "agent_marker": node.agent_marker, "spec": asdict(node.spec),
                 "started_epoch": node.started_epoch}
            )
        )
        os.replace(tmp, path)

    # -- the reconcile pass --------------------------------------------------------------------------------------

    def running_nodes(self) -> dict[tuple[str, str], NodeSpec]:
        return {key: node.spec for key, node in self._nodes.items() if node.running()}

    async def converge(self, assignment: HostAssignment | None) -> None:
        """One pass: stop nodes no longer wanted, start or restart the wanted ones, hand over directives.

        `None` means the desired state is not known yet (not loaded): then nothing is touched, since stopping every
        node because the agent has not read its assignment yet would be exactly the wrong reaction to a restart.
        """
        if assignment is None:
            return
        wanted = _launchable(assignment, now=datetime.now(UTC))
        group = assignment.locality_group
        if wanted:
            self.prewarm()
        for key in [key for key in self._nodes if key not in wanted and key not in self._busy]:
            node = self._nodes.pop(key)
            if node.spec.standby:  # its offer closed without it: it holds no state of the job
                self._spawn(key, self._leave(node, RestartMode.IMMEDIATE, "its offer closed without it"))
            elif node.spec.in_place and node.running():
                self._spawn(key, self._leave_in_place(node))
            else:
                self._spawn(key, self._leave(node, RestartMode.GRACEFUL, "no longer placed here"))
        for key, job in wanted.items():
            self._write_directives(job)
            if key in self._busy:
                continue
            endpoint = await self._endpoints(job.tenant, job.job)
            if endpoint is None:
                continue
            spec = NodeSpec(
                tenant=job.tenant,
                job=job.job,
                epoch=job.epoch,
                nodes=job.nodes,
                workers=job.workers,
                plan=job.parallel_plan.value,
                entrypoint=tuple(job.entrypoint),
                endpoint=endpoint,
                in_place=self.config.in_place and job.parallel_plan is ParallelPlan.DDP,
                standby=job.standby,
            )
            if spec.standby and not spec.in_place:
                continue  # only an in-place node can join a running job; a restart-path job starts at the accept
            existing = self._nodes.get(key)
            if existing is None:
                self._spawn(key, self._start(spec, job, group))
            elif spec.standby and existing.spec.standby and existing.spec.moves_in_place(spec) and existing.running():
                existing.spec = spec  # still standing by (the job's epoch moved meanwhile): its membership waits
                self._save_state(existing)
            elif spec.standby and not existing.spec.standby:
                log.warning("host %s: %s/%s runs here already; no standby node beside it", self.config.host, *key)
            elif (
                existing.spec != spec
                and existing.spec.moves_in_place(spec)
                and existing.running()
                and existing.state in (NodeState.STARTING, NodeState.RUNNING)
            ):
                self._announce(existing, spec, job)
            elif existing.spec != spec or existing.state in (NodeState.STOPPING, NodeState.STOPPED):
                # a new spec; or a stop or the next start failed last time: stop again (a no-op if it is gone), start
                self._spawn(key, self._replace(existing, spec, job, group))
            elif not existing.running() and not existing.state.settled:
                self._spawn(key, self._after_exit(existing, job, group))

    def _spawn(self, key: tuple[str, str], work: Awaitable[None]) -> None:
        async def run() -> None:
            try:
                await work
            except Exception:
                log.exception("node launcher: %s/%s", *key)
            finally:
                self._busy.pop(key, None)

        self._busy[key] = asyncio.get_running_loop().create_task(run(), name=f"hz-node-{key[0]}-{key[1]}")

    async def settle(self) -> None:
        """Wait for every start/stop in flight (tests and shutdown)."""
        while self._busy:
            await asyncio.gather(*list(self._busy.values()), return_exceptions=True)

    async def _replace(self, node: _Node, spec: NodeSpec, job: AssignedJob, group: str) -> None:
        log.info(
            "host %s: %s/%s epoch %d -> %d (%s restart)",
            self.config.host, spec.tenant, spec.job, node.spec.epoch, spec.epoch, job.restart.value,
        )
        await self._leave(node, job.restart, f"{job.restart.value} restart into epoch {spec.epoch}")
        await self._start(spec, job, group, previous=node)

    def _announce(self, node: _Node, spec: NodeSpec, job: AssignedJob) -> None:
        """Move a running in-place node to `spec`'s epoch without restarting it: tell its workers."""
        urgent = job.restart is RestartMode.IMMEDIATE
        self._write_membership(spec, urgent=urgent)
        log.info(
            "host %s: %s/%s epoch %d -> %d in place (%d node(s), %s)", self.config.host, spec.tenant, spec.job,
            node.spec.epoch, spec.epoch, spec.nodes, "urgent: a peer failed" if urgent else "at a step boundary",
        )
        node.spec = spec
        self._save_state(node)

    def _write_membership(self, spec: NodeSpec, *, urgent: bool, member: bool = True) -> None:
        membership = Membership(
            epoch=spec.epoch,
            nodes=max(1, spec.nodes),
            workers=max(1, spec.workers),
            member=member,
            urgent=urgent,
            reason=("a peer failed" if urgent else "agreement") if member else "scale-down",
        )
        write_model_atomically(self.control_dir(spec.tenant, spec.job) / CONTROL_MEMBERSHIP_FILE, membership)

    async def _leave_in_place(self, node: _Node) -> None:
        """A scale-down: the node's workers leave at a step boundary the job agrees on; the rest go on.

        Its launcher never learns the epoch the others move to (this host's assignment no longer has the job), so
        the leave order carries the next number; the workers only need to see that it is newer and not theirs.
        """
        node.advance(NodeEvent.STOP, self.config.host, "leaves the job in place")
        leave = dataclasses.replace(node.spec, epoch=node.spec.epoch + 1)
        self._write_membership(leave, urgent=False, member=False)
        await self._wait_gone(node, self.config.grace_s)
        self._kill(node)
        await self._wait_gone(node, 5.0)
        node.advance(NodeEvent.STOPPED, self.config.host, "no process of it left")

    async def _after_exit(self, node: _Node, job: AssignedJob, group: str) -> None:
        code = node.process.returncode if node.process is not None else None
        if code == 0:  # the job finished (or stopped cleanly) in this epoch: nothing to restart
            node.advance(NodeEvent.EXIT_OK, self.config.host, f"node {node.marker} finished")
            return
        if node.spec.standby:  # not part of the job yet: the accept starts a node afresh, nothing to report
            log.warning("host %s: standby node %s exited with %s", self.config.host, node.marker, code)
            node.advance(NodeEvent.GIVE_UP, self.config.host, f"standby, exit code {code}")
            return
        if node.spec.in_place and node.state is NodeState.RUNNING:
            # it had joined: its peers go on without it, and a restart here would find its epoch formed already
            log.error("host %s: in-place node %s exited with %s; reporting it", self.config.host, node.marker, code)
            node.advance(NodeEvent.GIVE_UP, self.config.host, f"exit code {code}, in place: not restarted")
            node.failure = self._failure_report(node, NodeFailureReason.CRASHED, detail=f"exit code {code}")
            await self._send_failures()  # now: the survivors are waiting for the epoch this report brings
            return
        if node.failures >= self.config.max_restarts:
            log.error("host %s: node %s failed %d times; giving up until the next epoch",
                      self.config.host, node.marker, node.failures + 1)
            node.advance(NodeEvent.GIVE_UP, self.config.host, f"exit code {code}, {node.failures + 1} failures")
            node.failure = self._failure_report(
                node, NodeFailureReason.OUT_OF_RESTARTS, detail=f"exit code {code}, {node.failures + 1} failures"
            )
            return
        log.warning("host %s: node %s exited with %s; restarting", self.config.host, node.marker, code)
        failures = node.failures + 1
        node.advance(NodeEvent.CRASH, self.config.host, f"exit code {code}, restart {failures} of "
                     f"{self.config.max_restarts}")
        await asyncio.sleep(min(0.5 * failures, 5.0))
        await self._start(node.spec, job, group, failures=failures, previous=node)

    async def _start(
        self, spec: NodeSpec, job: AssignedJob, group: str, *, failures: int = 0, previous: _Node | None = None
    ) -> None:
        """Spawn the node for `spec`; `previous`: the record it replaces (stopped, or restarting), whose state it
        continues from."""
        control = self.control_dir(spec.tenant, spec.job)
        control.mkdir(parents=True, exist_ok=True)
        clear_liveness(control)
        checkpoint_dir = self.config.checkpoint_root / spec.tenant / spec.job
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        worker_spec = WorkerSpec(
            tenant=spec.tenant,
            job=spec.job,
            epoch=spec.epoch,
            parallel_plan=job.parallel_plan,
            locality_group=locality_pseudonym(self._secret, spec.tenant, group) if group else "",
            checkpoint_dir=checkpoint_dir,
            control_dir=control,
            ranges=job.ranges,
            store_endpoint=spec.endpoint if spec.in_place else None,
            standby_until=job.standby_until,
        )
        spec_path = control / f"spec-e{spec.epoch}.json"
        write_model_atomically(spec_path, worker_spec)
        self._write_directives(job)
        if spec.standby:  # an earlier stint of the job here left one: the workers must wait for the accept's
            (control / CONTROL_MEMBERSHIP_FILE).unlink(missing_ok=True)
        elif spec.in_place:
            self._write_membership(spec, urgent=False)
        marker = self._marker(spec)
        env = {
            **os.environ,
            **self.config.extra_env,
            ENV_RUN_SPEC: str(spec_path),
            ENV_NODE_MARKER: marker,
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "PYTHONUNBUFFERED": "1",
        }
        if spec.in_place:  # one node per torchrun; the job's group is formed on the provider's store by the workers
            rendezvous = ["--standalone", "--nnodes=1", "--max-restarts=0"]
        else:
            rendezvous = [
                f"--nnodes={spec.nodes}:{spec.nodes}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={spec.endpoint}",
                f"--rdzv-id={spec.tenant}.{spec.job}.e{spec.epoch}",
                f"--rdzv-conf={RDZV_CONF}",
                f"--max-restarts={self.config.max_restarts}",
                *([f"--local-addr={self.config.local_addr}"] if self.config.local_addr else []),
            ]
        command = [
            self.config.python, "-m", "torch.distributed.run",
            *rendezvous,
            f"--nproc-per-node={spec.workers}",
            f"--monitor-interval={self.config.monitor_interval_s}",
            f"--log-dir={control / TORCHRUN_LOG_DIR}",  # else a new directory in the system's temp dir per start
            *spec.entrypoint,
        ]
        log_path = control / f"node-e{spec.epoch}.log"
        warm = self._warm if self._warm is not None and self._warm.ready else None
        if self._warm is not None and warm is None and self._warm.process.returncode is None:
            log.warning("host %s: the warm torchrun (pid %d) cannot take a node; killing it", self.config.host,
                        self._warm.process.pid)
            self._warm.process.kill()
        self._warm = None
        if warm is not None:
            process = await warm.take(command[3:], env=node_env(env), log=log_path)
            self.warm_starts += 1
        else:
            with open(log_path, "ab") as log_file:
                process = await asyncio.create_subprocess_exec(
                    *command, stdout=log_file, stderr=asyncio.subprocess.STDOUT, env=env, start_new_session=True
                )
        self.prewarm()
        node = _Node(
            spec=spec, pid=process.pid, marker=marker, process=process, failures=failures,
            agent_marker=warm.marker if warm is not None else None,
            state=previous.state if previous is not None else NodeState.PLACED,
        )
        node.advance(NodeEvent.START, self.config.host, f"pid {process.pid}")
        self._nodes[(spec.tenant, spec.job)] = node
        self._save_state(node)
        self.starts += 1
        log.info(
            "host %s: started %s/%s epoch %d: %d worker(s), %d node(s), plan %s (pid %d)",
            self.config.host, spec.tenant, spec.job, spec.epoch, spec.workers, spec.nodes, spec.plan, process.pid,
        )

    async def _leave(self, node: _Node, mode: RestartMode, why: str) -> None:
        """Stop the node on the launcher's order (a new spec, no placement here, the agent stopping its nodes)."""
        node.advance(NodeEvent.STOP, self.config.host, why)
        await self._stop(node, mode)
        node.advance(NodeEvent.STOPPED, self.config.host, "no process of it left")

    def _kill(self, node: _Node) -> None:
        signal_marked(node.marker, signal.SIGKILL)
        if node.agent_marker is not None:
            signal_marked(node.agent_marker, signal.SIGKILL)

    async def _stop(self, node: _Node, mode: RestartMode) -> None:
        if mode is RestartMode.IMMEDIATE or not node.running():
            self._kill(node)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.pid, signal.SIGTERM)
            await self._wait_gone(node, self.config.grace_s)
            self._kill(node)
        await self._wait_gone(node, 5.0)
        if node.process is not None and node.process.returncode is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(node.process.wait(), 5.0)

    async def _wait_gone(self, node: _Node, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if node.process is not None and node.process.returncode is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(node.process.wait(), 0.1)
            agent_gone = node.agent_marker is None or not marked_processes(node.agent_marker)
            if agent_gone and not marked_processes(node.marker):
                return
            await asyncio.sleep(0.05)

    def prewarm(self) -> None:
        """Start a warm torchrun agent in the background if none is ready or coming (no-op when `warm` is off)."""
        if not self.config.warm or self._warm is not None or (self._warming is not None and not self._warming.done()):
            return
        self._warming = asyncio.get_running_loop().create_task(self._make_warm(), name="hz-warm-torchrun")

    async def _make_warm(self) -> None:
        self._warm_count += 1
        marker = node_marker(self.config.cloud, self.config.host, f"warm.{os.getpid()}.{self._warm_count}")
        env = {**os.environ, **self.config.extra_env}
        self._warm = await WarmTorchrun.spawn(
            self.config.python, env=env, marker=marker, log=self.config.work_dir / "warm-torchrun.log"
        )

    async def shutdown(self, *, stop_nodes: bool) -> None:
        """Finish in-flight work; stop every node only when asked (an agent restart must leave them running)."""
        if self._warming is not None:
            await asyncio.gather(self._warming, return_exceptions=True)
        if self._warm is not None:
            await self._warm.discard()
            self._warm = None
        await self.settle()
        if stop_nodes:
            for key in list(self._nodes):
                await self._leave(self._nodes.pop(key), RestartMode.GRACEFUL, "the agent stops its nodes")

    # -- files shared with the job -------------------------------------------------------------------------------

    def _write_directives(self, job: AssignedJob) -> None:
        key = (job.tenant, job.job)
        if self._directives_written.get(key) == job.directives.version:
            return
        write_model_atomically(self.control_dir(*key) / CONTROL_DIRECTIVES_FILE, job.directives)
        self._directives_written[key] = job.directives.version

    async def relay_progress(self, assignment: HostAssignment | None) -> int:
        """Relay each job's new progress file (only the host of the job's rank 0 has one that changes)."""
        if assignment is None or self._on_progress is None:
            return 0
        relayed = 0
        for key in _launchable(assignment):
            relayed += await self._relay_progress(key)
        return relayed

    async def _relay_progress(self, key: tuple[str, str]) -> int:
        assert self._on_progress is not None
        path = self.control_dir(*key) / CONTROL_PROGRESS_FILE
        try:
            stamp = path.stat().st_mtime_ns
        except FileNotFoundError:
            return 0
        if self._progress_seen.get(key) == stamp:
            return 0
        try:
            progress = read_model(path, JobProgress)
        except (ValidationError, ValueError) as exc:
            log.warning("ignoring unreadable progress %s: %r", path, exc)
            self._progress_seen[key] = stamp
            return 0
        if progress is None or (progress.tenant, progress.job) != key:
            return 0
        await self._on_progress(progress)
        self._progress_seen[key] = stamp
        return 1


    # -- hangs and node failures ---------------------------------------------------------------------------------

    async def watch(self) -> int:
        """Judge every running node for a hang and kill a hung one; then send the failures not yet reported.

        A hung node is settled like one out of restarts: nothing restarts it in its epoch, since its peers are
        stuck with it and only a new epoch (the control plane's answer to the report) re-forms the job. Returns how
        many reports went out.
        """
        for key, node in list(self._nodes.items()):
            if key in self._busy or node.state not in (NodeState.STARTING, NodeState.RUNNING) or not node.running():
                continue
            if node.detector is None:
                node.detector = HangDetector(self.config.hang_bounds)
            spec = node.spec
            records = read_liveness(
                self.control_dir(*key), tenant=spec.tenant, job=spec.job, epoch=node.started_epoch, marker=node.marker
            )
            if records and node.state is NodeState.STARTING:
                node.advance(NodeEvent.BEATING, self.config.host, f"{len(records)} worker(s) beating")
            verdict = node.detector.observe(records, stopped={r.pid for r in records if stopped(r.pid)})
            if verdict is None:
                continue
            log.error("host %s: node %s is hung: %s; killing it", self.config.host, node.marker, verdict.describe())
            node.advance(NodeEvent.HANG, self.config.host, verdict.reason.value)
            if not node.spec.standby:  # a standby is not in the job: its peers wait for nothing of it
                node.failure = self._failure_report(
                    node, verdict.reason, step=verdict.step, detail=verdict.describe()
                )
            self._spawn(key, self._stop(node, RestartMode.IMMEDIATE))
        return await self._send_failures()

    def waiting_jobs(self) -> tuple[str, ...]:
        """`<tenant>/<job>` of the running nodes whose workers wait on a peer (`HangDetector.waiting`), for the
        heartbeat: a silent host of the same job is then declared down at once."""
        return tuple(
            f"{tenant}/{job}"
            for (tenant, job), node in sorted(self._nodes.items())
            if node.state is NodeState.RUNNING and not node.spec.standby and node.detector is not None
            and node.detector.waiting()
        )

    def _failure_report(
        self, node: _Node, reason: NodeFailureReason, *, step: int | None = None, detail: str = ""
    ) -> NodeFailureReport:
        return NodeFailureReport(
            tenant=node.spec.tenant, job=node.spec.job, host=self.config.host, epoch=node.spec.epoch, reason=reason,
            step=step, detected_at=datetime.now(UTC), detail=detail[:500],
        )

    async def _send_failures(self) -> int:
        if self._on_failure is None:
            return 0
        sent = 0
        for node in list(self._nodes.values()):
            if node.failure is None or node.failure_sent:
                continue
            try:
                await self._on_failure(node.failure)
            except Exception as exc:
                log.warning("host %s: could not report node %s failed: %r; retrying",
                            self.config.host, node.marker, exc)
                continue
            node.failure_sent = True
            sent += 1
        return sent


def _launchable(assignment: HostAssignment, *, now: datetime | None = None) -> dict[tuple[str, str], AssignedJob]:
    """The jobs to run here: those placed, then warm joiners of jobs not placed here whose offer is still open
    (`now`: judge their expiry; without it, placed jobs only)."""
    placed = {
        (job.tenant, job.job): job for job in assignment.jobs if job.workers > 0 and job.entrypoint and job.nodes > 0
    }
    if now is None:
        return placed
    standby = {
        (job.tenant, job.job): job
        for job in assignment.standby
        if job.workers > 0 and job.entrypoint and job.standby_until is not None and job.standby_until > now
    }
    return {**standby, **placed}
