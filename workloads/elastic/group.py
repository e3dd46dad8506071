"""One epoch's process group, formed on the provider's store, whose every collective can be abandoned.

**Forming** (`ElasticGroup.form`): every worker in an epoch registers under `hz/e<epoch>/` in the job's store (an
arrival number from an atomic `add`, then its record: pid, whether it holds the training state, at which step);
once the epoch's world size has arrived, every worker reads all records and derives the same ranks: members with
state first, the furthest step first (so rank 0 can hand its state to anyone behind), then joiners by arrival. The
gloo group is built on `hz/e<epoch>/pg`. No torchrun rendezvous is involved, so nothing restarts anyone.

Each epoch's group is torch.distributed's default group, re-initialised: destroying the old one only unregisters it
while a reference is kept (measured: 0.1 ms, then 3 ms for the new one), and everything that expects a default group
(DCP, `dist.get_rank()` in the tenant's script, DDP) keeps working unchanged.

**Abandoning**: gloo cannot cancel a collective (`ProcessGroupGloo.abort` leaves a blocked wait blocked, measured
with torch 2.13), and a frozen peer never closes its sockets. So no collective is waited on directly: each runs
async, and the caller waits on an event set either by the work's completion or by `abort()` (the membership
watcher's thread, on the provider's failure event). An abandoned group is kept referenced for the life of the
process: destroying it joins gloo's thread, which is still blocked on the frozen peer (until that peer is killed
or the op times out).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from harmonaize.job_runtime import Membership

__all__ = [
    "ElasticGroup",
    "Formation",
    "MembershipChanged",
    "PeerLost",
    "RendezvousFailed",
    "connect_store",
]

_log = logging.getLogger(__name__)

OP_TIMEOUT = timedelta(minutes=10)
"""gloo's own timeout per collective: long, because a healthy checkpoint barrier may wait on slow storage; failures
are found by the provider's event or a broken connection, not by this."""
POLL_S = 0.002


class MembershipChanged(Exception):
    """The collective was abandoned: the job moves to another epoch (the provider said so)."""


class PeerLost(Exception):
    """A collective failed on its own (a peer's connection broke): the group is unusable until the next epoch."""


class RendezvousFailed(Exception):
    """The epoch's group could not be formed (more arrivals than its world size, or none in time)."""


@dataclass(frozen=True)
class Formation:
    """What forming an epoch's group found: this worker's rank, and who holds the state at which step."""

    epoch: int
    rank: int
    world_size: int
    source_step: int | None
    """How far rank 0's state is (the `step` it formed with: any mark that orders states, the furthest first);
    None: no member holds state (a fresh start: load the checkpoint)."""
    in_sync: bool
    """Every member already holds the state at `source_step`: nothing to transfer."""
    survivors: int
    joiners: int


def connect_store(endpoint: str, *, timeout_s: float = 30.0) -> Store:
    """A client of the job's provider-hosted store at `host:port`."""
    host, _, port = endpoint.rpartition(":")
    return TCPStore(
        host, int(port), None, False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


_buried: list[Any] = []
"""Groups abandoned with a collective possibly still blocked in them (see the module docstring)."""


class ElasticGroup:
    """The current epoch's group of this worker; one instance for the life of the process."""

    def __init__(self, store: Store, *, backend: str = "gloo", rendezvous_timeout_s: float = 300.0) -> None:
        self._store = store
        self._backend = backend
        self._timeout_s = rendezvous_timeout_s
        self._group: dist.ProcessGroup | None = None
        self._lock = threading.Lock()
        self._waiting: threading.Event | None = None
        self._aborted_at: int | None = None
        """The epoch whose group `abort()` gave up; collectives in it raise `MembershipChanged`."""
        self._broken = False
        """A collective of the current group failed or was abandoned."""
        self._releasing: list[threading.Thread] = []
        self.epoch: int | None = None
        self.rank = 0
        self.world_size = 1

    @property
    def process_group(self) -> dist.ProcessGroup:
        if self._group is None:
            raise RuntimeError("no group formed yet")
        return self._group

    # -- forming --------------------------------------------------------------------------------------------------

    def form(
        self,
        membership: Membership,
        *,
        step: int | None,
        identity: str,
        interrupted: Callable[[], bool] = lambda: False,
    ) -> Formation:
        """Join `membership`'s epoch (collective among its members); `step`: how far this worker's state is (any
        integer that orders states; the trainer's counts boundaries too), None for a worker without state.

        `identity` names the worker across restarts of its node in one epoch (node marker and local rank): a
        worker restarted before the group formed takes its predecessor's place instead of counting twice.
        `interrupted()` is polled while waiting for the others: True (a newer epoch came) abandons this one with
        `MembershipChanged`.
        """
        self._bury()
        epoch, world = membership.epoch, membership.world_size
        prefix = f"hz/e{epoch}/"
        slot = prefix + f"slot/{identity}"
        if self._store.check([slot]):
            arrival = int(self._store.get(slot))
        else:
            arrival = int(self._store.add(prefix + "arrived", 1))
            self._store.set(slot, str(arrival))
        record = {"pid": os.getpid(), "step": step, "old_rank": self.rank if self.epoch is not None else None}
        self._store.set(prefix + f"member/{arrival}", json.dumps(record))
        deadline = time.monotonic() + self._timeout_s
        while (arrived := int(self._store.add(prefix + "arrived", 0))) < world:
            if interrupted():
                raise MembershipChanged(f"epoch {epoch} superseded while forming")
            if time.monotonic() > deadline:
                raise RendezvousFailed(f"epoch {epoch}: {arrived} of {world} workers arrived in {self._timeout_s} s")
            time.sleep(POLL_S)
        if arrival > world:
            raise RendezvousFailed(f"epoch {epoch}: arrival {arrival} beyond its world size {world}")
        keys = [prefix + f"member/{n}" for n in range(1, world + 1)]
        records = [json.loads(value) for value in self._store.multi_get(keys)]
        order = sorted(
            range(world),
            key=lambda i: (records[i]["step"] is None, -(records[i]["step"] or 0), records[i]["old_rank"] or 0, i),
        )
        rank = order.index(arrival - 1)
        dist.init_process_group(
            self._backend, store=PrefixStore(prefix + "pg", self._store), rank=rank, world_size=world,
            timeout=OP_TIMEOUT,
        )
        group = dist.group.WORLD
        assert group is not None
        with self._lock:
            self._group = group
            self.epoch, self.rank, self.world_size = epoch, rank, world
            self._aborted_at = None
        stateful = [records[i]["step"] for i in order if records[i]["step"] is not None]
        source = stateful[0] if stateful else None
        return Formation(
            epoch=epoch,
            rank=rank,
            world_size=world,
            source_step=source,
            in_sync=bool(stateful) and len(stateful) == world and len(set(stateful)) == 1,
            survivors=len(stateful),
            joiners=world - len(stateful),
        )

    # -- abandoning -----------------------------------------------------------------------------------------------

    def abort(self, *, below: int) -> None:
        """Give up the current group if its epoch is below `below`: a collective blocked in it (or started later)
        raises `MembershipChanged`.

        Thread-safe; called from the membership watcher when the provider reports a peer failed or hung (a group
        already formed for that report's epoch is left alone).
        """
        with self._lock:
            if self.epoch is None or self._group is None or self.epoch >= below:
                return
            self._aborted_at = self.epoch
            waiting = self._waiting
        if waiting is not None:
            waiting.set()

    def _abandoned_epoch(self) -> int | None:
        with self._lock:
            return self._aborted_at

    def _bury(self, *, in_background: bool = True) -> None:
        """Leave the current group; keep it referenced if a collective may still be blocked in it.

        A healthy group is released on a thread of its own (`in_background`): its destructor joins gloo's threads,
        20-30 ms measured here, which would otherwise be most of an in-place switch's pause. Before the process may
        exit, `leave()` releases in the foreground and waits for those threads: a C++ destructor still running on a
        daemon thread at interpreter exit aborts the process.
        """
        if self._group is not None:
            box = [self._group]
            broken = self._broken or self._aborted_at is not None
            self._group = None
            self._broken = False
            dist.destroy_process_group()  # only unregisters it: `box` still holds it
            if broken:
                _buried.extend(box)
            elif in_background:
                releasing = threading.Thread(target=box.clear, name="hz-group-release", daemon=True)
                releasing.start()
                self._releasing.append(releasing)
            else:
                box.clear()

    def leave(self) -> None:
        """Leave the group without a collective (this worker's node leaves the job, or the run ends)."""
        with self._lock:
            self._bury(in_background=False)
        for releasing in self._releasing:
            releasing.join()
        self._releasing.clear()

    # -- collectives ----------------------------------------------------------------------------------------------

    def allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """In place, like `dist.all_reduce`; raises `MembershipChanged` or `PeerLost` instead of hanging."""
        self._run(lambda: dist.all_reduce(tensor, op=op, async_op=True))

    def barrier(self) -> None:
        self._run(lambda: dist.barrier(async_op=True))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._run(lambda: dist.broadcast(tensor, src=src, async_op=True))

    def _run(self, launch: Callable[[], Any]) -> None:
        done = threading.Event()
        with self._lock:
            if self._aborted_at is not None:
                raise MembershipChanged(f"the group of epoch {self._aborted_at} was abandoned")
            self.process_group  # noqa: B018 - raises when no group is formed
            self._waiting = done
        try:
            work = launch()
            work.get_future().add_done_callback(lambda _: done.set())
            done.wait()
            aborted = self._abandoned_epoch()
            if aborted is not None and not work.is_completed():
                self._broken = True
                raise MembershipChanged(f"collective abandoned: epoch {aborted} ends")
            try:
                work.wait()
            except RuntimeError as exc:
                self._broken = True
                raise PeerLost(str(exc)) from exc
        finally:
            with self._lock:
                self._waiting = None
