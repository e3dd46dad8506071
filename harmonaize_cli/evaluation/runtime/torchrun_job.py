"""A training job under plain torchrun, the way it runs without a cooperating provider: one
`python -m torch.distributed.run` per node on one c10d rendezvous endpoint (loopback), periodic checkpoints to a
shared directory, torchrun's own restarts (`--max-restarts`) when a worker fails.

Every process started here (each torchrun agent and, inherited, its workers) carries a marker in its environment
(`HZ_NODE_ID`, `harmonaize.job_runtime.ENV_NODE_MARKER`): `<prefix><job>.<node>`. torchrun starts its workers in
their own sessions with no parent-death signal, so a node is not a process tree but every process with its marker:
killing a node (`kill`, a host's kill -9) and ending the job (`stop`, `reap` by the run's prefix) signal every one
of them, and nothing survives the run.

The first node started hosts the rendezvous store (`start_store_host` waits until it listens); killing it ends the
job (torchrun's known single point of failure), so a caller that wants torchrun's favourable case never picks it as
a victim. `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` keeps the workers' process-group store apart from the rendezvous
store (a restarted worker group would otherwise reuse a store its dead peers held).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from harmonaize.job_runtime import ENV_NODE_MARKER
from harmonaize_cli.evaluation.runtime.job_log import LogWatcher
from provider_agents.processes import marked_processes

__all__ = ["TorchrunJob", "child_env", "free_port", "port_open", "reap", "run_marker_prefix"]


def run_marker_prefix(tag: str = "hzeval") -> str:
    """A marker prefix unique to this run (process id and a random token): `<tag><pid>-<hex>-`."""
    return f"{tag}{os.getpid()}-{secrets.token_hex(3)}-"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def child_env(marker: str) -> dict[str, str]:
    """This process's environment without any `HZ_` setting (a run spec, a checkpoint dir, a cloud's credentials:
    plain torchrun knows none of them), plus the node's marker; unbuffered, one thread per worker, torchrun's agent
    logging its rendezvous (`LOGLEVEL=INFO`)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("HZ_")}
    env.update({ENV_NODE_MARKER: marker, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    return env


def _signal(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def reap(prefix: str) -> list[int]:
    """SIGCONT and SIGKILL every process whose marker begins with `prefix` (never this process); the pids found."""
    if not prefix:
        raise ValueError("an empty marker prefix would match every marked process on the machine")
    pids = [pid for pid in marked_processes(prefix, prefix=True) if pid != os.getpid()]
    _signal(pids, signal.SIGCONT)
    _signal(pids, signal.SIGKILL)
    return pids


class TorchrunJob:
    """The nodes of one torchrun job: `--nnodes`, c10d on a free loopback port, one worker per node, each node
    logging (agent and workers) to `<directory>/node-<name>.log`."""

    def __init__(
        self,
        directory: Path,
        *,
        name: str,
        entrypoint: Sequence[str],
        marker_prefix: str,
        nnodes: str = "1:3",
        max_restarts: int = 3,
    ) -> None:
        if not marker_prefix:
            raise ValueError("a torchrun job needs a marker prefix (every process of it carries one)")
        self.dir = directory
        self.name = name
        self.entrypoint = list(entrypoint)
        self.marker_prefix = marker_prefix
        self.nnodes = nnodes
        self.max_restarts = max_restarts
        self.port = free_port()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_dir = self.dir / "checkpoints"
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}
        self.killed: set[str] = set()
        self.watcher = LogWatcher(self.dir, ("node-*.log",))

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nnodes}", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.name}",
            f"--max-restarts={self.max_restarts}", f"--log-dir={self.dir / 'torchelastic'}",
            *self.entrypoint, "--checkpoint-dir", str(self.checkpoint_dir),
        ]

    def marker(self, node: str) -> str:
        return f"{self.marker_prefix}{self.name}.{node}"

    def log_file(self, node: str) -> Path:
        return self.dir / f"node-{node}.log"

    def start_node(self, node: str) -> float:
        """Start node `node` (a new name each time); returns when (wall clock)."""
        if node in self.nodes:
            raise ValueError(f"node {node!r} of {self.name} was started before: give a replacement a new name")
        began = time.time()
        with open(self.log_file(node), "ab") as log:
            self.nodes[node] = subprocess.Popen(
                self.command(), cwd=self.dir, env=child_env(self.marker(node)), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return began

    async def start_store_host(self, node: str, *, timeout: float = 60.0) -> float:
        """Start `node` and wait until its agent listens on the rendezvous endpoint (it hosts the store)."""
        began = self.start_node(node)
        deadline = time.monotonic() + timeout
        while not port_open(self.port):
            if self.nodes[node].poll() is not None:
                raise RuntimeError(f"torchrun {self.name}/{node} exited ({self.nodes[node].returncode}) before it "
                                   f"opened its rendezvous store (log: {self.log_file(node)})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"torchrun {self.name}/{node} did not open its rendezvous store on port "
                                   f"{self.port} within {timeout:g} s")
            await asyncio.sleep(0.05)
        return began

    def pids(self, node: str) -> list[int]:
        return marked_processes(self.marker(node))

    def kill(self, node: str) -> float:
        """kill -9 of the whole node (its agent and its worker, as a host dying); returns when (wall clock)."""
        pids = self.pids(node)
        began = time.time()
        _signal(pids, signal.SIGKILL)
        _signal(self.pids(node), signal.SIGKILL)  # anything forked meanwhile
        self.killed.add(node)
        proc = self.nodes.get(node)
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        return began

    def running(self) -> list[str]:
        """The nodes started and not killed whose agent still runs, in the order started."""
        return [node for node, proc in self.nodes.items() if node not in self.killed and proc.poll() is None]

    def stop(self) -> list[int]:
        """End the job: SIGCONT and SIGKILL every process of every node; the pids that were still there."""
        left = reap(f"{self.marker_prefix}{self.name}.")
        for proc in self.nodes.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return left
