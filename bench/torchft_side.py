#!/usr/bin/env python
"""torchft side of bench_elastic.py: the same example MLP, trained by torchft replica groups, through the same
transitions (scale-up, graceful scale-down, kill -9, SIGSTOP), timed from the trigger to the first step at the new
world size, read from the same kind of log line (`HH:MM:SS.mmm workloads.examples INFO step=N loss=X world=W`).

torchft (https://github.com/pytorch/torchft, 0.2.0) is not a project dependency: `pip install torchft==0.2.0` in the
benchmark's environment. Without it, `available()` is False and bench_elastic.py prints how to install it.

The job: a torchft lighthouse (`torchft.coordination.LighthouseServer`, in its own process; `--min_replicas 1`,
join timeout `JOIN_TIMEOUT_MS`, heartbeat timeout `HEARTBEAT_TIMEOUT_MS`, quorum tick 100 ms) and up to 3 replica
groups of 1 process each (one per simulated host), each its own process in its own session, so that a group is
killed or stopped as a whole. A group: its own TCPStore, `torchft.Manager` (min_replica_size 1, heartbeat 1 s,
`timeout` = `TIMEOUT_S` for collectives and RPCs, quorum timeout `QUORUM_TIMEOUT_S`), `torchft.ProcessGroupGloo`
(timeout `TIMEOUT_S`), `workloads.examples.mlp.make_model()` with its gradients averaged by `manager.allreduce` (one
call per parameter, waited for) and `torchft.optim.OptimizerWrapper` around AdamW (lr 3e-3, as the example; it
starts the quorum in `zero_grad` and steps only if `should_commit`), batch 32 from `make_loss_fn()`, then
`--step-delay-ms` of sleep per step like the bench's job. It logs every committed step with `world` =
`manager.num_participants()`. Not torchft's DDP wrapper (`--ddp` to use it): in 0.2.0 its comm hook fails
(`assert fut._fut`, AssertionError, the worker dies) when an allreduce errors, which a peer frozen mid-allreduce
causes over gloo.

Per repeat, one sequence: 2 groups -> **scale_up** (a 3rd group started; trigger: its start) -> **scale_down** (one
group sent SIGTERM: it leaves after its current step and shuts its manager down; trigger: the signal) -> a group
started again -> **kill** (SIGKILL of one group) -> a group started again -> **freeze** (SIGSTOP of one group). Each
transition: seconds from the trigger to the first step at the new world size on a surviving group, the survivors'
longest gap between two steps around it (from their last step before the trigger to that first step), the steps lost
(highest step logged before the trigger minus the step the survivors continue from), and whether any survivor's
process changed (torchft heals in-process: it never restarts one). For torchft a "node" is a replica group, so
`node_freeze` is the same case as `freeze` (filled with the same figures).

Every process carries an `HZ_NODE_ID` marker beginning with the given prefix; all are SIGCONT + SIGKILLed after each
sequence, on error, SIGINT and SIGTERM (run standalone) or by bench_elastic.py's own reaper (which matches its tag).

    python bench/torchft_side.py --repeat 1        # standalone, prints JSON
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENV_MARKER = "HZ_NODE_ID"  # harmonaize.job_runtime.ENV_NODE_MARKER, written out so this module stays standalone
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_MS = 3000
JOIN_TIMEOUT_MS = 1000
TIMEOUT_S = 5.0
QUORUM_TIMEOUT_S = 20.0
INSTALL_HINT = "torchft column skipped: `pip install torchft==0.2.0` in this venv to run it (not a project dependency)"

STEP_RE = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) workloads\.examples INFO step=(\d+) loss=\S+ world=(\d+)")
SCENARIOS = ("scale_up", "scale_down", "kill", "freeze")


def available() -> bool:
    try:
        import torchft  # type: ignore[import-not-found, import-untyped, unused-ignore]  # noqa: F401
    except ImportError:
        return False
    return True


def version() -> str | None:
    try:
        from importlib.metadata import version as _v

        return _v("torchft")
    except Exception:
        return None


# -- the worker and the lighthouse (run as `python bench/torchft_side.py worker|lighthouse ...`) --------------------


def run_lighthouse(port_file: str) -> None:
    from torchft.coordination import LighthouseServer  # type: ignore[import-not-found, import-untyped, unused-ignore]

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS, quorum_tick_ms=100,
                              heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    Path(port_file + ".tmp").write_text(server.address())
    os.replace(port_file + ".tmp", port_file)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.shutdown()


def run_worker(replica: str, lighthouse: str, step_delay_ms: int, use_ddp: bool) -> None:
    import torch
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported from torch._C, unlisted
    from torchft import Manager, ProcessGroupGloo  # type: ignore[import-not-found, import-untyped, unused-ignore]
    from torchft.ddp import DistributedDataParallel  # type: ignore[import-not-found, import-untyped, unused-ignore]
    from torchft.optim import OptimizerWrapper  # type: ignore[import-not-found, import-untyped, unused-ignore]

    from workloads.data import MicroBatch
    from workloads.examples.common import configure_logging
    from workloads.examples.mlp import make_loss_fn, make_model

    configure_logging()
    log = logging.getLogger("workloads.examples")
    stopping = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    torch.manual_seed(0)  # the same initial weights everywhere (init_sync also copies them at step 0)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def load_state(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=dt.timedelta(seconds=TIMEOUT_S)), load_state_dict=load_state, state_dict=state,
        min_replica_size=1, timeout=dt.timedelta(seconds=TIMEOUT_S),
        quorum_timeout=dt.timedelta(seconds=QUORUM_TIMEOUT_S), connect_timeout=dt.timedelta(seconds=10),
        rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse,
        replica_id=replica, heartbeat_interval=dt.timedelta(seconds=HEARTBEAT_S),
    )
    ddp = DistributedDataParallel(manager, model) if use_ddp else model
    optimizer = OptimizerWrapper(manager, inner)
    loss_fn = make_loss_fn()
    generator = torch.Generator().manual_seed(hash(replica) % 2**31)
    log.info("ready replica=%s", replica)
    while not stopping:
        optimizer.zero_grad()  # starts the (async) quorum
        loss = loss_fn(ddp, MicroBatch(step=manager.current_step(), micro=0, rank=0, size=32, generator=generator,
                                       device=torch.device("cpu")))
        loss.backward()  # type: ignore[no-untyped-call]  # with use_ddp: the allreduce, in torchft's DDP comm hook
        if not use_ddp:  # the gradients' allreduce, ourselves (an error is kept by the manager: should_commit False)
            for work in [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]:
                work.wait()
        before = manager.current_step()
        optimizer.step()  # should_commit; steps only if every participant's allreduce succeeded
        if manager.current_step() > before:
            log.info("step=%d loss=%.4f world=%d", manager.current_step(), loss.item(), manager.num_participants())
        else:
            log.info("uncommitted step=%d world=%d", before, manager.num_participants())
        if step_delay_ms > 0 and not stopping:
            time.sleep(step_delay_ms / 1000)
    log.info("leaving at step %d", manager.current_step())
    manager.shutdown(wait=False)
    os._exit(0)


# -- the driver -------------------------------------------------------------------------------------------------------


@dataclass
class Group:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    pid: int = 0

    def steps(self) -> list[tuple[float, int, int]]:
        """(unix time, step, world) of every committed step logged so far."""
        out = []
        try:
            text = self.log.read_text(errors="replace")
        except FileNotFoundError:
            return []
        for line in text.splitlines():
            m = STEP_RE.match(line)
            if m:
                out.append((_clock(m.group(1)), int(m.group(2)), int(m.group(3))))
        return out


def _clock(hms: str) -> float:
    """A log line's local HH:MM:SS.mmm as unix time (the run never spans more than a few minutes)."""
    now = dt.datetime.now()
    t = dt.datetime.combine(now.date(), dt.time.fromisoformat(hms))
    if (t - now).total_seconds() > 12 * 3600:
        t -= dt.timedelta(days=1)
    return t.timestamp()


@dataclass
class Sequence:
    marker: str
    workdir: Path
    step_delay_ms: int
    timeout: float
    settle_steps: int
    use_ddp: bool = False
    groups: list[Group] = field(default_factory=list)
    lighthouse: subprocess.Popen[bytes] | None = None
    address: str = ""
    counter: int = 0

    def _spawn(self, name: str, args: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.workdir / f"{name}.log"
        env = dict(os.environ, **{ENV_MARKER: f"{self.marker}{name}"})
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        with open(log, "wb") as f:
            proc = subprocess.Popen([sys.executable, "-u", str(Path(__file__).resolve()), *args], stdout=f,
                                    stderr=subprocess.STDOUT, env=env, cwd=str(ROOT), start_new_session=True)
        return proc, log

    def start_lighthouse(self) -> None:
        port_file = self.workdir / "lighthouse.addr"
        self.lighthouse, _ = self._spawn("lighthouse", ["lighthouse", str(port_file)])
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if time.monotonic() > deadline or self.lighthouse.poll() is not None:
                raise RuntimeError("torchft lighthouse did not start")
            time.sleep(0.05)
        self.address = port_file.read_text().strip()

    def start_group(self) -> Group:
        self.counter += 1
        name = f"g{self.counter}"
        proc, log = self._spawn(name, ["worker", name, self.address, str(self.step_delay_ms),
                                       "ddp" if self.use_ddp else "allreduce"])
        group = Group(name, proc, log, proc.pid)
        self.groups.append(group)
        return group

    def alive(self) -> list[Group]:
        return [g for g in self.groups if g.proc.poll() is None]

    def wait_world(self, groups: list[Group], world: int, after: float, steps: int = 1) -> tuple[float, int]:
        """The first step at `world` logged by any of `groups` after `after` (time, step), once each of them has
        logged `steps` steps at that world."""
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            firsts = []
            ok = True
            for g in groups:
                at = [(t, s) for t, s, w in g.steps() if w == world and t >= after]
                if len(at) < steps:
                    ok = False
                    break
                firsts.append(at[0])
            if ok and firsts:
                return min(firsts)
            for g in groups:
                if g.proc.poll() is not None:
                    tail = g.log.read_text(errors="replace").strip().splitlines()[-1:]
                    raise RuntimeError(f"torchft group {g.name} exited ({g.proc.returncode}): {tail}")
            time.sleep(0.1)
        raise TimeoutError(f"torchft: no step at world {world} within {self.timeout} s")

    def transition(self, name: str, trigger: Any, world: int, survivors: list[Group]) -> dict[str, Any]:
        pids = {g.name: g.proc.pid for g in survivors}
        max_before = max((s for g in self.groups for _, s, _ in g.steps()), default=0)
        t0 = time.time()
        trigger()
        t_new, first_step = self.wait_world(survivors, world, t0)
        gap = 0.0
        for g in survivors:
            times = [t for t, _, _ in g.steps()]
            before = [t for t in times if t < t0]
            window = [t for t in times if (not before or t >= before[-1]) and t <= t_new + 1e-3]
            gap = max([gap, *(b - a for a, b in zip(window, window[1:], strict=False))])
        restarted = any(g.proc.poll() is not None or g.proc.pid != pids[g.name] for g in survivors)
        errors = sum(g.log.read_text(errors="replace").count("should_commit=False") for g in survivors)
        return {"name": name, "world": world, "seconds": round(t_new - t0, 3), "gap_s": round(gap, 3),
                "steps_lost": max(0, max_before - (first_step - 1)), "first_step": first_step,
                "max_step_before": max_before, "survivors_restarted": restarted,
                "survivor_failed_commits": errors, "trigger_unix": round(t0, 3)}

    def settle(self, world: int) -> None:
        self.wait_world(self.alive(), world, time.time(), steps=self.settle_steps)

    def run(self) -> Iterator[dict[str, Any]]:
        self.start_lighthouse()
        self.start_group()
        self.start_group()
        self.settle(2)
        running = self.alive()
        yield self.transition("scale_up", self.start_group, 3, running)
        self.settle(3)
        leaver = self.alive()[-1]
        yield self.transition("scale_down", lambda: leaver.proc.send_signal(signal.SIGTERM), 2,
                              [g for g in self.alive() if g is not leaver])
        leaver.proc.wait(30)
        self.start_group()
        self.settle(3)
        victim = self.alive()[-1]
        yield self.transition("kill", lambda: os.killpg(victim.proc.pid, signal.SIGKILL), 2,
                              [g for g in self.alive() if g is not victim])
        victim.proc.wait(10)
        self.start_group()
        self.settle(3)
        frozen = self.alive()[-1]
        yield self.transition("freeze", lambda: os.killpg(frozen.proc.pid, signal.SIGSTOP), 2,
                              [g for g in self.alive() if g is not frozen])

    def reap(self) -> None:
        procs = [g.proc for g in self.groups] + ([self.lighthouse] if self.lighthouse else [])
        for sig in (signal.SIGCONT, signal.SIGKILL):
            for p in procs:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


def run_scenarios(repeat: int = 1, *, marker: str | None = None, step_delay_ms: int = 50, timeout: float = 60.0,
                  settle_steps: int = 10, workdir: Path | None = None, keep: bool = False,
                  progress: Any = None, use_ddp: bool = False) -> dict[str, Any]:
    """Run the sequence `repeat` times; {scenario: {"torchft_s": median, "torchft_gap_s": median, "runs": [...]}},
    with `node_freeze` = `freeze` (a torchft node is a replica group)."""
    marker = marker or f"hzb{os.getpid()}-tf-"
    base = Path(tempfile.mkdtemp(prefix="torchft-side-", dir=workdir))
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SCENARIOS}
    try:
        for r in range(repeat):
            seq = Sequence(f"{marker}r{r}-", base / f"r{r}", step_delay_ms, timeout, settle_steps, use_ddp)
            seq.workdir.mkdir(parents=True)
            try:
                for t in seq.run():
                    runs[t["name"]].append(t)
                    if progress:
                        label = f"torchft repeat {r + 1}" if repeat > 1 else "torchft"
                        progress(f"{label}: {t['name']} {t['seconds']} s (gap {t['gap_s']} s, lost {t['steps_lost']})")
            finally:
                seq.reap()
    finally:
        if not keep:
            import shutil

            shutil.rmtree(base, ignore_errors=True)
    result: dict[str, Any] = {}
    for s in SCENARIOS:
        rs = runs[s]
        result[s] = {"torchft_s": statistics.median(x["seconds"] for x in rs) if rs else None,
                     "torchft_gap_s": statistics.median(x["gap_s"] for x in rs) if rs else None,
                     "runs": rs}
    result["node_freeze"] = dict(result["freeze"], note="torchft: a node is a replica group; same case as freeze")
    return result


def settings(use_ddp: bool = False) -> dict[str, Any]:
    return {"torchft": version(), "heartbeat_s": HEARTBEAT_S, "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
            "join_timeout_ms": JOIN_TIMEOUT_MS, "timeout_s": TIMEOUT_S, "quorum_timeout_s": QUORUM_TIMEOUT_S,
            "groups": "3 x 1 process",
            "wrapper": "torchft.DistributedDataParallel + OptimizerWrapper" if use_ddp
            else "manager.allreduce per gradient + OptimizerWrapper"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "lighthouse":
        run_lighthouse(argv[1])
        return 0
    if argv and argv[0] == "worker":
        run_worker(argv[1], argv[2], int(argv[3]), argv[4] == "ddp")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--step-delay-ms", type=int, default=50)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--ddp", action="store_true", help="torchft's DDP wrapper instead of manager.allreduce (it fails "
                                                       "on a peer's failure in 0.2.0: AssertionError in its comm hook)")
    args = ap.parse_args(argv)
    if not available():
        print(INSTALL_HINT, file=sys.stderr)
        return 2

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)  # also where it started ignored (a background job)
    result = run_scenarios(args.repeat, step_delay_ms=args.step_delay_ms, keep=args.keep, use_ddp=args.ddp,
                           progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps({"settings": settings(args.ddp), "summary": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
