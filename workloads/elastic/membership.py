"""Follows the launcher's `membership.json` from a daemon thread, so a change reaches a worker blocked anywhere.

The file is the provider's channel into the job (the job holds no broker credentials): the launcher rewrites it
atomically when the control plane moves the job to a new epoch. A thread polls its `stat` every few milliseconds
(cheaper than a step, and portable where inotify is not) and, on an urgent change (a peer failed or hung), calls
`on_urgent` at once: that is what aborts the collective the main thread is blocked in. Non-urgent changes wait
for the next step boundary, where the ranks agree on when to switch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from harmonaize.job_runtime import Membership, read_model

__all__ = ["MembershipWatch"]

_log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.005


class MembershipWatch:
    """The newest `Membership` in `path`; wakes `wait_newer` callers and fires `on_urgent` for urgent ones."""

    def __init__(
        self,
        path: Path,
        *,
        on_urgent: Callable[[Membership], None] | None = None,
        poll_interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self.path = path
        self._on_urgent = on_urgent
        self._poll_s = poll_interval_s
        self._latest: Membership | None = None
        self._stamp: tuple[int, int] | None = None
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._read()

    @property
    def latest(self) -> Membership | None:
        """The newest membership seen (highest epoch); None until the launcher wrote one."""
        with self._changed:
            return self._latest

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hz-membership", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def wait_newer(self, epoch: int, timeout_s: float) -> Membership | None:
        """The first membership with an epoch above `epoch`, waiting up to `timeout_s`; None if none came."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._latest is None or self._latest.epoch <= epoch:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)
            return self._latest

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            self._read()

    def _read(self) -> None:
        try:
            info = self.path.stat()
        except FileNotFoundError:
            return
        stamp = (info.st_mtime_ns, info.st_ino)
        if stamp == self._stamp:
            return
        try:
            membership = read_model(self.path, Membership)
        except (ValidationError, ValueError, OSError) as exc:
            _log.warning("ignoring unreadable membership %s: %r", self.path, exc)
            self._stamp = stamp
            return
        self._stamp = stamp
        if membership is None:
            return
        with self._changed:
            if self._latest is not None and membership.epoch <= self._latest.epoch:
                return
            self._latest = membership
            self._changed.notify_all()
        if membership.urgent and self._on_urgent is not None:
            self._on_urgent(membership)
