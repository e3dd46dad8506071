"""The in-place side of one worker: the store, its group, the membership watch, and when to switch epochs.

`TrainingRun` asks three things of it. At start: form the first epoch. At each step boundary: what this rank
contributes to the agreement about switching (`boundary_slots`) and, from the summed slots, whether every rank
switches now (`switch_now`). After an interrupted collective: the epoch to re-form into (`next_membership`).

The switch rule for a planned change: every staying rank has seen the same newer epoch, every leaving rank its
leave order, and every joiner of the new epoch has already arrived in its rendezvous (each staying rank counts
them in the store), so the running ranks pause only for the group change and the state transfer, never for a
joiner's start-up. The slots are sums (one all-reduce serves the whole boundary), so "the same epoch" is checked as
n * sum(e^2) == sum(e)^2, which holds only when all n values are equal. When every rank got a leave order, the job
is being stopped everywhere: that is a stop, with its checkpoint, not a switch.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from harmonaize.job_runtime import CONTROL_MEMBERSHIP_FILE, ENV_NODE_MARKER, Membership
from workloads.elastic.group import ElasticGroup, connect_store
from workloads.elastic.membership import MembershipWatch

__all__ = ["BOUNDARY_SLOTS", "InPlaceSession", "Switch"]

_log = logging.getLogger(__name__)

BOUNDARY_SLOTS = 6
"""Slots this adds to the step boundary's summed vector: staying ranks that saw a newer epoch, the sum of those
epochs and of their squares, leaving ranks, joiners arrived as each staying rank counted them, and the new
epoch's world size as each staying rank read it."""

FIRST_MEMBERSHIP_TIMEOUT_S = 120.0
NEXT_MEMBERSHIP_TIMEOUT_S = 120.0
"""How long survivors of a broken collective wait for the provider's word on the next epoch before giving up."""


@dataclass(frozen=True)
class Switch:
    """The ranks agreed to move to a newer epoch after this step.

    `leaving`: this rank's node goes (`membership` is its leave order); `everyone_leaves`: no rank stays, so the
    job stops here (checkpoint and exit, as on SIGTERM).
    """

    membership: Membership
    leaving: bool
    everyone_leaves: bool = False


class InPlaceSession:
    """Everything in-place about one worker process; lives as long as the process."""

    def __init__(self, *, store_endpoint: str, control_dir: Path, backend: str) -> None:
        self.store = connect_store(store_endpoint)
        self.group = ElasticGroup(self.store, backend=backend)
        self.watch = MembershipWatch(control_dir / CONTROL_MEMBERSHIP_FILE, on_urgent=self._urgent)
        self.watch.start()
        node = os.environ.get(ENV_NODE_MARKER) or f"pid{os.getpid()}"
        self.identity = f"{node}/{os.environ.get('LOCAL_RANK', '0')}"
        """Stable across a restart of this worker's node within one epoch (see `ElasticGroup.form`)."""

    def _urgent(self, membership: Membership) -> None:
        _log.warning("epoch %d announced urgently (%s): abandoning the collective in flight",
                     membership.epoch, membership.reason or "a peer failed")
        self.group.abort(below=membership.epoch)

    def first_membership(self, standby_until: datetime | None = None) -> Membership:
        """The launcher's first word. A warm joiner (`standby_until`: the open offer's expiry) waits that long too:
        its model is built, and the accept is what writes its membership."""
        timeout_s = FIRST_MEMBERSHIP_TIMEOUT_S
        if standby_until is not None:
            _log.info("standing by for an open offer until %s: model built, waiting for the accept",
                      standby_until.isoformat(timespec="seconds"))
            timeout_s += max(0.0, (standby_until - datetime.now(UTC)).total_seconds())
        membership = self.watch.wait_newer(-1, timeout_s)
        if membership is None:
            raise RuntimeError(f"no membership from the launcher in {timeout_s:.0f} s ({self.watch.path})")
        return membership

    def next_membership(self) -> Membership:
        """The newest epoch above the current group's, waiting for the provider's word when it has not come yet."""
        current = self.group.epoch if self.group.epoch is not None else -1
        membership = self.watch.wait_newer(current, NEXT_MEMBERSHIP_TIMEOUT_S)
        if membership is None:
            raise RuntimeError(f"a collective of epoch {current} failed and the provider announced no new epoch in "
                               f"{NEXT_MEMBERSHIP_TIMEOUT_S:.0f} s")
        return membership

    def superseded(self, epoch: int) -> bool:
        latest = self.watch.latest
        return latest is not None and latest.epoch > epoch

    # -- the step boundary ----------------------------------------------------------------------------------------

    def _pending(self) -> Membership | None:
        latest = self.watch.latest
        current = self.group.epoch
        return latest if latest is not None and current is not None and latest.epoch > current else None

    def boundary_slots(self) -> list[float]:
        pending = self._pending()
        if pending is None:
            return [0.0] * BOUNDARY_SLOTS
        if not pending.member:
            return [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
        epoch = float(pending.epoch)
        arrived = float(self.store.add(f"hz/e{pending.epoch}/arrived", 0))
        return [1.0, epoch, epoch * epoch, 0.0, arrived, float(pending.world_size)]

    def switch_now(self, slots: list[float]) -> Switch | None:
        """From the summed slots alone (so every rank decides alike): switch now when every staying rank saw the
        same epoch, every other rank its leave order, and each staying rank counted every joiner arrived."""
        pending = self._pending()
        world = self.group.world_size
        seen, epochs, squares, leaving, arrived, new_worlds = (int(value) for value in slots)
        if leaving == world:
            assert pending is not None
            return Switch(membership=pending, leaving=True, everyone_leaves=True)
        staying = world - leaving
        if seen == 0 or seen != staying or seen * squares != epochs * epochs or new_worlds % seen:
            return None  # not every rank has its order yet, or the staying ones saw different epochs
        joiners = new_worlds // seen - staying
        if arrived < seen * joiners:
            return None  # a joiner is still starting (arrivals before a switch are joiners only): keep training
        assert pending is not None
        return Switch(membership=pending, leaving=not pending.member)

    def close(self) -> None:
        self.watch.stop()
        self.group.leave()
