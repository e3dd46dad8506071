"""What an agent has asked its cloud to start early, kept on disk: each notice is approved at most once.

The approvals reach an agent as desired state, which is level-triggered: the same approval is there on every pass,
after every reconnect and after every restart of the agent. Approving is a decision sent to the cloud, so it must
not repeat with the state; this memory, keyed by the cloud's own notice id (Azure's `EventId`), is what makes a
repeated pass, a re-delivery or a restarted agent report the first outcome again instead of asking twice.

At most once, not at least once: the intent (`approving`) is written before the cloud is asked, the outcome after.
An agent that dies in between finds `approving` and reports that the outcome is unknown, rather than ask again; the
notice then starts early or at its scheduled time, both of which its tenants were ready for. Entries older than
`KEEP` are dropped (a notice is long over by then), so the file stays small.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from harmonaize.job_runtime import read_model, write_model_atomically

__all__ = ["KEEP", "ApprovalMemory", "Approving", "Remembered"]

log = logging.getLogger(__name__)

KEEP = timedelta(days=7)


class Approving(StrEnum):
    """Where an agent's own request to its cloud stands."""

    SENDING = "sending"  # written before the request: found after a restart, the outcome is unknown
    APPROVED = "approved"  # the cloud accepted the early start
    REFUSED = "refused"  # the cloud refused, or could not be told


class Remembered(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    state: Approving
    note: str = Field(default="", max_length=300)
    at: datetime


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")

    notices: dict[str, Remembered] = Field(default_factory=dict)


class ApprovalMemory:
    """The notices this host's agent asked its cloud to start early, by the cloud's notice id (a JSON file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._notices = self._load()

    def get(self, notice_id: str) -> Remembered | None:
        return self._notices.get(notice_id)

    def remember(self, notice_id: str, state: Approving, *, at: datetime, note: str = "") -> Remembered:
        """Record `state` for `notice_id` and write the file before returning (the caller acts on it next)."""
        entry = Remembered(state=state, note=note[:300], at=at)
        self._notices = {
            notice: kept for notice, kept in self._notices.items() if at - kept.at < KEEP and notice != notice_id
        }
        self._notices[notice_id] = entry
        write_model_atomically(self.path, _File(notices=self._notices))
        return entry

    def _load(self) -> dict[str, Remembered]:
        try:
            stored = read_model(self.path, _File)
        except (OSError, ValueError, ValidationError) as exc:  # a damaged file must not stop the agent
            log.error("approval memory %s is unreadable, starting empty: %r", self.path, exc)
            return {}
        return {} if stored is None else dict(stored.notices)
