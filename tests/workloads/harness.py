"""Running real torchrun nodes in tests: specs, directives, progress, logs, and waiting on conditions with deadlines.

Every node is `python -m torch.distributed.run` over gloo, started in its own session and tagged with a unique
environment marker; the `nodes` fixture stops what a test left running (SIGTERM to the agent, then SIGKILL to any
process carrying that test's marker, since torchrun's workers live in their own sessions and outlive a killed agent).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from harmonaize.job_runtime import (
    CONTROL_DIRECTIVES_FILE,
    CONTROL_PROGRESS_FILE,
    ENV_RUN_SPEC,
    Directives,
    JobProgress,
    JobRanges,
    WorkerSpec,
    read_model,
    write_model_atomically,
)
from harmonaize.jobs import Compression, ParallelPlan
from harmonaize.ranges import IntRange
from workloads.spec import ENV_DUMP_DIR, ENV_TEST_CRASH_SAVE

ROOT = Path(__file__).resolve().parents[2]
MARKER = "HZ_TEST_WORKLOADS_RUN"
LOSS_LINE = re.compile(r"step=(\d+) loss=([0-9.eE+-]+|nan) world=(\d+) plan=(\w+)")
EXIT_LINE = re.compile(r"\[rank (\d+)/(\d+)\] exiting at step (\d+) \((.*)\)")
APPLIED_LINE = re.compile(r"\[rank (\d+)/(\d+)\] step (\d+): directives v(\d+) (applied|refused)")

T = TypeVar("T")

WIDE_RANGES = JobRanges(
    checkpoint_interval_steps=IntRange(min=5, max=1000),
    compression_allowed=(Compression.NONE, Compression.FP16, Compression.POWERSGD),
    powersgd_max_rank=2,
    batch_size=IntRange(min=8, max=64),
    gradient_accumulation=IntRange(min=1, max=4),
)


def wait_for(predicate: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll `predicate` until it returns something truthy (returned), or fail after `timeout` s naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class JobDirs:
    """One job's shared directories, as a launcher would lay them out."""

    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def control(self) -> Path:
        return self.root / "control"

    @property
    def dumps(self) -> Path:
        return self.root / "dumps"

    def spec(
        self,
        name: str,
        *,
        plan: ParallelPlan = ParallelPlan.DDP,
        locality_group: str = "",
        epoch: int = 0,
        ranges: JobRanges = WIDE_RANGES,
    ) -> Path:
        """Write a node's WorkerSpec and return its path."""
        path = self.root / "specs" / f"{name}.json"
        spec = WorkerSpec(
            tenant="acme",
            job="train-1",
            epoch=epoch,
            parallel_plan=plan,
            locality_group=locality_group,
            checkpoint_dir=self.checkpoints,
            control_dir=self.control,
            ranges=ranges,
        )
        write_model_atomically(path, spec)
        return path

    def progress(self) -> JobProgress | None:
        return read_model(self.control / CONTROL_PROGRESS_FILE, JobProgress)

    def direct(self, directives: Directives) -> None:
        write_model_atomically(self.control / CONTROL_DIRECTIVES_FILE, directives)

    def dump(self, name: str) -> dict[str, torch.Tensor]:
        return torch.load(self.dumps / name, weights_only=True)

    def checkpoint_steps(self) -> list[int]:
        return sorted(int(p.name.split("-")[1]) for p in self.checkpoints.glob("step-*") if "." not in p.name)


@dataclass
class Node:
    """One torchrun agent (a "host" of the job) with its workers; output goes to a log file."""

    module: str
    nproc: int
    log_path: Path
    args: Sequence[str] = ()
    spec: Path | None = None
    dump_dir: Path | None = None
    crash_save: str | None = None
    rendezvous: tuple[int, int] | None = None  # (port, nnodes) for multi-node; standalone otherwise
    marker: str = ""
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    started_at: float = 0.0

    def command(self) -> list[str]:
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={self.nproc}",
            f"--log-dir={self.log_path.parent / 'torchelastic'}",  # not a new directory in the system's temp dir
        ]
        if self.rendezvous is None:
            command.append("--standalone")
        else:
            port, nnodes = self.rendezvous
            command += [
                f"--nnodes={nnodes}:{nnodes}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=test-{port}",
            ]
        return [*command, "-m", self.module, *self.args]

    def start(self) -> Node:
        env = {name: value for name, value in os.environ.items() if not name.startswith("HZ_")}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONFAULTHANDLER="1")
        env[MARKER] = self.marker
        if self.spec is not None:
            env[ENV_RUN_SPEC] = str(self.spec)
        if self.dump_dir is not None:
            env[ENV_DUMP_DIR] = str(self.dump_dir)
        if self.crash_save is not None:
            env[ENV_TEST_CRASH_SAVE] = self.crash_save
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.started_at = time.monotonic()
        return self

    def terminate(self) -> None:
        """What the provider's launcher does to change a job: SIGTERM to the torchrun agent only."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def losses(self) -> list[tuple[int, float]]:
        return [(int(m.group(1)), float(m.group(2))) for m in LOSS_LINE.finditer(self.log())]

    def exits(self) -> dict[int, tuple[int, str]]:
        """rank -> (step, reason) of every worker that exited through the runtime."""
        return {int(m.group(1)): (int(m.group(3)), m.group(4)) for m in EXIT_LINE.finditer(self.log())}


class Cluster:
    """The nodes a test started; `stop_all` leaves no process behind."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.marker = uuid.uuid4().hex
        self.nodes: list[Node] = []
        self._count = 0

    def start(self, module: str, *, nproc: int, args: Sequence[str] = (), **options: object) -> Node:
        self._count += 1
        node = Node(
            module=module,
            nproc=nproc,
            args=list(args),
            log_path=self.root / "logs" / f"node-{self._count}.log",
            marker=self.marker,
            **options,  # type: ignore[arg-type]
        )
        self.nodes.append(node.start())
        return node

    def stop_all(self) -> None:
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                node.terminate()
        for node in self.nodes:
            if node.process is not None:
                try:
                    node.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    node.process.kill()
                    node.process.wait(timeout=5)
        for pid in self._marked_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _marked_pids(self) -> Iterator[int]:
        needle = f"{MARKER}={self.marker}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if needle in environ.split(b"\0"):
                yield int(entry.name)

    def logs(self) -> str:
        return "\n".join(f"--- {node.log_path.name}\n{node.log()[-4000:]}" for node in self.nodes)


def assert_same_state(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], *, exact: bool, context: str
) -> None:
    """Every parameter equal (bitwise when `exact`, else allclose at float32 precision)."""
    assert before.keys() == after.keys(), f"{context}: keys differ: {sorted(before.keys() ^ after.keys())}"
    for name, tensor in before.items():
        other = after[name]
        assert tensor.shape == other.shape, f"{context}: {name} shape {tensor.shape} != {other.shape}"
        if exact:
            assert torch.equal(tensor, other), f"{context}: {name} differs"
        else:
            torch.testing.assert_close(other, tensor, rtol=1e-6, atol=1e-7, msg=f"{context}: {name} differs")
