"""Graceful stop: SIGTERM (and SIGINT) only raise a flag; the step boundary turns it into an agreed stop.

torchrun forwards SIGTERM to every worker and gives them about 30 s before SIGKILL. A worker must not exit in the
handler: a rank that leaves mid-collective hangs or breaks the others. The flag travels in the step's agreement
vector (see `trainer`), so every rank stops after the same step, checkpoints it, and exits 0, even when the signal
reached one node's workers a few steps before another's.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

__all__ = ["StopFlag"]

_log = logging.getLogger(__name__)


class StopFlag:
    """Set by SIGTERM/SIGINT (or by `request`); installing it again is harmless."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None

    def install(self) -> None:
        """Install the handlers (main thread only, which is where torchrun runs a worker's script)."""
        if threading.current_thread() is not threading.main_thread():
            _log.warning("not on the main thread: SIGTERM will not stop this run gracefully")
            return
        for signum in self.SIGNALS:
            signal.signal(signum, self._handle)

    def request(self, reason: str = "requested") -> None:
        self.signal_name = self.signal_name or reason
        self._event.set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.request(signal.Signals(signum).name)

    def __bool__(self) -> bool:
        return self._event.is_set()
