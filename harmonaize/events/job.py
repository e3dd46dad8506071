"""A running job changed shape: a new world size or parallel plan took effect.

Reported by the job itself (its first step after a restart), relayed by the provider, so the tenant sees when an
agreement was actually carried out and from which checkpoint the job resumed, not only when it was agreed.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from harmonaize.events.base import EventData
from harmonaize.events.fields import UtcDatetime
from harmonaize.events.kinds import EventKind
from harmonaize.jobs import ParallelPlan

__all__ = ["JobUpdate"]


class JobUpdate(EventData):
    """The job runs at `world_size` workers with `parallel_plan`, resumed from `resumed_from_step` (None: fresh)."""

    KIND: ClassVar[EventKind] = EventKind.JOB
    VERSION: ClassVar[int] = 1

    epoch: int = Field(ge=0)
    world_size: int = Field(ge=1)
    parallel_plan: ParallelPlan
    step: int = Field(ge=0)
    resumed_from_step: int | None = Field(default=None, ge=0)
    at: UtcDatetime
